"""Allocation tracking: who holds which buffer, since when, and what is left at the end.

Turned on with ``MemoryConfig(track_allocations=True)`` (or ``GPUMEM_DEBUG=1``); the manager then
builds an :class:`AllocationTracker` and calls its ``on_alloc``/``on_free`` for every buffer.
With tracking off the manager registers no observer and the hot path does no extra work.

The tracker keeps a :class:`BufferMetadata` per live buffer, keyed by ``(location, id)`` (a CPU
fallback buffer's id comes from the host pool and could equal a device buffer's). It never keeps
a reference to a buffer: a buffer dropped without ``free()`` is still returned to its pool by the
garbage collector, and ``on_free`` then forgets it.

Leaks are reported at WARNING on the ``gpumem`` logger when the manager is closed with live
buffers and, for managers still open then, at interpreter exit.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, NamedTuple

from gpumem.units import format_bytes, parse_size

__all__ = ["BufferMetadata", "AllocationTracker"]

_new_meta = tuple.__new__

log = logging.getLogger("gpumem")

#: frames of these gpumem modules are skipped when capturing a creation stack (the caller's
#: frames are the useful ones)
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_INTERNAL_FILES = frozenset(os.path.join(_PKG_DIR, f) for f in (
    "manager.py", "miss_path.py", "stream_book.py", "expandable.py", "tracking.py", "history.py",
    "fallback.py", "batch.py", "multi.py",
    "pressure.py", "replay.py"))
MAX_STACK_DEPTH = 16
#: at most this many buffers are listed one by one in a leak report
REPORT_LIMIT = 20


class BufferMetadata(NamedTuple):
    """What the tracker knows about one live buffer.

    ``created_at`` is ``time.monotonic()`` (for ages), ``created_wall`` is ``time.time()``;
    ``elements`` is the element count, the byte count for untyped buffers; ``stack`` holds
    ``"file:line in func"`` strings, innermost caller first, when stacks are captured.
    """

    id: int
    nbytes: int
    elements: int
    location: str
    tag: Any
    created_at: float
    created_wall: float
    device: str = ""
    stream: int = 0
    stack: tuple[str, ...] | None = None

    def age(self, now: float | None = None) -> float:
        """Seconds since the buffer was allocated."""
        return (time.monotonic() if now is None else now) - self.created_at

    @property
    def where(self) -> str:
        """The innermost caller frame, or a hint when stacks were not captured."""
        if self.stack:
            return self.stack[0]
        return "unknown (set track_stacks=True to record where buffers are created)"

    def describe(self, now: float | None = None) -> str:
        tag = "" if self.tag is None else f" tag={self.tag!r}"
        return (f"buffer {self.id} {format_bytes(self.nbytes)} on {self.device or self.location}"
                f"{tag}, age {self.age(now):.1f} s, created at {self.where}")


def _capture_stack(limit: int = MAX_STACK_DEPTH) -> tuple[str, ...]:
    out: list[str] = []
    frame = sys._getframe(2)
    while frame is not None and len(out) < limit:
        code = frame.f_code
        if code.co_filename not in _INTERNAL_FILES:
            out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return tuple(out)


class AllocationTracker:
    """Observer of a manager's buffers (``manager.add_observer(tracker)``; the manager does this
    itself with ``track_allocations=True``). Thread safe."""

    def __init__(self, manager: Any = None, capture_stacks: bool = False) -> None:
        self._manager_ref = weakref.ref(manager) if manager is not None else None
        self.capture_stacks = bool(capture_stacks)
        self._live: dict[tuple[str, int], BufferMetadata] = {}
        self._lock = threading.Lock()
        self.total_allocs = 0
        self.total_frees = 0
        self.peak_bytes = 0
        self._bytes = 0
        _TRACKERS.add(self)

    @property
    def manager(self) -> Any:
        return self._manager_ref() if self._manager_ref is not None else None

    # --- observer protocol ------------------------------------------------------------------------
    def on_alloc(self, buf: Any) -> None:
        # a NamedTuple built positionally: this runs on every malloc while tracking is on
        nbytes = buf.nbytes
        location = buf.location
        meta = _new_meta(BufferMetadata, (
            buf.id, nbytes, nbytes, location, buf.tag, time.monotonic(), time.time(), buf.device,
            buf.stream, _capture_stack() if self.capture_stacks else None))
        with self._lock:
            self._live[(location, meta.id)] = meta
            self.total_allocs += 1
            self._bytes += nbytes
            if self._bytes > self.peak_bytes:
                self.peak_bytes = self._bytes

    def on_free(self, buf: Any) -> None:
        with self._lock:
            meta = self._live.pop((buf.location, buf.id), None)
            if meta is not None:
                self.total_frees += 1
                self._bytes -= meta.nbytes

    # --- queries ----------------------------------------------------------------------------------
    def get(self, buffer_id: int, location: str = "device") -> BufferMetadata | None:
        with self._lock:
            return self._live.get((location, buffer_id))

    def live(self) -> list[BufferMetadata]:
        """Every live buffer, oldest first."""
        with self._lock:
            return sorted(self._live.values(), key=lambda m: m.created_at)

    def count(self) -> int:
        """Number of live buffers."""
        return len(self._live)

    def total_bytes(self) -> int:
        """Bytes of the live buffers (as requested)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._live)

    def find_old_allocations(self, age_seconds: float) -> list[BufferMetadata]:
        """Live buffers allocated at least ``age_seconds`` ago, oldest first."""
        if isinstance(age_seconds, bool) or not isinstance(age_seconds, (int, float)) \
                or age_seconds < 0:
            from gpumem.errors import InvalidInputError
            raise InvalidInputError(f"age_seconds must be a number >= 0, got {age_seconds!r}")
        cutoff = time.monotonic() - age_seconds
        return [m for m in self.live() if m.created_at <= cutoff]

    def get_large_allocations(self, min_size: int | str) -> list[BufferMetadata]:
        """Live buffers of at least ``min_size`` bytes (an int or "64MiB"), largest first."""
        n = parse_size(min_size, what="min_size")
        with self._lock:
            found = [m for m in self._live.values() if m.nbytes >= n]
        return sorted(found, key=lambda m: (-m.nbytes, m.created_at))

    def by_tag(self) -> dict[Any, tuple[int, int]]:
        """``{tag: (count, bytes)}`` over the live buffers."""
        out: dict[Any, list[int]] = {}
        with self._lock:
            for m in self._live.values():
                key = m.tag if _hashable(m.tag) else repr(m.tag)
                c = out.setdefault(key, [0, 0])
                c[0] += 1
                c[1] += m.nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def check_leaks(self) -> list[BufferMetadata]:
        """The buffers still live (call it where you expect none), oldest first."""
        return self.live()

    # --- reports ----------------------------------------------------------------------------------
    def format_report(self, at: str = "now", leaks: list[BufferMetadata] | None = None) -> str:
        leaks = self.live() if leaks is None else leaks
        if not leaks:
            return ""
        now = time.monotonic()
        total = sum(m.nbytes for m in leaks)
        mgr = self.manager
        where = f" on {mgr.device_string}" if mgr is not None else ""
        lines = [f"{len(leaks)} buffer(s) still live{where} at {at}, "
                 f"{format_bytes(total)} in all:"]
        biggest = sorted(leaks, key=lambda m: (-m.nbytes, m.created_at))
        for m in biggest[:REPORT_LIMIT]:
            lines.append("  " + m.describe(now))
        if len(leaks) > REPORT_LIMIT:
            rest = biggest[REPORT_LIMIT:]
            lines.append(f"  ... and {len(rest)} more ({format_bytes(sum(m.nbytes for m in rest))})")
        return "\n".join(lines)

    def report_leaks(self, at: str = "now") -> str:
        """Log the live buffers (tag, size, where created) at WARNING on the ``gpumem`` logger
        and return the text; ``""`` (and nothing logged) when there are none."""
        text = self.format_report(at)
        if text:
            log.warning("%s", text)
        return text

    def clear(self) -> None:
        with self._lock:
            self._live.clear()
            self._bytes = 0

    def __repr__(self) -> str:
        return (f"<gpumem.AllocationTracker {self.count()} live buffers, "
                f"{format_bytes(self._bytes)}, stacks {'on' if self.capture_stacks else 'off'}>")


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


# --- interpreter exit ---------------------------------------------------------------------------------
# One atexit hook for all trackers; the set holds them weakly, so a tracker (and its manager)
# is never kept alive by it.
_TRACKERS: "weakref.WeakSet[AllocationTracker]" = weakref.WeakSet()


@atexit.register
def _report_at_exit() -> None:
    for tracker in list(_TRACKERS):
        try:
            mgr = tracker.manager
            if tracker._manager_ref is not None and (mgr is None or mgr.closed):
                continue        # close() reported already, and buffers of a closed manager are gone
            if tracker.count():
                tracker.report_leaks(at="interpreter exit")
        except Exception:
            pass
