"""Replay an allocation trace through the real caching pool.

>>> import gpumem.observe.replay as r
>>> res = r.replay("gpumem/data/resnet50_train_step1.csv.gz", "sim:80GiB")  # doctest: +SKIP
>>> print(res)                                                               # doctest: +SKIP

The device is a string: ``"sim:80GiB"`` (any size with a unit) makes a fresh, private
:class:`gpumem_sim.SimDevice` of that capacity, untouched by and invisible to the sim registry;
``"sim:0"``, ``"cuda:0"``, ``"opencl:0"``, ``"cpu"`` open that device. A
:class:`~gpumem.backends.base.Device` object is used as is.

Every allocation goes through :meth:`gpumem.MemoryManager.malloc` and every free through
``Buffer.free()``: the figures are those of the pool under test, not of a model of it.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Union

import numpy as np

from gpumem.backends import Device, DeviceKind
from gpumem.config import MemoryConfig
from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.observe.trace import OP_ALLOC, Phase, TraceData, read_trace
from gpumem.stats import DeprecatedName, StatsDict, deprecated_names
from gpumem.units import format_bytes, sized_device

__all__ = ["replay", "ReplayResult", "replay_config", "open_replay_device", "CONFIG_PRESETS",
           "REPLAY_OVERRIDES", "environment_settings"]

log = logging.getLogger("gpumem")

ProgressArg = Union[None, bool, Callable[[int, int], Any]]

#: named configurations for the CLI's ``--config``: MemoryConfig's presets
CONFIG_PRESETS = ("default", "inference", "constrained")
#: what a replay changes in a configuration it builds (a preset name or None), and why: the
#: same as ``gpumem tune``'s gpumem rows, so a replay and a tune row of one preset agree
REPLAY_OVERRIDES: dict[str, Any] = {"cpu_fallback_enabled": False, "track_allocations": False,
                                    "track_stacks": False}
REPLAY_OVERRIDES_WHY = ("a replay counts each request the device refuses (an OOM here is a "
                        "CPU fallback there) and tracks no buffers")


def replay_config(name: str | MemoryConfig | None = None, *,
                  environ: Mapping[str, str] | None = None) -> MemoryConfig:
    """The configuration a replay uses. A preset name (``default``, ``inference``,
    ``constrained``; None: default) is read as every manager reads its settings: the preset,
    with the ``GPUMEM_*`` variables of ``environ`` (default ``os.environ``) over it
    (:meth:`MemoryConfig.from_env`, which warns about a misspelt one), then
    :data:`REPLAY_OVERRIDES` (CPU fallback and tracking off: :data:`REPLAY_OVERRIDES_WHY`).
    Its free-memory margin and memory fraction stay: ``replay_config("default")`` is
    ``gpumem tune``'s ``MemoryConfig.default()`` row. A MemoryConfig is returned unchanged
    (as ``MemoryManager(device, config)`` takes it: no environment)."""
    if isinstance(name, MemoryConfig):
        return name
    if name is None or name == "default":
        base = MemoryConfig.default()
    elif name == "inference":
        base = MemoryConfig.for_inference()
    elif name == "constrained":
        base = MemoryConfig.for_constrained()
    else:
        raise InvalidInputError(f"unknown config {name!r}; choose one of "
                                f"{', '.join(CONFIG_PRESETS)} or pass a MemoryConfig")
    return MemoryConfig.from_env(environ, base=base).replace(**REPLAY_OVERRIDES)


def environment_settings(environ: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """``(taken, ignored)``: the ``GPUMEM_<FIELD>=value`` settings of ``environ`` that a
    replay built from a preset takes (sizes with the reading taken), and those it overrides
    (:data:`REPLAY_OVERRIDES`; GPUMEM_DEBUG turns tracking on, which a replay keeps off)."""
    from gpumem.config import env_settings
    env = os.environ if environ is None else environ
    taken, ignored = [], []
    for name, text in env_settings(env).items():
        (ignored if name in REPLAY_OVERRIDES else taken).append(text)
    if "GPUMEM_DEBUG" in env:
        ignored.append(f"GPUMEM_DEBUG={env['GPUMEM_DEBUG']}")
    return taken, ignored


def open_replay_device(device: str | Device) -> Device:
    """``"sim:<size>"`` -> a new private SimDevice; another string -> that device (both as
    :func:`gpumem.backends.open_device` reads every device string)."""
    if isinstance(device, Device):
        return device
    if not isinstance(device, str):
        raise InvalidInputError(f"device must be a string such as 'sim:80GiB' or 'cuda:0', or a "
                                f"Device, got {type(device).__name__} {device!r}")
    from gpumem.backends import open_device
    return open_device(device)


def _device_label(dev: Device) -> str:
    """``sim:2GB (2.00 GB = 1.86 GiB)`` for a private sim device (the size as read), else
    the device string."""
    s = dev.device_string
    if dev.kind is DeviceKind.SIMULATED and getattr(dev, "index", 0) < 0:
        total = dev.properties().total_memory
        label = sized_device(s, total)
        return label if label != s else f"sim({format_bytes(total)})"
    return s


@dataclass
class ReplayResult:
    """What a replay measured. Byte figures are exact; ``peak_live_bytes`` counts requested
    bytes (what the program asked for), ``peak_reserved_bytes`` what the pool held from the
    device, so ``reserved_live_ratio`` is the pool's overhead (1.0 is ideal)."""

    trace: str
    device: str
    capacity: int
    events: int
    num_allocs: int                 # the trace's allocation events replayed
    num_frees: int                  # ... and its free events
    peak_live_bytes: int
    peak_in_use_bytes: int
    peak_reserved_bytes: int
    reserved_live_ratio: float
    hit_rate: float
    pool_hits: int
    pool_misses: int
    segments_peak: int
    segments_created: int
    segments_released: int
    num_ooms: int
    failed_bytes: int
    skipped_frees: int
    cpu_fallbacks: int
    duration_s: float
    events_per_second: float
    fragmentation_at_peak: float
    cached_at_peak: int = 0
    #: segments held at the moment of peak live bytes (``segments_peak`` is the most held at
    #: any moment of the replay, which may come later)
    segments_at_peak_live: int = 0
    #: driver calls the pool made: segment allocs and frees, and virtual-memory calls
    #: (reserve, create, map, unmap, release, free) of expandable segments
    driver_calls: int = 0
    #: seconds the replay's driver calls would take on a GPU, from the device's cost model
    #: (:mod:`gpumem_sim.driver_costs`); 0.0 on a backend without one
    modeled_driver_seconds: float = 0.0
    #: ``{call: [count, seconds]}`` behind ``modeled_driver_seconds``
    modeled_driver_breakdown: dict[str, list] = field(default_factory=dict, repr=False)
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    #: ``{"live": int64[n], "reserved": int64[n], "t_ns": int64[n]}`` after each event, with
    #: ``record_series=True``
    series: dict[str, np.ndarray] | None = field(default=None, repr=False)
    #: :func:`gpumem.observe.snapshot.take_snapshot` at ``snapshot_at``
    snapshot: dict | None = field(default=None, repr=False)

    hits = DeprecatedName("pool_hits")
    misses = DeprecatedName("pool_misses")
    allocs = DeprecatedName("num_allocs")
    frees = DeprecatedName("num_frees")

    @property
    def segments(self) -> int:
        """Peak number of segments held at once."""
        return self.segments_peak

    def as_dict(self) -> StatsDict:
        d = ReplayResultDict({k: getattr(self, k) for k in self.__dataclass_fields__
                              if k not in ("series", "snapshot")})
        d["series_length"] = 0 if self.series is None else int(len(self.series["live"]))
        return d

    def __str__(self) -> str:
        fb = format_bytes
        lines = [
            f"replay of {self.trace} on {self.device}"
            + ("" if fb(self.capacity) in self.device else f" ({fb(self.capacity)})"),
            f"  events          {self.events:,} ({self.num_allocs:,} allocs, {self.num_frees:,} frees) "
            f"in {self.duration_s:.3f} s = {self.events_per_second:,.0f} events/s"
            + (f"; driver time on a GPU (modeled) {_fmt_seconds(self.modeled_driver_seconds)}"
               if self.modeled_driver_seconds else ""),
            f"  peak live       {fb(self.peak_live_bytes)} requested "
            f"({fb(self.peak_in_use_bytes)} after rounding)",
            f"  peak reserved   {fb(self.peak_reserved_bytes)} "
            f"-> reserved/live {self.reserved_live_ratio:.3f}",
            f"  cache           {self.pool_hits:,} hits, {self.pool_misses:,} misses "
            f"(hit rate {self.hit_rate:.1%})",
            f"  segments        {self.segments_peak} held at most, {self.segments_at_peak_live} at "
            f"peak live; {self.segments_created} created, "
            f"{self.segments_released} released; {self.driver_calls:,} driver calls"
            + (f" (segments={self.config['segments']})" if self.config.get("segments") else ""),
            f"  at peak live    {fb(self.cached_at_peak)} cached (free in segments), "
            f"fragmentation {self.fragmentation_at_peak:.1%} (1 - largest free block / cached)",
        ]
        if self.num_ooms:
            lines.append(f"  OUT OF MEMORY   {self.num_ooms:,} request(s) failed "
                         f"({fb(self.failed_bytes)}); their frees were skipped")
        if self.skipped_frees and not self.num_ooms:
            lines.append(f"  skipped frees   {self.skipped_frees:,}")
        if self.cpu_fallbacks:
            lines.append(f"  CPU fallbacks   {self.cpu_fallbacks:,}")
        return "\n".join(lines)


class ReplayResultDict(StatsDict):
    what = "ReplayResult.as_dict()"
    renamed = deprecated_names(ReplayResult)


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.2f} s"


def _driver_meter(dev: Device) -> tuple[float, dict]:
    """The device's modeled driver seconds and breakdown so far ((0.0, {}) without a model)."""
    seconds = getattr(dev, "modeled_driver_seconds", None)
    if not isinstance(seconds, float):
        return 0.0, {}
    return seconds, dict(dev.modeled_driver_breakdown)  # type: ignore[attr-defined]


class _OomFilter(logging.Filter):
    """Drops the manager's OOM warnings logged by one thread after the first few, counting
    them, so a replay on a too-small device logs a handful of lines, not one per request."""

    def __init__(self, thread_id: int, keep: int = 1) -> None:
        super().__init__()
        self.thread_id = thread_id
        self.keep = keep
        self.seen = 0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread_id or record.levelno != logging.WARNING:
            return True
        args = record.args
        if isinstance(args, tuple) and args and isinstance(args[0], OutOfMemoryError):
            self.seen += 1
            if self.seen > self.keep:
                self.dropped += 1
                return False
        return True


@contextmanager
def _quiet_repeated_ooms() -> Iterator[_OomFilter]:
    logger = logging.getLogger("gpumem")
    filt = _OomFilter(threading.get_ident())
    logger.addFilter(filt)
    try:
        yield filt
    finally:
        logger.removeFilter(filt)


class _Progress:
    """tqdm when installed (and asked for), else a line on stderr every few percent; or a
    user callable ``f(done, total)``."""

    def __init__(self, progress: ProgressArg, total: int, label: str) -> None:
        self.total = total
        self.callback: Callable[[int, int], Any] | None = None
        self.bar = None
        self.last_pct = -1
        if callable(progress) and not isinstance(progress, bool):
            self.callback = progress
        elif progress:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=label, unit="ev", unit_scale=True,
                                leave=False, file=sys.stderr)
            except ImportError:
                self.callback = self._stderr
                self.label = label
        self.step = max(1000, total // 200)

    def _stderr(self, done: int, total: int) -> None:
        pct = 100 * done // total if total else 100
        if pct // 10 != self.last_pct // 10 or done == total:
            self.last_pct = pct
            end = "\n" if done >= total else ""
            print(f"\r{self.label}: {pct:3d}% ({done:,}/{total:,} events)", end=end,
                  file=sys.stderr, flush=True)

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif self.callback is not None:
            self.callback(done, self.total)

    def close(self, done: int) -> None:
        self.update(done)
        if self.bar is not None:
            self.bar.close()

    @property
    def active(self) -> bool:
        return self.bar is not None or self.callback is not None


def _as_trace(trace: Any, phase: str | Phase | None) -> TraceData:
    if isinstance(trace, TraceData):
        data = trace
    elif hasattr(trace, "to_trace"):        # a HistoryRecorder
        data = trace.to_trace()
    else:
        data = read_trace(trace)
    if phase is not None:
        data = data.select(phase)
    return data


def replay(trace: Any, device: str | Device = "sim:80GiB",
           config: MemoryConfig | str | None = None, *, phase: str | Phase | None = None,
           progress: ProgressArg = None, record_series: bool = False,
           snapshot_at: int | str | None = None, stop_on_oom: bool = False) -> ReplayResult:
    """Replay ``trace`` (a path, a :class:`~gpumem.observe.trace.TraceData` or a HistoryRecorder)
    through a new :class:`~gpumem.MemoryManager` on ``device`` and measure the pool.

    - ``config``: a MemoryConfig (used as it is), or a preset name read with the
      ``GPUMEM_*`` variables like every manager (default ``"default"``; see
      :func:`replay_config`: CPU fallback and tracking off, the free-memory margin kept);
    - ``phase``: replay only that phase (see :meth:`TraceData.select`: buffers live when the
      phase begins are allocated first, those still live at its end are freed);
    - ``progress``: True for a progress bar (tqdm if installed, else stderr), or a callable
      ``f(done, total)``;
    - ``record_series``: keep live and reserved bytes after every event in ``result.series``;
    - ``snapshot_at``: ``"peak"`` (after the event where live bytes peak) or an event index:
      ``result.snapshot`` is :func:`gpumem.observe.snapshot.take_snapshot` at that moment;
    - a request the device cannot serve (OutOfMemoryError) is counted in ``num_ooms`` and its
      free skipped; with ``stop_on_oom`` the error is raised instead.

    The manager is closed at the end, so the device is left as it was found.
    """
    from gpumem.manager.memory_manager import MemoryManager

    data = _as_trace(trace, phase)
    cfg = replay_config(config) if not isinstance(config, MemoryConfig) else config
    dev = open_replay_device(device)
    n = len(data)
    ops = data.ops.tolist()
    ids = data.ids.tolist()
    sizes = data.sizes.tolist()
    snap_index = -2
    if snapshot_at == "peak":
        snap_index = data.peak_index
    elif snapshot_at is not None:
        if isinstance(snapshot_at, bool) or not isinstance(snapshot_at, int) \
                or not 0 <= snapshot_at < max(n, 1):
            raise InvalidInputError(f"snapshot_at must be 'peak' or an event index in "
                                    f"[0, {n}), got {snapshot_at!r}")
        snap_index = snapshot_at
    peak_event = data.peak_index
    if record_series:
        live_series = np.zeros(n, dtype=np.int64)
        reserved_series = np.zeros(n, dtype=np.int64)
    bar = _Progress(progress, n, f"replay {data.name}")

    modeled0, breakdown0 = _driver_meter(dev)   # the manager's own set-up calls count too
    mm = MemoryManager(dev, cfg)
    pool = mm.pool
    handles: dict[int, Any] = {}
    live = peak_live = 0
    num_ooms = failed_bytes = skipped = 0
    reserved = peak_reserved = 0
    nseg = peak_seg = 0
    frag_at_peak = 0.0
    cached_at_peak = seg_at_peak_live = 0
    snapshot = None
    malloc = mm.malloc
    pop = handles.pop
    ALLOC = OP_ALLOC
    step = bar.step if bar.active else n + 1
    next_tick = step
    try:
        with _quiet_repeated_ooms() as quiet:
            t0 = time.perf_counter()
            for k in range(n):
                i = ids[k]
                if ops[k] == ALLOC:
                    s = sizes[k]
                    try:
                        handles[i] = malloc(s)
                    except OutOfMemoryError:
                        num_ooms += 1
                        failed_bytes += s
                        if stop_on_oom:
                            raise
                    else:
                        live += s
                        if live > peak_live:
                            peak_live = live
                else:
                    buf = pop(i, None)
                    if buf is None:
                        skipped += 1
                    else:
                        buf.free()
                        live -= sizes[k]
                r = pool.reserved_bytes
                if r != reserved:
                    reserved = r
                    if r > peak_reserved:
                        peak_reserved = r
                    nseg = pool.counters()["num_segments"]
                    if nseg > peak_seg:
                        peak_seg = nseg
                if record_series:
                    live_series[k] = live
                    reserved_series[k] = r
                if k == peak_event:
                    st = mm.stats()
                    frag_at_peak = st.fragmentation_ratio()
                    cached_at_peak = st.cached_bytes
                    seg_at_peak_live = st.num_segments
                if k == snap_index:
                    from gpumem.observe.snapshot import take_snapshot
                    snapshot = take_snapshot(mm)
                    snapshot["device"] = _device_label(dev)
                    snapshot["event_index"] = k
                    snapshot["trace"] = data.name
                if k >= next_tick:
                    bar.update(k)
                    next_tick += step
            duration = time.perf_counter() - t0
            # like driver_calls: the replay's calls, not those of the close() below
            modeled1, breakdown1 = _driver_meter(dev)
            bar.close(n)
            bar = None
            if quiet.dropped:
                log.warning("replay of %s: %d request(s) failed for lack of memory on %s "
                            "(%d warnings like the one above not shown)", data.name, num_ooms,
                            _device_label(dev), quiet.dropped)
        stats = mm.stats()
        counters = pool.counters()
        driver_calls = counters["segments_created"] + counters["segments_released"]
        if mm.expandable_segments is not None:
            driver_calls += mm.expandable_segments.driver_calls - mm.expandable_segments.segment_events
    finally:
        if bar is not None and bar.bar is not None:
            bar.bar.close()
        for buf in handles.values():          # left live by the trace: free before closing
            try:
                buf.free()
            except Exception:
                pass
        handles.clear()
        mm.close()
    peak_reserved = max(peak_reserved, counters["peak_reserved_bytes"])
    return ReplayResult(
        trace=data.name, device=_device_label(dev), capacity=mm.total_memory, events=n,
        num_allocs=data.n_allocs, num_frees=data.n_frees,
        peak_live_bytes=peak_live, peak_in_use_bytes=counters["peak_in_use_bytes"],
        peak_reserved_bytes=peak_reserved,
        reserved_live_ratio=(peak_reserved / peak_live) if peak_live else 0.0,
        hit_rate=stats.hit_rate(), pool_hits=stats.pool_hits, pool_misses=stats.pool_misses,
        segments_peak=peak_seg, segments_created=counters["segments_created"],
        segments_released=counters["segments_released"], num_ooms=num_ooms,
        failed_bytes=failed_bytes, skipped_frees=skipped, cpu_fallbacks=stats.cpu_fallbacks,
        duration_s=duration, events_per_second=(n / duration) if duration > 0 else 0.0,
        fragmentation_at_peak=frag_at_peak, cached_at_peak=cached_at_peak,
        segments_at_peak_live=seg_at_peak_live,
        driver_calls=driver_calls,
        modeled_driver_seconds=modeled1 - modeled0,
        modeled_driver_breakdown={
            c: [k - breakdown0.get(c, (0, 0.0))[0], s - breakdown0.get(c, (0, 0.0))[1]]
            for c, (k, s) in breakdown1.items() if k > breakdown0.get(c, (0, 0.0))[0]},
        config={"expandable_segments": mm.expandable_segments is not None,
                # the policy in force: plain wherever the device has no virtual memory
                "segments": cfg.segment_policy if mm.expandable_segments is not None
                else "plain",
                "gpu_memory_fraction": cfg.gpu_memory_fraction,
                "cpu_fallback_enabled": cfg.cpu_fallback_enabled,
                "min_free_bytes": cfg.min_free_bytes, "max_pool_size": cfg.max_pool_size,
                "max_split_size": cfg.max_split_size},
        series=({"live": live_series, "reserved": reserved_series,
                 "t_ns": data.t_ns.copy()} if record_series else None),
        snapshot=snapshot)


class _CallableModule(type(sys)):
    """Lets ``gpumem.replay(trace, ...)`` call :func:`replay` while ``gpumem.observe.replay`` stays this
    module (so ``gpumem.observe.replay.ReplayResult`` and ``import gpumem.observe.replay`` keep working)."""

    def __call__(self, *args: Any, **kwargs: Any) -> ReplayResult:
        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
