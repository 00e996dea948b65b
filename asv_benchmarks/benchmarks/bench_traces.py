"""Replay of the real allocation traces (gpumem/data/traces/*.csv.gz) through a MemoryManager
on a 1 TiB simulated device.

- ``TraceReplay.time_replay_cold``: a fresh manager replays the whole trace (segments are created
  on the way), then closes.
- ``TraceReplay.time_replay_warm``: the same manager replays it again (its cache is populated).
- ``TracePeaks.track_peak_reserved_bytes_<trace>`` (bytes) and ``track_reserved_over_live_<trace>``:
  the peak of bytes held from the device in one cold replay, and that over the trace's peak of
  live requested bytes (1.0 is ideal; the traces README gives pyopencl's MemoryPool on PoCL as
  1.358 / 1.316 / 2.472 / 3.232 for gpt2_train / resnet50_train / gpt2_generate /
  bert_varlen_infer).
"""
from . import read_trace, replay, sim_manager, trace_names

TRACES = trace_names()


def _need(name):
    if name not in TRACES:
        raise NotImplementedError(f"trace {name!r} not found (set GPUMEM_TRACES)")
    return read_trace(name)


class TraceReplay:
    params = [TRACES or ["<no traces>"]]
    param_names = ["trace"]
    number = 1
    repeat = (2, 5, 30.0)
    timeout = 300

    def setup(self, name):
        self.trace = _need(name)
        self.warm = sim_manager()
        replay(self.trace, self.warm.malloc, self.warm.free)

    def teardown(self, name):
        self.warm.close()

    def time_replay_cold(self, name):
        mm = sim_manager()
        try:
            replay(self.trace, mm.malloc, mm.free)
        finally:
            mm.close()

    def time_replay_warm(self, name):
        replay(self.trace, self.warm.malloc, self.warm.free)


_peaks: dict = {}


def peak_of(name):
    """(peak reserved bytes, peak in-use bytes, peak live requested bytes) of a cold replay."""
    if name not in _peaks:
        trace = _need(name)
        mm = sim_manager()
        try:
            replay(trace, mm.malloc, mm.free)
            c = mm.pool.counters()
            _peaks[name] = (c["peak_reserved_bytes"], c["peak_in_use_bytes"], trace.peak_live)
        finally:
            mm.close()
    return _peaks[name]


class TracePeaks:
    """Device-memory figures as track_ benchmarks (asv's peakmem_ sees host memory only)."""

    timeout = 300


def _add_trace_tracks(name):
    ident = "".join(ch if ch.isalnum() else "_" for ch in name)

    def peak_reserved(self):
        return peak_of(name)[0]

    peak_reserved.unit = "bytes"

    def reserved_over_live(self):
        reserved, _, live = peak_of(name)
        return reserved / live

    reserved_over_live.unit = "ratio"

    setattr(TracePeaks, f"track_peak_reserved_bytes_{ident}", peak_reserved)
    setattr(TracePeaks, f"track_reserved_over_live_{ident}", reserved_over_live)


for _name in TRACES:
    _add_trace_tracks(_name)
