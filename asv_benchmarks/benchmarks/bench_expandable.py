"""Expandable segments off vs on, each trace of gpumem/data/traces replayed with
:func:`gpumem.observe.replay` on a fresh sim:80GiB under the default, constrained and inference presets
(peers in one run: the ``expandable`` parameter: off, on (one page per physical handle, the
default), or on with 20 MiB physical handles).

- ``track_physical_over_live``: peak physical bytes (the pool's peak reserved bytes; with
  expandable segments exactly the mapped pages) over peak live requested bytes. Goal <= 1.02.
- ``track_driver_calls``: segment allocs/frees plus virtual-memory calls.
- ``track_modeled_driver_ms``: what those calls would cost on a CUDA GPU
  (gpumem_sim.driver_costs).
- ``track_events_per_second``: replay speed, events/s, of the same replay.
- ``time_replay``: the replay itself, timed by asv.
"""
from gpumem.observe.replay import replay, replay_config
from gpumem.observe.trace import read_trace

from . import trace_names, traces_dir

TRACES = trace_names()
PRESETS = ["default", "constrained", "inference"]
MODES = ["off", "on", "on-20MiB-handles"]
_results: dict = {}


def _config(preset, expandable):
    cfg = replay_config(preset).replace(expandable_segments=expandable != "off")
    if expandable == "on-20MiB-handles":
        cfg = cfg.replace(expandable_handle_size=20 << 20)
    return cfg


def _replay(name, preset, expandable):
    key = (name, preset, expandable)
    if key not in _results:
        if name not in TRACES:
            raise NotImplementedError(f"trace {name!r} not found (set GPUMEM_TRACES)")
        data = read_trace(traces_dir() / f"{name}.csv.gz")
        _results[key] = replay(data, "sim:80GiB", _config(preset, expandable))
    return _results[key]


class ExpandableSegments:
    params = [TRACES or ["<no traces>"], PRESETS, MODES]
    param_names = ["trace", "config", "expandable"]
    timeout = 300
    number = 1
    repeat = (2, 5, 30.0)

    def setup(self, name, preset, expandable):
        if name not in TRACES:
            raise NotImplementedError(f"trace {name!r} not found (set GPUMEM_TRACES)")
        self.data = read_trace(traces_dir() / f"{name}.csv.gz")
        self.cfg = _config(preset, expandable)

    def time_replay(self, name, preset, expandable):
        replay(self.data, "sim:80GiB", self.cfg)

    def track_physical_over_live(self, name, preset, expandable):
        return _replay(name, preset, expandable).reserved_live_ratio

    track_physical_over_live.unit = "ratio"

    def track_driver_calls(self, name, preset, expandable):
        return _replay(name, preset, expandable).driver_calls

    track_driver_calls.unit = "calls"

    def track_modeled_driver_ms(self, name, preset, expandable):
        return _replay(name, preset, expandable).modeled_driver_seconds * 1e3

    track_modeled_driver_ms.unit = "ms"

    def track_events_per_second(self, name, preset, expandable):
        return _replay(name, preset, expandable).events_per_second

    track_events_per_second.unit = "events/s"
