"""Which MemoryConfig fields a live manager can change, and why the others cannot.

:meth:`MemoryManager.reconfigure` (and assigning ``mm.config``) checks a new config here before
anything changes: a field the C pool or the segment layout was built with is fixed for the
manager's life, and changing it is refused with an error naming the field and the reason. Every
other field is read by the manager's parts at the moment they act, so pushing the new config to
them is enough (``LIVE_FIELDS`` says which part acts on each).
"""
from __future__ import annotations

import dataclasses

from gpumem.config import MemoryConfig
from gpumem.errors import InvalidInputError

__all__ = ["FIXED_FIELDS", "LIVE_FIELDS", "check_live_change", "usable_bytes"]

_POOL = "the C pool was built with it"
_LAYOUT = "the segments already made were laid out with it"

#: field -> why it cannot change on a live manager (the pool and segment geometry)
FIXED_FIELDS: dict[str, str] = {
    "granularity": f"{_POOL} (block alignment)",
    "small_size": f"{_POOL} (the small/large pool boundary)",
    "small_segment": f"{_POOL} (the small pool's segment size)",
    "large_segment": f"{_POOL} (the large pool's segment size)",
    "large_threshold": f"{_POOL} (requests served from large_segment segments)",
    "large_round": f"{_POOL} (the rounding of big requests)",
    "max_split_size": f"{_POOL} (which cached blocks may be split)",
    "large_split_min": f"{_POOL} (the smallest remainder split off)",
    "oversize_slack": f"{_POOL} (how much larger a cached block may be)",
    "expandable_segments": f"{_LAYOUT} (expandable or plain segments)",
    "expandable_handle_size": f"{_LAYOUT} (the physical handles of expandable segments)",
    "segments": f"{_LAYOUT} (the segment policy)",
    "shared_group": "the manager joined its shared group with it (a new manager joins another)",
    "shared_budget": "the group's ledger holds it, and every member must agree on it",
    "shared_hand_back": "the manager's group membership was made with it",
}

#: field -> what acts on it once changed (read when that part acts)
LIVE_FIELDS: dict[str, str] = {
    "gpu_memory_fraction": "usable memory: the limit is recomputed, the cache trimmed to it",
    "reserve_bytes": "usable memory: the limit is recomputed, the cache trimmed to it",
    "cpu_fallback_enabled": "the miss path, on the next request the device cannot serve",
    "min_free_bytes": "segment growth, on the next new segment",
    "track_allocations": "the tracker: made or dropped at once",
    "track_stacks": "the tracker: made again at once (stacks of live buffers are not known)",
    "max_pooled_per_bucket": "the cache cap, trimmed at once",
    "max_pool_size": "the cache cap, trimmed at once",
    "release_before_grow": "segment growth, on the next growth",
    "pressure_thresholds": "the pressure watch, at once",
    "auto_release_at_high": "the pressure watch, on the next level rise",
    "high_cache_fraction": "the pressure watch, on the next level rise",
    "auto_cleanup_at_critical": "the pressure watch, on the next level rise",
}


def check_live_change(old: MemoryConfig, new: MemoryConfig) -> None:
    """InvalidInputError naming every field that differs between `old` and `new` and cannot
    change on a live manager (a field in neither table is refused too: nothing is known to act
    on it)."""
    if not isinstance(new, MemoryConfig):
        raise InvalidInputError(f"a manager's config must be a MemoryConfig, got "
                                f"{type(new).__name__}")
    refused = []
    for f in dataclasses.fields(new):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after or f.name in LIVE_FIELDS:
            continue
        why = FIXED_FIELDS.get(f.name, "no part of the manager is known to act on a change")
        refused.append(f"{f.name} ({before!r} -> {after!r}): {why}")
    if refused:
        raise InvalidInputError(
            "these MemoryConfig fields cannot change on a live manager: " + "; ".join(refused)
            + ". Create a new MemoryManager with them (gpumem.configure(device, ...) for a "
            "shared one); nothing was changed")


def usable_bytes(config: MemoryConfig, total: int, recommended_reserve: int) -> int:
    """``min(total * gpu_memory_fraction, total - reserve)``, at least 0; the reserve is
    ``config.reserve_bytes``, or the backend's advice when None."""
    reserve = config.reserve_bytes if config.reserve_bytes is not None else recommended_reserve
    return max(0, min(int(total * config.gpu_memory_fraction), total - reserve))
