"""Which limits bound a manager, which of them refuse requests, and the words that say so.

A manager's *soft* limits (``usable_memory = min(total * gpu_memory_fraction, total -
reserve)`` and ``min_free_bytes`` left free on the device, at their defaults) bound what its
pool keeps cached and set the pressure scale; they never refuse a request the device can serve.
A limit the user set (:attr:`gpumem.MemoryConfig.user_limits`, or ``mm.usable_memory``
assigned) is *hard*: the manager never holds more than :func:`hold_limit` and never takes a
segment that leaves less than :func:`hard_min_free` free. When one of those refuses a request,
the error names the setting, its value and how to change it; when the device itself is full
(other processes, or this one's own buffers) the error says the device refused it.

Pure functions of numbers the caller reads: no lock, no driver call.
"""
from __future__ import annotations

import math
from typing import Any

from gpumem.units import MiB, format_bytes

__all__ = ["device_reserve", "hold_limit", "hard_min_free", "usable_limit",
           "allocatable_bytes", "refusal_causes", "who_refused", "SOFT_NOTE"]

#: how an error says that the defaults did not refuse it
SOFT_NOTE = ("gpu_memory_fraction and min_free_bytes left at their defaults are soft limits "
             "and refuse nothing")


def device_reserve(config: Any, device: Any, total: int) -> int:
    """The reserve a manager with ``config`` keeps back on ``device``: ``reserve_bytes``, or
    the backend's advice when that is None."""
    if config.reserve_bytes is not None:
        return int(config.reserve_bytes)
    return int(device.recommended_reserve(total))


def hold_limit(config: Any, total: int) -> int | None:
    """The most bytes a manager may hold by the user's hard limits (``gpu_memory_fraction``,
    ``reserve_bytes`` set by the user); None when neither is (the device is the limit)."""
    caps = []
    if config.is_hard("gpu_memory_fraction"):
        caps.append(int(total * config.gpu_memory_fraction))
    if config.is_hard("reserve_bytes"):
        caps.append(total - int(config.reserve_bytes))
    return max(0, min(caps)) if caps else None


def hard_min_free(config: Any) -> int:
    """The bytes a segment must leave free on the device: ``min_free_bytes`` when the user
    set it, else 0 (the default is soft: it trims the cache, it refuses nothing)."""
    return int(config.min_free_bytes) if config.is_hard("min_free_bytes") else 0


def usable_limit(config: Any, total: int, reserve: int, usable: int) -> str:
    """Which hard setting makes the cap ``usable`` what it is, with its value:
    ``gpu_memory_fraction=0.5`` or ``reserve_bytes=1.00 GiB``; ``usable_memory=...`` when it
    was assigned on the manager."""
    by_fraction = int(total * config.gpu_memory_fraction)
    if config.is_hard("gpu_memory_fraction") and usable == by_fraction:
        return f"gpu_memory_fraction={config.gpu_memory_fraction}"
    if config.is_hard("reserve_bytes") and usable == max(0, total - reserve):
        return f"reserve_bytes={format_bytes(reserve)}"
    return f"usable_memory={format_bytes(usable)} (set on the manager)"


def allocatable_bytes(hold: int, reserved: int, free: int | None, min_free: int) -> int:
    """What the manager can hold in all (what it holds now included): ``hold`` (its hard cap,
    else the device's total) capped by what the driver has free beyond ``min_free`` (the hard
    margin, 0 when soft)."""
    if free is None:
        return hold
    return max(0, min(hold, reserved + max(0, free - min_free)))


def _round_down_mib(n: int) -> str:
    return format_bytes(max(0, n) // MiB * MiB)


def refusal_causes(nbytes: int, *, config: Any, total: int, reserve: int,
                   hold: int | None, reserved: int, free: int | None) -> list[str]:
    """For a request of ``nbytes`` that the ladder could not serve: each hard limit that
    refused it, as "SETTING=VALUE (your hard limit) refused it: WHY; CHANGE". ``hold``: the
    manager's hard cap (None: none). Empty when no limit did (the device is full, or the cache
    is fragmented): soft limits never refuse."""
    causes: list[str] = []
    if nbytes > total:
        return causes                             # no setting would make it fit
    if hold is not None and reserved + nbytes > hold:
        setting = usable_limit(config, total, reserve, hold)
        held = f"{format_bytes(reserved)} held + " if reserved else ""
        why = (f"{held}{format_bytes(nbytes)} requested exceeds usable memory "
               f"{format_bytes(hold)}")
        if setting.startswith("gpu_memory_fraction"):
            need = math.ceil((reserved + nbytes) / total * 100) / 100
            if int(total * need) < reserved + nbytes:      # the manager truncates: one more
                need = round(need + 0.01, 2)
            change = (f"raise it to {need} or more: MemoryConfig(gpu_memory_fraction={need}), "
                      f"configure(..., gpu_memory_fraction={need}) or "
                      f"GPUMEM_GPU_MEMORY_FRACTION={need}, or leave it unset (soft: the "
                      f"whole device)")
            if need > 1.0 or (config.is_hard("reserve_bytes")
                              and reserved + nbytes > total - reserve):
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
        causes.append(f"{setting} (your hard limit) refused it: {why}; {change}")
    min_free = hard_min_free(config)
    if free is not None and min_free and free >= nbytes and free - nbytes < min_free:
        room = (free - nbytes) // MiB * MiB
        text = f"{room // MiB}MiB"
        causes.append(
            f"min_free_bytes={format_bytes(min_free)} (your hard limit) refused it: the device "
            f"has {format_bytes(free)} free and must keep {format_bytes(min_free)} free after "
            f"the request; lower it to {format_bytes(room)} or less: MemoryConfig("
            f"min_free_bytes=\"{text}\"), configure(..., min_free_bytes=\"{text}\") or "
            f"GPUMEM_MIN_FREE_BYTES={text}, or leave it unset (soft)")
    return causes


def who_refused(nbytes: int, causes: list[str], free: int | None) -> str:
    """Who refused a request, in a few words for a warning: the user's hard limit (named), or
    the device (with what it had free)."""
    if causes:
        return causes[0].split(" refused it", 1)[0] + " refused it"
    if free is None:
        return "the device refused it"
    return (f"the device refused it ({format_bytes(free)} free"
            f"{', fragmented' if free >= nbytes else ''})")
