"""Which setting limits a manager: the words of an OutOfMemoryError and of memory_summary.

A manager holds at most ``usable_memory = min(total * gpu_memory_fraction, total - reserve)``
and never takes a segment that would leave less than ``min_free_bytes`` free on the device.
When one of these refuses a request, the error names the setting, its value and how to change
it; when the device itself is full (other processes, or this one's own buffers) no setting is
blamed. Pure functions of numbers the caller reads: no lock, no driver call.
"""
from __future__ import annotations

import math
from typing import Any

from gpumem.units import MiB, format_bytes

__all__ = ["device_reserve", "usable_limit", "allocatable_bytes", "refusal_causes"]


def device_reserve(config: Any, device: Any, total: int) -> int:
    """The reserve a manager with ``config`` keeps back on ``device``: ``reserve_bytes``, or
    the backend's advice when that is None."""
    if config.reserve_bytes is not None:
        return int(config.reserve_bytes)
    return int(device.recommended_reserve(total))


def usable_limit(config: Any, total: int, reserve: int, usable: int) -> str:
    """Which setting makes ``usable`` what it is, with its value: ``gpu_memory_fraction=0.9``
    or ``reserve_bytes=1.00 GiB`` (``(backend's advice)`` when the config left it None)."""
    by_fraction = int(total * config.gpu_memory_fraction)
    if usable not in (by_fraction, max(0, total - reserve)):
        return f"usable_memory={format_bytes(usable)} (set on the manager)"
    if by_fraction <= total - reserve:
        return f"gpu_memory_fraction={config.gpu_memory_fraction}"
    advice = " (the backend's advice)" if config.reserve_bytes is None else ""
    return f"reserve_bytes={format_bytes(reserve)}{advice}"


def allocatable_bytes(usable: int, reserved: int, free: int | None, min_free: int) -> int:
    """What the manager can hold in all (what it holds now included): ``usable`` capped by
    what the driver has free beyond ``min_free_bytes``."""
    if free is None:
        return usable
    return max(0, min(usable, reserved + max(0, free - min_free)))


def _round_down_mib(n: int) -> str:
    return format_bytes(max(0, n) // MiB * MiB)


def refusal_causes(nbytes: int, *, config: Any, total: int, reserve: int, usable: int,
                   reserved: int, free: int | None) -> list[str]:
    """For a request of ``nbytes`` that the ladder could not serve: each setting that refused
    it, as "SETTING=VALUE refused it: WHY; CHANGE". Empty when no setting did (the device is
    full, or the cache is fragmented)."""
    causes = []
    if nbytes > total:
        return causes                             # no setting would make it fit
    if reserved + nbytes > usable:
        setting = usable_limit(config, total, reserve, usable)
        held = f"{format_bytes(reserved)} held + " if reserved else ""
        why = (f"{held}{format_bytes(nbytes)} requested exceeds usable memory "
               f"{format_bytes(usable)}")
        if setting.startswith("gpu_memory_fraction"):
            need = math.ceil((reserved + nbytes) / total * 100) / 100
            if int(total * need) < reserved + nbytes:      # the manager truncates: one more
                need = round(need + 0.01, 2)
            change = (f"raise it to {need} or more: MemoryConfig(gpu_memory_fraction={need}), "
                      f"configure(..., gpu_memory_fraction={need}) or "
                      f"GPUMEM_GPU_MEMORY_FRACTION={need}")
            if need > 1.0 or reserved + nbytes > total - reserve:
                change = ("no fraction makes room (the reserve or the device is the limit): "
                          "free buffers or use a larger device")
        elif setting.startswith("reserve_bytes"):
            room = total - reserved - nbytes
            text = f"{room // MiB}MiB"
            change = (f"lower it to {_round_down_mib(room)} or less: MemoryConfig(reserve_bytes="
                      f"\"{text}\") or GPUMEM_RESERVE_BYTES={text}" if room >= MiB
                      else "no reserve makes room: free buffers or use a larger device")
        else:
            change = "raise mm.usable_memory or build the manager again"
        causes.append(f"{setting} refused it: {why}; {change}")
    min_free = config.min_free_bytes
    if free is not None and min_free and free >= nbytes and free - nbytes < min_free:
        room = (free - nbytes) // MiB * MiB
        text = f"{room // MiB}MiB"
        causes.append(
            f"min_free_bytes={format_bytes(min_free)} refused it: the device has "
            f"{format_bytes(free)} free and must keep {format_bytes(min_free)} free after the "
            f"request; lower it to {format_bytes(room)} or less: MemoryConfig(min_free_bytes="
            f"\"{text}\"), configure(..., min_free_bytes=\"{text}\") or "
            f"GPUMEM_MIN_FREE_BYTES={text}")
    return causes
