"""Memory pressure levels and the observers told when the level changes."""
from __future__ import annotations

import enum
import logging
from typing import Callable

__all__ = ["MemoryPressure", "pressure_level", "PressureCallback"]

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
