"""``with manager.measure() as m:`` -- what one block of code did to a manager's memory.

Example::

    with mm.measure() as m:
        step(model, batch)
    print(m.stats.num_allocs, m.stats.pool_hits, m.stats.pool_misses, m.stats.peak_in_use_bytes)
    print(m.stats)           # one line a person reads

``m.stats`` (a :class:`MeasuredStats`, set when the block exits, also after an exception)
holds the changes of the manager's counters inside the block -- ``num_allocs``, ``num_frees``,
``pool_hits``, ``pool_misses``, segments, CPU fallbacks, ``num_ooms``, the net change of in-use
and reserved bytes -- and the peak in-use and reserved bytes *within* the block (the names of
gpumem.stats' vocabulary; the old ``allocations``/``frees``/``hits``/``misses``/``ooms`` still
read, with a DeprecationWarning). The counters are the manager's, so work of
other threads on the same manager during the block is counted too.

The peak of a block costs nothing on the hot path: entering a block resets the pool's peak
counters (C atomics) after folding their values into :class:`PeakWindows` (a part of the
manager), which keeps the manager's peaks since creation / ``reset_peak_stats()`` as a floor
(``stats()`` reports the larger), and the peaks so far of every block still open, so blocks may
nest or overlap across threads. The one approximation: a peak that another thread reaches *and leaves* in the instant
between reading the counters and resetting them, as a block is entered, is not seen.

Thread safety: a manager's :class:`PeakWindows` (its open blocks and its floor) is owned by that
manager and guarded by its own ``threading.Lock``; under it only the pool's peak counters are
read or reset (atomics, no driver call, no Python callback).
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from gpumem.errors import ClosedManagerError, InvalidInputError
from gpumem.stats import DeprecatedName, StatsDict, deprecated_names
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem.manager.interfaces import MeasuredManager
    from gpumem.manager.miss_path import MissPath

__all__ = ["Measurement", "MeasuredStats", "PeakWindows"]


@dataclass(frozen=True)
class MeasuredStats:
    """What changed on one manager inside a ``measure()`` block."""

    device: str
    num_allocs: int                 # device allocations served (from the cache or new segments)
    num_frees: int
    pool_hits: int                  # served from the cache
    pool_misses: int                # needed a new segment or expandable growth
    segments_created: int
    segments_released: int
    cpu_fallbacks: int
    num_ooms: int
    in_use_bytes_change: int        # net: bytes in use at exit minus at entry
    reserved_bytes_change: int      # net: bytes held from the device at exit minus at entry
    peak_in_use_bytes: int          # the most bytes in use at any moment inside the block
    peak_reserved_bytes: int        # the most bytes held from the device inside the block
    seconds: float

    allocations = DeprecatedName("num_allocs")
    frees = DeprecatedName("num_frees")
    hits = DeprecatedName("pool_hits")
    misses = DeprecatedName("pool_misses")
    ooms = DeprecatedName("num_ooms")

    def hit_rate(self) -> float:
        """Share of the block's allocations served from the cache (0.0 when none)."""
        return self.pool_hits / self.num_allocs if self.num_allocs else 0.0

    def as_dict(self) -> StatsDict:
        d = MeasuredStatsDict(asdict(self))
        d["hit_rate"] = self.hit_rate()
        return d

    def __str__(self) -> str:
        fb = format_bytes
        return (f"{self.device}: {self.num_allocs} allocations ({self.pool_hits} hits, "
                f"{self.pool_misses} misses), {self.num_frees} frees, segments "
                f"+{self.segments_created}/-{self.segments_released}, in use "
                f"{self.in_use_bytes_change:+,d} B, reserved {self.reserved_bytes_change:+,d} B, "
                f"peak in use {fb(self.peak_in_use_bytes)}, peak reserved "
                f"{fb(self.peak_reserved_bytes)}, CPU fallbacks {self.cpu_fallbacks}, OOMs "
                f"{self.num_ooms}, {self.seconds * 1e3:.3f} ms")


class MeasuredStatsDict(StatsDict):
    what = "MeasuredStats.as_dict()"
    renamed = deprecated_names(MeasuredStats)


class _Window:
    __slots__ = ("peak_in_use", "peak_reserved")

    def __init__(self, in_use: int, reserved: int) -> None:
        self.peak_in_use = in_use
        self.peak_reserved = reserved

    def fold(self, in_use: int, reserved: int) -> None:
        self.peak_in_use = max(self.peak_in_use, in_use)
        self.peak_reserved = max(self.peak_reserved, reserved)


class PeakWindows:
    """A manager's peak bookkeeping: the pool's C peak counters hold the peaks since the latest
    reset; ``floor`` holds what earlier resets (entering a ``measure()`` block) folded away."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._floor = _Window(0, 0)
        self._open: list[_Window] = []

    def _pool_peaks(self) -> tuple[int, int]:
        c = self._pool.counters()
        return c["peak_in_use_bytes"], c["peak_reserved_bytes"]

    def _fold_and_reset(self) -> None:
        peaks = self._pool_peaks()
        self._floor.fold(*peaks)
        for w in self._open:
            w.fold(*peaks)
        self._pool.reset_peaks()

    def open(self) -> _Window:
        with self._lock:
            self._fold_and_reset()
            window = _Window(*self._pool_peaks())     # what is held right now
            self._open.append(window)
            return window

    def close(self, window: _Window) -> tuple[int, int]:
        with self._lock:
            window.fold(*self._pool_peaks())
            self._open.remove(window)
            return window.peak_in_use, window.peak_reserved

    def peaks(self, in_use: int, reserved: int) -> tuple[int, int]:
        """The manager's peaks given the pool's current ones: the floor counts too."""
        with self._lock:
            return max(in_use, self._floor.peak_in_use), max(reserved, self._floor.peak_reserved)

    def reset(self) -> None:
        """``reset_peak_stats()``: the manager's peaks restart, open blocks keep theirs."""
        with self._lock:
            for w in self._open:
                w.fold(*self._pool_peaks())
            self._floor = _Window(0, 0)
            self._pool.reset_peaks()


class Measurement:
    """The context manager :meth:`MemoryManager.measure` returns; ``stats`` is None until the
    block exits. One Measurement measures one block (entering it twice is an error).
    ``peaks``: the manager's PeakWindows; ``miss``: its miss path (fallback and OOM counts)."""

    def __init__(self, manager: MeasuredManager, peaks: PeakWindows, miss: MissPath) -> None:
        self._manager = manager
        self._windows = peaks
        self._miss = miss
        self.stats: MeasuredStats | None = None
        self._window: _Window | None = None
        self._before: tuple[dict, int, int, float] | None = None

    def __enter__(self) -> "Measurement":
        if self._before is not None:
            raise InvalidInputError("this Measurement was entered already; call "
                                    "manager.measure() again for another block")
        mgr = self._manager
        if mgr.closed:
            raise ClosedManagerError(f"the manager for {mgr.device_string} is closed")
        self._window = self._windows.open()
        self._before = (mgr.pool.counters(), self._miss.cpu_fallbacks, self._miss.num_ooms,
                        time.perf_counter())
        return self

    def __exit__(self, *exc: Any) -> bool:
        assert self._before is not None and self._window is not None
        end = time.perf_counter()
        mgr = self._manager
        before, fallbacks, ooms, start = self._before
        after = mgr.pool.counters()
        peak_in_use, peak_reserved = self._windows.close(self._window)
        d = {k: after[k] - before[k] for k in ("num_allocs", "num_frees", "pool_hits",
                                               "pool_misses", "segments_created",
                                               "segments_released", "in_use_bytes",
                                               "reserved_bytes")}
        self.stats = MeasuredStats(
            device=mgr.device_string, num_allocs=d["num_allocs"], num_frees=d["num_frees"],
            pool_hits=d["pool_hits"], pool_misses=d["pool_misses"],
            segments_created=d["segments_created"], segments_released=d["segments_released"],
            cpu_fallbacks=self._miss.cpu_fallbacks - fallbacks,
            num_ooms=self._miss.num_ooms - ooms,
            in_use_bytes_change=d["in_use_bytes"], reserved_bytes_change=d["reserved_bytes"],
            peak_in_use_bytes=peak_in_use, peak_reserved_bytes=peak_reserved,
            seconds=end - start)
        return False
