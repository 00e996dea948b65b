"""``MemoryManager.memory_summary()``: one table a person reads at a glance.

Like ``torch.cuda.memory_summary``: what is held and used now and at the peak, where the bytes
sit (segments by pool and size class), how the cache is doing (hits, misses, largest free
block, pressure, CPU fallback) and, with tracking on, which tags hold the most::

    print(mm.memory_summary())

:func:`summary_data` gives the same figures as a JSON-ready dict (``gpumem summary --json``),
keyed by gpumem.stats' vocabulary (docs/statistics.md); the keys used before (``allocations``,
``hits``, ``ooms``...) still read from the dict, with a DeprecationWarning, but JSON has only
the new ones.
Everything is read from the manager's counters and one segment listing: no driver allocation,
only ``mem_get_info`` for the device's own free figure.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem.errors import ClosedManagerError, DriverError, InvalidInputError
from gpumem.manager.limits import allocatable_bytes, hard_min_free
from gpumem.stats import StatsDict
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem.manager.interfaces import SummarySource

__all__ = ["memory_summary", "summary_data", "format_summary", "SummaryData"]


class SummaryData(StatsDict):
    """What :func:`summary_data` returns: a dict whose old keys still read, with a warning."""
    what = "summary_data()"
    renamed = {"allocations": "num_allocs", "frees": "num_frees", "hits": "pool_hits",
               "misses": "pool_misses", "ooms": "num_ooms", "segments": "num_segments",
               "fragmentation": "fragmentation_ratio"}


class SegmentClassRow(StatsDict):
    """One row of ``summary_data()["segments_by_class"]``."""
    what = "summary_data()['segments_by_class'][i]"
    renamed = {"segments": "num_segments", "free_bytes": "cached_bytes"}


def _size_class(size: int) -> tuple[int, str]:
    """Segments grouped by power-of-two ranges: ``(upper bound, "(2 MiB, 4 MiB]")``; a
    power of two is the top of its own range."""
    upper = 1 << max(0, (size - 1).bit_length())
    lower = upper >> 1
    short = lambda n: format_bytes(n).replace(".00 ", " ")  # noqa: E731
    return upper, f"({short(lower)}, {short(upper)}]" if lower else f"<= {short(upper)}"


def _segments_by_class(segments: list[dict]) -> list[dict]:
    rows: dict[tuple[str, int], dict] = {}
    for seg in segments:
        upper, label = _size_class(seg["size"])
        key = (seg["pool"], upper)
        row = rows.setdefault(key, SegmentClassRow(
            pool=seg["pool"], size_class=label, num_segments=0, reserved_bytes=0,
            in_use_bytes=0, cached_bytes=0))
        row["num_segments"] += 1
        row["reserved_bytes"] += seg["size"]
        for b in seg["blocks"]:
            if b["state"] == "unmapped":         # a hole in an expandable segment: no memory
                row["reserved_bytes"] -= b["size"]
            elif b["state"] == "free":
                row["cached_bytes"] += b["size"]
            else:                                 # allocated, or freed but waiting for streams
                row["in_use_bytes"] += b["size"]
    return [rows[k] for k in sorted(rows)]


def summary_data(manager: SummarySource, *, top_tags: int = 5) -> SummaryData:
    """The figures of :func:`memory_summary` as a plain dict."""
    if isinstance(top_tags, bool) or not isinstance(top_tags, int) or top_tags < 0:
        raise InvalidInputError(f"top_tags must be an int >= 0, got {top_tags!r}")
    if manager.closed:
        raise ClosedManagerError(f"the manager for {manager.device_string} is closed")
    st = manager.stats()
    try:
        free, total = manager.memory_info()
    except DriverError:
        free, total = None, manager.total_memory
    tags = None
    if manager.tracker is not None:
        by_tag = manager.tracker.by_tag()
        ranked = sorted(by_tag.items(), key=lambda kv: (-kv[1][1], str(kv[0])))[:top_tags]
        tags = [{"tag": "(untagged)" if t is None else str(t), "buffers": n, "bytes": b}
                for t, (n, b) in ranked]
    return SummaryData({
        "device": st.device, "device_name": manager.device.properties().name,
        "device_free_bytes": free, "device_total_bytes": total,
        "usable_bytes": manager.usable_memory,
        # what can be allocated: the hard cap (else the device), less a hard min_free_bytes
        "allocatable_bytes": allocatable_bytes(manager.hold_limit, st.reserved_bytes, free,
                                               hard_min_free(manager.config)),
        "min_free_bytes": manager.config.min_free_bytes,
        "limits": manager.config.limit_kinds(),
        "pressure": manager.pressure().name, "pressure_ratio": manager.pressure_ratio(),
        "reserved_bytes": st.reserved_bytes, "peak_reserved_bytes": st.peak_reserved_bytes,
        "in_use_bytes": st.in_use_bytes, "peak_in_use_bytes": st.peak_in_use_bytes,
        "requested_bytes": st.requested_bytes, "cached_bytes": st.cached_bytes,
        "pending_free_bytes": st.pending_free_bytes, "held_bytes": st.held_bytes,
        "asleep_bytes": st.asleep_bytes, "backup_bytes": st.backup_bytes,
        "largest_free_block": st.largest_free_block,
        "fragmentation_ratio": st.fragmentation_ratio(), "active_buffers": st.active_buffers,
        "num_allocs": st.num_allocs, "num_frees": st.num_frees, "pool_hits": st.pool_hits,
        "pool_misses": st.pool_misses, "hit_rate": st.hit_rate(), "num_ooms": st.num_ooms,
        "cpu_fallbacks": st.cpu_fallbacks, "fallback_bytes": st.fallback_bytes,
        "num_segments": st.num_segments, "segments_created": st.segments_created,
        "segments_released": st.segments_released,
        "segments_by_class": _segments_by_class(manager.pool.segments()),
        "top_tags": tags,
    })


def format_summary(d: dict[str, Any]) -> str:
    """The table for a :func:`summary_data` dict."""
    fb = format_bytes
    width = 72
    rule = "-" * width
    free = "?" if d["device_free_bytes"] is None else fb(d["device_free_bytes"])
    lines = [
        rule,
        f"gpumem memory summary: {d['device']} ({d['device_name']})",
        f"device: {free} free of {fb(d['device_total_bytes'])} (driver), pressure "
        f"{d['pressure']} ({d['pressure_ratio']:.1%})",
        f"usable {fb(d['allocatable_bytes'])} (usable_memory {fb(d['usable_bytes'])}, "
        f"{d['limits']['gpu_memory_fraction']}; min_free_bytes {fb(d['min_free_bytes'])}, "
        f"{d['limits']['min_free_bytes']}: soft limits trim the cache, hard ones refuse)",
        rule,
        f"{'':<26}{'now':>16}{'peak':>16}",
        f"{'reserved (held)':<26}{fb(d['reserved_bytes']):>16}{fb(d['peak_reserved_bytes']):>16}",
        f"{'in use (rounded)':<26}{fb(d['in_use_bytes']):>16}{fb(d['peak_in_use_bytes']):>16}",
        f"{'requested':<26}{fb(d['requested_bytes']):>16}",
        f"{'cached (free)':<26}{fb(d['cached_bytes']):>16}",
        f"{'largest free block':<26}{fb(d['largest_free_block']):>16}"
        f"   fragmentation {d['fragmentation_ratio']:.1%}",
    ]
    if d["pending_free_bytes"]:
        lines.append(f"{'waiting for streams':<26}{fb(d['pending_free_bytes']):>16}")
    if d.get("held_bytes"):
        # counted in reserved: the driver refused to free these pages, retried on each trim
        lines.append(f"{'held (free refused)':<26}{fb(d['held_bytes']):>16}")
    if d.get("asleep_bytes") or d.get("backup_bytes"):
        # given back by MemoryManager.sleep: in no figure above; backups are host memory
        lines.append(f"{'asleep (sleep tags)':<26}{fb(d['asleep_bytes']):>16}   "
                     f"{fb(d['backup_bytes'])} backed up in host memory")
    lines += [
        f"{'CPU fallbacks':<26}{d['cpu_fallbacks']:>16,d}   {fb(d['fallback_bytes'])} live "
        f"in host memory",
        rule,
        f"allocations {d['num_allocs']:,}  frees {d['num_frees']:,}  live buffers "
        f"{d['active_buffers']:,}  OOMs {d['num_ooms']:,}",
        f"cache hits {d['pool_hits']:,}  misses {d['pool_misses']:,}  hit rate "
        f"{d['hit_rate']:.1%}",
        f"segments {d['num_segments']:,} (created {d['segments_created']:,}, released "
        f"{d['segments_released']:,})",
        rule,
        f"{'pool':<7}{'segment size':<22}{'segments':>9}{'reserved':>12}{'in use':>12}"
        f"{'cached':>12}",
    ]
    for r in d["segments_by_class"]:
        lines.append(f"{r['pool']:<7}{r['size_class']:<22}{r['num_segments']:>9,}"
                     f"{fb(r['reserved_bytes']):>12}{fb(r['in_use_bytes']):>12}"
                     f"{fb(r['cached_bytes']):>12}")
    if not d["segments_by_class"]:
        lines.append("(no segments)")
    if d["top_tags"] is not None:
        lines += [rule, f"{'top tags by bytes':<40}{'buffers':>10}{'bytes':>16}"]
        for t in d["top_tags"]:
            tag = t["tag"] if len(t["tag"]) <= 38 else t["tag"][:37] + "~"
            lines.append(f"  {tag:<38}{t['buffers']:>10,}{fb(t['bytes']):>16}")
        if not d["top_tags"]:
            lines.append("  (no live buffers)")
    else:
        lines += [rule, "tags: tracking is off (MemoryConfig(track_allocations=True) or "
                        "GPUMEM_DEBUG=1)"]
    lines.append(rule)
    return "\n".join(lines)


def memory_summary(manager: SummarySource, *, top_tags: int = 5) -> str:
    """The table for ``manager`` (see the module docstring)."""
    return format_summary(summary_data(manager, top_tags=top_tags))
