"""Memory snapshots: every segment of a manager and the blocks inside it, as plain JSON data.

>>> snap = mm.snapshot()                 # or gpumem.observe.snapshot.take_snapshot(mm)
>>> save_snapshot(snap, "snap.json")     # doctest: +SKIP
>>> snap2 = load_snapshot("snap.json")   # doctest: +SKIP

Layout (``version`` 1)::

    {"format": "gpumem-snapshot", "version": 1,
     "device": "sim:0", "device_name": "...", "time": 1732200000.0,
     "total_memory": ..., "usable_memory": ...,
     "stats": {...MemoryStats.as_dict()...},
     "config": {...every MemoryConfig field...},
     "segments": [{"handle", "base", "size", "pool": "small"|"large", "stream",
                   "mapped_bytes", "unmapped_bytes",
                   "blocks": [{"offset", "size", "requested",
                               "state": "allocated"|"free"|"unmapped",
                               "stream", "id", "tag", "pending_free"}]}]}

``size`` is the address span of the segment's blocks. ``mapped_bytes`` is its physical memory:
``size`` less its ``unmapped`` blocks (holes of an expandable segment, whose pages went back to
the device or moved elsewhere); ``unmapped_bytes`` the rest of its reserved address range, holes
and the space after it where it grows (0 for a plain segment, which has no unmapped block).

Blocks tile their segment in address order. ``pending_free`` marks an allocated block whose
buffer was freed but which waits for other streams (``Buffer.record_stream``). ``tag`` comes from the allocation tracker when
tracking is on (``str(tag)`` unless it is a str, number or bool), else None; ``id`` is None for free
blocks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from gpumem.backends.base import DeviceKind
from gpumem.errors import ClosedManagerError, InvalidInputError
from gpumem.stats import StatsDict
from gpumem.units import format_bytes

__all__ = ["take_snapshot", "save_snapshot", "load_snapshot", "format_snapshot", "summarize",
           "SNAPSHOT_FORMAT", "SNAPSHOT_VERSION"]

SNAPSHOT_FORMAT = "gpumem-snapshot"
SNAPSHOT_VERSION = 1

_TOP_KEYS = ("device", "time", "stats", "config", "segments")
_SEGMENT_KEYS = ("base", "size", "pool", "stream", "blocks")
_BLOCK_KEYS = ("offset", "size", "requested", "state")


def _json_value(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return [_json_value(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _json_value(v) for k, v in x.items()}
    return str(x)


def _json_tag(tag: Any) -> Any:
    """Tags stay scalars: str/int/float/bool/None as they are, anything else as str(tag)."""
    if tag is None or isinstance(tag, (bool, int, float, str)):
        return tag
    return str(tag)


def take_snapshot(manager: Any) -> dict:
    """A JSON-ready dict of the manager's segments, blocks, stats and config (see the module
    docstring). Raises ClosedManagerError for a closed manager."""
    if getattr(manager, "closed", False):
        raise ClosedManagerError(
            f"cannot snapshot: the manager for {manager.device_string} is closed")
    tracker = getattr(manager, "tracker", None)
    tags: dict[int, Any] = {}
    if tracker is not None:
        for meta in tracker.live():
            if meta.location == "device" or manager.device.kind is DeviceKind.HOST:
                tags[meta.id] = meta.tag
    pending = manager.pending_free_ids() if hasattr(manager, "pending_free_ids") else ()
    expandable = getattr(manager, "expandable_segments", None)
    layout = expandable.layout() if expandable is not None else {}
    segments = []
    for seg in manager.pool.segments():
        blocks = []
        for b in seg["blocks"]:
            allocated = b["state"] == "allocated"
            bid = b["id"] if allocated else None
            blocks.append({
                "offset": b["offset"], "size": b["size"],
                "requested": b["requested"] if allocated else 0,
                "state": b["state"], "stream": b["stream"], "id": bid,
                "tag": _json_tag(tags.get(bid)) if allocated else None,
                "pending_free": allocated and bid in pending,
            })
        mapped, reserved = layout.get(seg["handle"], (seg["size"], seg["size"]))
        segments.append({"handle": seg["handle"], "base": seg["base"], "size": seg["size"],
                         "pool": seg["pool"], "stream": seg["stream"],
                         "mapped_bytes": mapped, "unmapped_bytes": reserved - mapped,
                         "blocks": blocks})
    try:
        props = manager.device.properties()
        device_name = props.name
    except Exception:
        device_name = ""
    config = getattr(manager, "config", None)
    config_d = _json_value(dataclasses.asdict(config)) if dataclasses.is_dataclass(config) else {}
    return {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "device": manager.device_string,
        "device_name": device_name,
        "time": time.time(),
        "total_memory": int(getattr(manager, "total_memory", 0)),
        "usable_memory": int(getattr(manager, "usable_memory", 0)),
        "stats": _json_value(manager.stats().as_dict()),
        "config": config_d,
        "tracking": tracker is not None,
        "segments": segments,
    }


def save_snapshot(snapshot: dict, path: str | os.PathLike[str]) -> None:
    """Write a snapshot as JSON (validated first, so a bad dict is not saved)."""
    _validate(snapshot, "snapshot")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(snapshot, f, indent=1)
        f.write("\n")


def load_snapshot(path: str | os.PathLike[str]) -> dict:
    """Read a snapshot saved by :func:`save_snapshot`; InvalidInputError says what is wrong
    with a file that is not one."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise InvalidInputError(f"{p}: no such snapshot file") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{p}: is a directory, not a snapshot file") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"{p}: not a gpumem snapshot (not UTF-8 JSON text)") from None
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{p}: not a gpumem snapshot: invalid JSON at line {exc.lineno} "
                                f"column {exc.colno}: {exc.msg}") from None
    except OSError as exc:
        raise InvalidInputError(f"{p}: cannot read: {exc.strerror or exc}") from None
    _validate(data, p)
    return data


def _validate(data: Any, where: str) -> None:
    def bad(msg: str) -> InvalidInputError:
        return InvalidInputError(f"{where}: not a valid gpumem snapshot: {msg}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format", SNAPSHOT_FORMAT) != SNAPSHOT_FORMAT:
        raise bad(f"format is {data.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
    version = data.get("version", SNAPSHOT_VERSION)
    if not isinstance(version, int) or version > SNAPSHOT_VERSION:
        raise bad(f"version {version!r} is not supported (this gpumem reads up to "
                  f"{SNAPSHOT_VERSION})")
    missing = [k for k in _TOP_KEYS if k not in data]
    if missing:
        raise bad(f"missing key(s) {missing}")
    if not isinstance(data["segments"], list):
        raise bad("'segments' must be a list")
    if not isinstance(data["stats"], dict):
        raise bad("'stats' must be an object")
    def require(record: Any, keys: Any, where: str) -> None:
        if not isinstance(record, dict):
            raise bad(f"{where} is not an object")
        miss = [k for k in keys if k not in record]
        if miss:
            raise bad(f"{where} lacks {miss}")

    for i, seg in enumerate(data["segments"]):
        require(seg, _SEGMENT_KEYS, f"segment #{i}")
        if not isinstance(seg["size"], int) or seg["size"] < 0 or not isinstance(seg["blocks"], list):
            raise bad(f"segment #{i} needs an int size and a list of blocks")
        end = 0
        for j, b in enumerate(seg["blocks"]):
            require(b, _BLOCK_KEYS, f"segment #{i} block #{j}")
            if b["state"] not in ("allocated", "free", "unmapped"):
                raise bad(f"segment #{i} block #{j} has state {b['state']!r}, expected "
                          f"'allocated', 'free' or 'unmapped'")
            if not all(isinstance(b[k], int) and b[k] >= 0 for k in ("offset", "size",
                                                                    "requested")):
                raise bad(f"segment #{i} block #{j}: offset, size and requested must be "
                          f"non-negative ints")
            end = max(end, b["offset"] + b["size"])
        if end > seg["size"]:
            raise bad(f"segment #{i}: blocks end at {end}, past the segment's size {seg['size']}")


class SnapshotTotals(StatsDict):
    """What :func:`summarize` returns; its keys used before still read, with a warning."""
    what = "summarize(snapshot)"
    renamed = {"segments": "num_segments", "allocated_bytes": "in_use_bytes",
               "free_bytes": "cached_bytes", "fragmentation": "fragmentation_ratio"}


def summarize(snapshot: dict) -> SnapshotTotals:
    """Totals of a snapshot in gpumem.stats' vocabulary: ``num_segments``, bytes by state
    (``reserved_bytes`` physical: without the ``hole_bytes`` of unmapped blocks;
    ``in_use_bytes`` in allocated blocks, ``cached_bytes`` in free ones), largest free block,
    ``fragmentation_ratio``, and ``{tag: bytes}`` of the allocated blocks."""
    reserved = allocated = requested = free = largest = unmapped = 0
    n_alloc = n_free = 0
    by_tag: dict[str, int] = {}
    for seg in snapshot["segments"]:
        reserved += seg["size"]
        for b in seg["blocks"]:
            if b["state"] == "unmapped":         # a hole: no physical memory
                reserved -= b["size"]
                unmapped += b["size"]
            elif b["state"] == "allocated":
                allocated += b["size"]
                requested += b["requested"]
                n_alloc += 1
                key = "(untagged)" if b.get("tag") is None else str(b["tag"])
                by_tag[key] = by_tag.get(key, 0) + b["size"]
            else:
                free += b["size"]
                n_free += 1
                largest = max(largest, b["size"])
    return SnapshotTotals(
        num_segments=len(snapshot["segments"]), reserved_bytes=reserved, in_use_bytes=allocated,
        requested_bytes=requested, cached_bytes=free, allocated_blocks=n_alloc,
        free_blocks=n_free, largest_free_block=largest,
        fragmentation_ratio=(1 - largest / free) if free else 0.0, bytes_by_tag=by_tag,
        hole_bytes=unmapped)


def format_snapshot(snapshot: dict, *, max_segments: int = 30, max_blocks: int = 8) -> str:
    """A readable text view: totals, then one line per segment with its largest blocks."""
    fb = format_bytes
    s = summarize(snapshot)
    lines = [
        f"snapshot of {snapshot['device']}"
        + (f" ({snapshot['device_name']})" if snapshot.get("device_name") else "")
        + f": {s['num_segments']} segment(s), {fb(s['reserved_bytes'])} reserved",
        f"  allocated {fb(s['in_use_bytes'])} in {s['allocated_blocks']} block(s) "
        f"({fb(s['requested_bytes'])} requested), free {fb(s['cached_bytes'])} in "
        f"{s['free_blocks']} block(s), largest free block {fb(s['largest_free_block'])}, "
        f"fragmentation {s['fragmentation_ratio']:.1%}",
    ]
    if s["bytes_by_tag"] and set(s["bytes_by_tag"]) != {"(untagged)"}:
        tags = sorted(s["bytes_by_tag"].items(), key=lambda kv: -kv[1])
        lines.append("  by tag: " + ", ".join(f"{k} {fb(v)}" for k, v in tags[:10]))
    segs = snapshot["segments"]
    for k, seg in enumerate(segs[:max_segments]):
        used = sum(b["size"] for b in seg["blocks"] if b["state"] == "allocated")
        lines.append(f"  seg {k:3d} {seg['pool']:5s} {fb(seg['size']):>11} at {seg['base']:#x} "
                     f"stream {seg['stream']}: {len(seg['blocks'])} block(s), "
                     f"{used / max(seg['size'], 1):.0%} allocated"
                     + (f", {fb(seg['unmapped_bytes'])} more reserved, unmapped"
                        if seg.get("unmapped_bytes") else ""))
        shown = seg["blocks"][:max_blocks]
        parts = []
        for b in shown:
            if b["state"] == "allocated":
                tag = "" if b.get("tag") is None else f" {b['tag']}"
                parts.append(f"[{fb(b['size'])}{tag}]")
            elif b["state"] == "unmapped":
                parts.append(f"<{fb(b['size'])} unmapped>")
            else:
                parts.append(f"({fb(b['size'])} free)")
        more = len(seg["blocks"]) - len(shown)
        lines.append("          " + " ".join(parts) + (f" ... +{more} more" if more > 0 else ""))
    if len(segs) > max_segments:
        lines.append(f"  ... {len(segs) - max_segments} more segment(s)")
    return "\n".join(lines)
