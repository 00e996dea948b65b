"""Memory pressure levels, the observers told when the level changes, and the responses.

:class:`PressureWatch` is a manager's part: after the bytes held from the device change
(segment growth says so) it works out the level from ``MemoryConfig.pressure_thresholds``, calls
the observers on a change, and on a rise trims the cache (HIGH) or releases every wholly free
segment (CRITICAL) as the config asks.

Thread safety: ``update`` runs under the manager's slow-path lock (segment growth holds it);
the callback list is appended to under the GIL and copied before it is walked.
"""
from __future__ import annotations

import enum
import logging
import warnings
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from gpumem._core.pool import CachingPool
    from gpumem.config import MemoryConfig

__all__ = ["MemoryPressure", "pressure_level", "PressureCallback", "PressureWatch",
           "CacheRelease"]


class CacheRelease(Protocol):
    """What the pressure responses call (SegmentGrowth implements it)."""

    def release_cached(self, max_bytes: int | None = None, *, reason: str = "",
                       small: bool | None = None) -> int: ...

log = logging.getLogger("gpumem")


class MemoryPressure(enum.IntEnum):
    """How full a manager's usable memory is (thresholds from MemoryConfig)."""

    LOW = 0         # below 60 % of usable memory by default
    MEDIUM = 1      # 60-80 %
    HIGH = 2        # 80-95 %: the cache is trimmed
    CRITICAL = 3    # above 95 %: every wholly free segment is released


PressureCallback = Callable[["MemoryPressure", "MemoryPressure", float], None]


def pressure_level(ratio: float, thresholds: tuple[float, float, float]) -> MemoryPressure:
    """The level for a usage ratio (0..1) given the MEDIUM, HIGH and CRITICAL thresholds."""
    medium, high, critical = thresholds
    if ratio > critical or ratio >= 1.0:      # full is critical whatever the threshold
        return MemoryPressure.CRITICAL
    if ratio >= high:
        return MemoryPressure.HIGH
    if ratio >= medium:
        return MemoryPressure.MEDIUM
    return MemoryPressure.LOW


class PressureWatch:
    """The pressure level of one manager (see the module docstring)."""

    def __init__(self, pool: CachingPool, config: MemoryConfig, usable_memory: int,
                 device_string: str) -> None:
        self._pool = pool
        self.config = config
        self.usable_memory = usable_memory
        self._device_string = device_string
        self.level = MemoryPressure.LOW            # as of the latest update()
        self.callbacks: list[PressureCallback] = []

    def ratio(self) -> float:
        """Bytes held from the device over usable memory, in [0, 1]."""
        if self.usable_memory == 0:
            return 1.0
        return min(1.0, self._pool.reserved_bytes / self.usable_memory)

    def current(self) -> MemoryPressure:
        """The level of :meth:`ratio` now."""
        return pressure_level(self.ratio(), self.config.pressure_thresholds)

    def update(self, growth: CacheRelease) -> None:
        """After the held bytes changed: tell the observers of a new level; on a rise, respond
        through ``growth`` as the config asks."""
        level = self.current()
        if level == self.level:
            return
        old, self.level = self.level, level
        ratio = self.ratio()
        log.debug("%s pressure %s -> %s (%.1f%%)", self._device_string, old.name, level.name,
                  100 * ratio)
        for callback in list(self.callbacks):
            try:
                callback(old, level, ratio)
            except Exception as exc:  # an observer must not fail the allocation it observes
                warnings.warn(f"gpumem: pressure observer {callback!r} raised {exc!r}",
                              RuntimeWarning)
        if level > old:
            self._respond(level, growth)

    def _respond(self, level: MemoryPressure, growth: CacheRelease) -> None:
        cfg = self.config
        if level >= MemoryPressure.CRITICAL and cfg.auto_cleanup_at_critical:
            growth.release_cached(reason="emergency cleanup")
        elif level >= MemoryPressure.HIGH and cfg.auto_release_at_high:
            keep = int(cfg.high_cache_fraction * self.usable_memory)
            cached = self._pool.reserved_bytes - self._pool.in_use_bytes
            if cached > keep:
                growth.release_cached(cached - keep, reason="HIGH pressure")
