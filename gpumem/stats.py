"""MemoryStats, a snapshot of a manager's counters, and the statistics vocabulary every layer
speaks (docs/statistics.md).

One name per figure, the same in :class:`MemoryStats`, ``MeasuredStats``, ``ReplayResult``,
``pool.counters()``, ``memory_summary`` / ``summary_data``, the CLI's JSON, the Dask metrics and
the torch allocator's counters: ``reserved_bytes``, ``in_use_bytes``, ``cached_bytes``,
``peak_reserved_bytes``, ``peak_in_use_bytes``, ``num_allocs``, ``num_frees``, ``pool_hits``,
``pool_misses`` (and ``num_ooms``, ``num_segments``).

Names used before keep reading for one release, with a ``DeprecationWarning`` naming the new
one: on attributes through :class:`DeprecatedName`, on dicts through :class:`StatsDict`. Each
producer declares its own old names next to its fields; nothing translates between layers.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from gpumem.units import format_bytes

__all__ = ["MemoryStats", "DeprecatedName", "StatsDict", "deprecated_names", "VOCABULARY"]

#: The names every statistics output uses for these figures (docs/statistics.md).
VOCABULARY = ("reserved_bytes", "in_use_bytes", "cached_bytes", "peak_reserved_bytes",
              "peak_in_use_bytes", "num_allocs", "num_frees", "pool_hits", "pool_misses")


def _warn_renamed(where: str, old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{where}: {old!r} is a deprecated name (kept for one release); use {new!r}",
                  DeprecationWarning, stacklevel=stacklevel + 1)


class DeprecatedName:
    """A class attribute ``old = DeprecatedName("new")``: reading (or, on a mutable class,
    setting) ``obj.old`` warns and goes to ``obj.new``. It is no dataclass field, so
    ``asdict``, ``repr`` and the constructor know only the new name."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""
        self.owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner = name, owner.__name__

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        _warn_renamed(self.owner, self.old, self.new, 2)
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        # (a frozen dataclass's __setattr__ refuses every name before this runs)
        _warn_renamed(self.owner, self.old, self.new, 2)
        setattr(obj, self.new, value)


def deprecated_names(cls: type) -> dict[str, str]:
    """``{old: new}`` for every :class:`DeprecatedName` of ``cls`` (and its bases)."""
    return {name: attr.new for klass in reversed(cls.__mro__)
            for name, attr in vars(klass).items() if isinstance(attr, DeprecatedName)}


class StatsDict(dict):
    """A dict of statistics whose old key names still read, with a DeprecationWarning naming
    the new key (``d["hits"]`` is ``d["pool_hits"]``; ``.get`` too). Only the new names are
    keys: iteration, ``in``, ``len`` and JSON see those alone. A subclass per output sets
    ``what`` (how the warning names the output) and ``renamed`` (``{old: new}``)."""

    what: ClassVar[str] = "statistics"
    renamed: ClassVar[Mapping[str, str]] = {}

    def __missing__(self, key: Any) -> Any:
        new = self.renamed.get(key) if isinstance(key, str) else None
        if new is None or not dict.__contains__(self, new):
            raise KeyError(key)
        _warn_renamed(self.what, key, new, 2)
        return dict.__getitem__(self, new)

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        new = self.renamed.get(key) if isinstance(key, str) else None
        if new is None or not dict.__contains__(self, new):
            return default
        _warn_renamed(self.what, key, new, 2)
        return dict.__getitem__(self, new)

    def copy(self) -> StatsDict:
        return type(self)(self)


@dataclass(frozen=True)
class MemoryStats:
    """Counters of one manager at one moment.

    Invariant (tested): ``reserved_bytes == in_use_bytes + cached_bytes + held_bytes``, where
    ``in_use_bytes`` counts live blocks at their *rounded* size; the rounding itself is
    ``in_use_bytes - requested_bytes``. ``held_bytes`` are pages of expandable segments not given
    back yet (the driver refused, or an error came while releasing them; retried by the next
    trim or close()) and, while a miss runs, the pages it moves between segments: the device
    holds them, nothing can use them.
    CPU-fallback buffers are not device memory and are counted apart (``fallback_bytes``).
    """

    device: str
    reserved_bytes: int             # held from the device: segments and held_bytes
    in_use_bytes: int               # live blocks, rounded sizes
    requested_bytes: int            # live blocks, as requested
    cached_bytes: int               # free bytes in segments, ready for reuse
    peak_in_use_bytes: int          # since creation / reset_peak_stats()
    peak_reserved_bytes: int
    largest_free_block: int
    pool_hits: int                  # device allocations served from the cache
    pool_misses: int                # ... that needed a new segment or expandable growth
    cpu_fallbacks: int
    fallback_bytes: int
    active_buffers: int
    num_allocs: int
    num_frees: int
    num_segments: int
    segments_created: int
    segments_released: int
    num_ooms: int
    # freed blocks waiting for other streams (Buffer.record_stream): counted in in_use_bytes,
    # not in active_buffers
    pending_free_bytes: int = 0
    # pages of expandable segments the driver refused to free, held for a retry: counted in
    # reserved_bytes (the device holds them), neither in use nor cached
    held_bytes: int = 0
    # live CPU-fallback buffers: counted in active_buffers, not in in_use_bytes
    fallback_buffers: int = 0
    # sleep and wake (MemoryManager.sleep): device bytes a sleep gave back and not yet woken
    # (in no other figure: the device does not hold them), and host bytes of their backups
    asleep_bytes: int = 0
    backup_bytes: int = 0

    total_allocated_bytes = DeprecatedName("reserved_bytes")
    pooled_bytes = DeprecatedName("cached_bytes")
    peak_bytes = DeprecatedName("peak_in_use_bytes")

    def hit_rate(self) -> float:
        """Share of device allocations served from the cache (0.0 when none yet)."""
        total = self.pool_hits + self.pool_misses
        return self.pool_hits / total if total else 0.0

    def fragmentation_ratio(self) -> float:
        """1 - largest free block / cached bytes: 0 when the cache is one piece (or empty),
        near 1 when it is shredded into pieces too small for big requests."""
        if self.cached_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free_block / self.cached_bytes

    @property
    def rounding_bytes(self) -> int:
        return self.in_use_bytes - self.requested_bytes

    def as_dict(self) -> StatsDict:
        d = MemoryStatsDict(asdict(self))
        d["hit_rate"] = self.hit_rate()
        d["fragmentation_ratio"] = self.fragmentation_ratio()
        return d

    def __str__(self) -> str:
        fb = format_bytes
        # each figure counts one thing: device buffers beside the device bytes they use,
        # live fallback buffers beside the host bytes they hold
        device_buffers = self.active_buffers - self.fallback_buffers
        live_fallback = (f" ({self.fallback_buffers} live, {fb(self.fallback_bytes)})"
                         if self.fallback_buffers else "")
        return (f"{self.device}: reserved {fb(self.reserved_bytes)} in "
                f"{self.num_segments} segment(s), in use {fb(self.in_use_bytes)} "
                f"({device_buffers} device buffer(s)), cached {fb(self.cached_bytes)}, "
                f"peak in use {fb(self.peak_in_use_bytes)}, peak reserved "
                f"{fb(self.peak_reserved_bytes)}; hits {self.pool_hits}, misses "
                f"{self.pool_misses} ({self.hit_rate():.1%}), fragmentation "
                f"{self.fragmentation_ratio():.1%}, CPU fallbacks {self.cpu_fallbacks}"
                f"{live_fallback}, OOMs {self.num_ooms}"
                + (f", held after a refused free {fb(self.held_bytes)}" if self.held_bytes
                   else "")
                + (f", asleep {fb(self.asleep_bytes)} (backups {fb(self.backup_bytes)})"
                   if self.asleep_bytes or self.backup_bytes else ""))


class MemoryStatsDict(StatsDict):
    what = "MemoryStats.as_dict()"
    renamed = deprecated_names(MemoryStats)
