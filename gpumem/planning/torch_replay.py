"""Replay an allocation trace through :class:`~gpumem.planning.torch_model.TorchAllocatorModel`:
the figures PyTorch's caching allocator would reach on the same workload.

>>> res = replay_torch_model("gpumem/data/traces/gpt2_train.csv.gz", capacity="24GiB",
...                          conf="expandable_segments:True")        # doctest: +SKIP
>>> res.peak_reserved_bytes, res.num_ooms                             # doctest: +SKIP

The figures match :class:`gpumem.observe.replay.ReplayResult` where both exist
(``peak_live_bytes``, ``peak_reserved_bytes``, ``reserved_live_ratio``, ``num_ooms``,
``driver_calls``, ``series``), so the two allocators can be set side by side. A trace with a
``stream`` column (an imported PyTorch snapshot) is replayed stream by stream, as torch keeps
a pool per stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.planning.torch_model import TorchAllocatorModel
from gpumem.stats import DeprecatedName, StatsDict, deprecated_names
from gpumem.units import format_bytes

__all__ = ["replay_torch_model", "TorchReplayResult"]


@dataclass
class TorchReplayResult:
    """What a replay through the PyTorch allocator model measured (bytes are exact)."""

    trace: str
    capacity: int
    conf: str
    events: int
    num_allocs: int                 # the trace's allocation events replayed
    num_frees: int                  # ... and its free events
    #: requested bytes live at once (what the program asked for)
    peak_live_bytes: int
    #: bytes of the blocks handed out (after torch's rounding)
    peak_allocated_bytes: int
    #: bytes held from the device: cudaMalloc'd segments and mapped pages
    peak_reserved_bytes: int
    reserved_live_ratio: float
    num_ooms: int
    failed_bytes: int
    skipped_frees: int
    #: cudaMalloc calls that failed and were retried after releasing cached blocks
    num_alloc_retries: int
    driver_calls: int
    driver_call_counts: dict[str, int]
    #: modeled seconds of the driver calls (None without ``gpumem_sim.driver_costs``)
    modeled_driver_seconds: float | None
    memory_fraction: float | None
    duration_s: float
    allocator: str = "torch"
    #: ``{"live", "reserved", "t_ns"}`` int64 arrays after each event, with ``record_series``
    series: dict[str, np.ndarray] | None = field(default=None, repr=False)

    allocs = DeprecatedName("num_allocs")
    frees = DeprecatedName("num_frees")

    @property
    def device(self) -> str:
        return f"torch model ({format_bytes(self.capacity)})"

    @property
    def events_per_second(self) -> float:
        return self.events / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> StatsDict:
        d = TorchReplayResultDict({k: getattr(self, k) for k in self.__dataclass_fields__
                                   if k != "series"})
        d["driver_call_counts"] = dict(self.driver_call_counts)
        d["series_length"] = 0 if self.series is None else int(len(self.series["live"]))
        return d

    def __str__(self) -> str:
        fb = format_bytes
        lines = [
            f"replay of {self.trace} through the PyTorch allocator model on "
            f"{fb(self.capacity)}, PYTORCH_CUDA_ALLOC_CONF={self.conf!r}"
            + ("" if self.memory_fraction is None else
               f", memory fraction {self.memory_fraction:g}"),
            f"  events          {self.events:,} ({self.num_allocs:,} allocs, {self.num_frees:,} frees) "
            f"in {self.duration_s:.3f} s",
            f"  peak live       {fb(self.peak_live_bytes)} requested "
            f"({fb(self.peak_allocated_bytes)} after rounding)",
            f"  peak reserved   {fb(self.peak_reserved_bytes)} "
            f"-> reserved/live {self.reserved_live_ratio:.3f}",
            f"  driver calls    {self.driver_calls:,}"
            + ("" if self.modeled_driver_seconds is None else
               f" (modeled {self.modeled_driver_seconds * 1e3:.1f} ms)")
            + (f", {self.num_alloc_retries:,} retried after freeing the cache"
               if self.num_alloc_retries else ""),
        ]
        if self.num_ooms:
            lines.append(f"  OUT OF MEMORY   {self.num_ooms:,} request(s) failed "
                         f"({fb(self.failed_bytes)}); their frees were skipped")
        return "\n".join(lines)


class TorchReplayResultDict(StatsDict):
    what = "TorchReplayResult.as_dict()"
    renamed = deprecated_names(TorchReplayResult)


def _load(trace: Any, phase: Any) -> Any:
    from gpumem.observe.trace import TraceData, read_trace
    if isinstance(trace, TraceData):
        data = trace
    elif hasattr(trace, "to_trace"):                # a HistoryRecorder
        data = trace.to_trace()
    else:
        data = read_trace(trace)
    return data if phase is None else data.select(phase)


def _streams(data: Any) -> list[int] | None:
    """The trace's ``stream`` column as small ints (torch orders its pools by stream), or
    None when it has none."""
    column = data.extra.get("stream")
    if not column:
        return None
    ids: dict[str, int] = {}
    for s in column:
        if s not in ids:
            ids[s] = len(ids)
    try:        # numeric stream handles keep their order
        order = sorted(ids, key=lambda s: int(s, 0))
    except ValueError:
        order = list(ids)
    rank = {s: i for i, s in enumerate(order)}
    return [rank[s] for s in column]


def replay_torch_model(trace: Any, *, capacity: int | str, conf: str = "",
                       memory_fraction: float | None = None, phase: Any = None,
                       record_series: bool = False,
                       stop_on_oom: bool = False) -> TorchReplayResult:
    """Replay ``trace`` (a path, a :class:`~gpumem.observe.trace.TraceData` or a
    HistoryRecorder) through a new :class:`TorchAllocatorModel` of ``capacity`` bytes (an
    int or a size such as ``"24GiB"``) with PYTORCH_CUDA_ALLOC_CONF ``conf``.

    A request the model refuses (torch's OutOfMemoryError after its release and retry) is
    counted in ``num_ooms`` and its free skipped, as :func:`gpumem.replay` does.
    ``record_series`` keeps live and reserved bytes after every event in ``result.series``.
    With ``stop_on_oom`` the first refusal raises OutOfMemoryError instead (a caller that
    only asks "does it fit" need not replay the rest).
    """
    if not isinstance(record_series, bool):
        raise InvalidInputError(f"record_series must be a bool, got {record_series!r}")
    data = _load(trace, phase)
    model = TorchAllocatorModel(capacity, conf, memory_fraction=memory_fraction)
    n = len(data)
    ops, ids, sizes = data.ops.tolist(), data.ids.tolist(), data.sizes.tolist()
    streams = _streams(data)
    if record_series:
        live_series = np.zeros(n, dtype=np.int64)
        reserved_series = np.zeros(n, dtype=np.int64)
    handles: dict[int, int] = {}
    live = peak_live = num_ooms = failed = skipped = 0
    malloc, free, pop = model.malloc, model.free, handles.pop
    t0 = time.perf_counter()
    for k in range(n):
        if ops[k] == 0:
            s = sizes[k]
            try:
                handles[ids[k]] = malloc(s, streams[k] if streams else 0)
            except OutOfMemoryError:
                if stop_on_oom:
                    raise
                num_ooms += 1
                failed += s
            else:
                live += s
                if live > peak_live:
                    peak_live = live
        else:
            addr = pop(ids[k], None)
            if addr is None:
                skipped += 1
            else:
                free(addr)
                live -= sizes[k]
        if record_series:
            live_series[k] = live
            reserved_series[k] = model.reserved_bytes
    duration = time.perf_counter() - t0
    peak = model.peak_reserved_bytes
    return TorchReplayResult(
        trace=data.name, capacity=model.capacity, conf=model.conf.text, events=n,
        num_allocs=data.n_allocs, num_frees=data.n_frees, peak_live_bytes=peak_live,
        peak_allocated_bytes=model.peak_allocated_bytes, peak_reserved_bytes=peak,
        reserved_live_ratio=peak / peak_live if peak_live else 0.0, num_ooms=num_ooms,
        failed_bytes=failed, skipped_frees=skipped, num_alloc_retries=model.num_alloc_retries,
        driver_calls=model.driver_calls, driver_call_counts=dict(model.driver_call_counts),
        modeled_driver_seconds=model.modeled_driver_seconds, memory_fraction=memory_fraction,
        duration_s=duration,
        series=({"live": live_series, "reserved": reserved_series, "t_ns": data.t_ns.copy()}
                if record_series else None))
