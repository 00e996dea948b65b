"""Sleep and wake (issue 40): the modeled driver time of sleep + wake per GiB slept, gpumem
against torch_memory_saver's design (one handle per allocation, no cache), each shipped trace
replayed in one tag up to its peak of live bytes on sim (gpumem_sim/driver_costs.py, the H200
table). The logic is asv_benchmarks/sleep_wake.py's (also runnable as a script).

- ``track_sleep_wake_ms_per_gib``: modeled driver ms of one sleep + wake per GiB slept
  (``design``: gpumem without backup, gpumem with backup, torch_memory_saver).
- ``track_replay_modeled_ms``: modeled driver ms of the replay up to the peak (the cache's part).
"""
import sys

from gpumem.observe.trace import read_trace

from . import ASV_DIR, trace_names, traces_dir

sys.path.insert(0, str(ASV_DIR))
import sleep_wake  # noqa: E402

TRACES = trace_names()
DESIGNS = ["gpumem", "gpumem-backup", "torch_memory_saver"]
_results: dict = {}


def _run(name, design):
    key = (name, design)
    if key not in _results:
        if name not in TRACES:
            raise NotImplementedError(f"trace {name!r} not found (set GPUMEM_TRACES)")
        data = read_trace(traces_dir() / f"{name}.csv.gz")
        upto = sleep_wake._peak_index(data)
        if design == "gpumem-backup" and _run(name, "gpumem")["live"] > sleep_wake.BACKUP_TRACE_LIMIT:
            raise NotImplementedError("backups are copied only for traces of <= 1 GiB live")
        if design == "torch_memory_saver":
            _results[key] = sleep_wake.tms_cycle(data, upto, 1)
        else:
            _results[key] = sleep_wake.gpumem_cycle(data, upto, 1,
                                                    backup=design == "gpumem-backup")
    return _results[key]


class SleepWake:
    params = [TRACES or ["<no traces>"], DESIGNS]
    param_names = ["trace", "design"]
    timeout = 600
    number = 1
    repeat = 1

    def setup(self, name, design):
        if name not in TRACES:
            raise NotImplementedError(f"trace {name!r} not found (set GPUMEM_TRACES)")

    def track_sleep_wake_ms_per_gib(self, name, design):
        return _run(name, design)["ms_per_gib"]

    track_sleep_wake_ms_per_gib.unit = "ms/GiB"

    def track_replay_modeled_ms(self, name, design):
        return _run(name, design)["replay_ms"]

    track_replay_modeled_ms.unit = "ms"
