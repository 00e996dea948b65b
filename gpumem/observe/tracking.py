"""Allocation tracking: who holds which buffer, since when, and what is left at the end.

Turned on with ``MemoryConfig(track_allocations=True)`` (or ``GPUMEM_DEBUG=1``); the manager then
builds an :class:`AllocationTracker`.

With stacks off (the default) the tracker does no work per buffer: every query is built from
what the pool already knows. Its live blocks (``CachingPool.segments()``: id, requested bytes,
stream) are the live buffers, minus frees waiting for other streams; those of the manager's
CPU-fallback host pool are the ``"cpu"`` ones. The creation time of a buffer is its allocation
event in the pool's C history (``history_events``, always on); a buffer whose event has left the
history gets the time of the oldest event kept there, marked ``exact_age=False`` ("age >= ...").
Tags come from the manager's ``_tags`` dict, filled by the alloc path for tagged buffers only.
``total_allocs``/``total_frees`` are the pool's counters since the tracker started, and
``peak_bytes`` (requested bytes) is replayed from the history since the last read: exact while
the history still holds every event since that read (it is read at each query of the peak).

With ``track_stacks=True`` the manager registers the tracker as an observer instead
(``on_alloc``/``on_free`` for every buffer, a :class:`BufferMetadata` with its stack each); a
tracker built without a manager works that way too.

The tracker never keeps a reference to a buffer: a buffer dropped without ``free()`` is still
returned to its pool by the garbage collector, and then no longer live.

Thread safety: the tracker's own state (observed buffers, ignored ids, creation times learnt,
peak replay) is guarded by ``_lock``; the pool's state by the pool's locks; ``_tags`` is written
by the alloc path under the GIL (one dict store) and pruned by the manager.

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
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_FILES = frozenset(os.path.join(_PKG_DIR, f) for f in (
    "manager/memory_manager.py", "manager/miss_path.py", "manager/stream_book.py",
    "manager/growth.py",
    "manager/expandable.py", "manager/fallback.py", "manager/batch.py", "manager/pressure.py",
    "observe/tracking.py", "observe/history.py", "observe/replay.py", "placement/multi.py"))
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
    exact_age: bool = True       # False: allocated before the oldest event in the history


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
        age = "" if self.exact_age else ">= "
        return (f"buffer {self.id} {format_bytes(self.nbytes)} on {self.device or self.location}"
                f"{tag}, age {age}{self.age(now):.1f} s, created at {self.where}")


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
    """The live buffers of a manager (see the module docstring for where each figure comes
    from). Thread safe."""

    def __init__(self, manager: Any = None, capture_stacks: bool = False) -> None:
        self._manager_ref = weakref.ref(manager) if manager is not None else None
        self.capture_stacks = bool(capture_stacks)
        #: True: queries read the manager's pool; False: on_alloc/on_free feed the tracker
        self.reads_pool = manager is not None and not self.capture_stacks
        self._live: dict[tuple[str, int], BufferMetadata] = {}   # observed (on_alloc)
        self._lock = threading.Lock()
        self._observed_allocs = 0
        self._observed_frees = 0
        self._observed_peak = 0
        self._bytes = 0
        self._ignored: set[tuple[str, int]] = set()     # live at clear(): not reported
        self._times: dict[tuple[str, int], tuple[float, bool]] = {}   # learnt creation times
        self._base = {"device": _counts(manager), "cpu": (0, 0)}
        self._host_seen = False
        # peak replay: requested bytes after the last event read, and that event's number
        self._peak = 0
        self._peak_level = manager.pool.counters()["requested_bytes"] if manager else 0
        self._peak_events = self._base["device"][0] + self._base["device"][1]
        _TRACKERS.add(self)

    @property
    def manager(self) -> Any:
        return self._manager_ref() if self._manager_ref is not None else None

    # --- observer protocol (stacks on, or a tracker without a manager) ----------------------
    def on_alloc(self, buf: Any) -> None:
        if self.reads_pool:
            return              # registered by hand as well: the pool knows this buffer
        # a NamedTuple built positionally: this runs on every malloc while stacks are on
        nbytes = buf.nbytes
        location = buf.location
        meta = _new_meta(BufferMetadata, (
            buf.id, nbytes, nbytes, location, buf.tag, time.monotonic(), time.time(), buf.device,
            buf.stream, _capture_stack() if self.capture_stacks else None, True))
        with self._lock:
            self._live[(location, meta.id)] = meta
            self._observed_allocs += 1
            self._bytes += nbytes
            if self._bytes > self._observed_peak:
                self._observed_peak = self._bytes

    def on_free(self, buf: Any) -> None:
        if self.reads_pool:
            return
        with self._lock:
            meta = self._live.pop((buf.location, buf.id), None)
            if meta is not None:
                self._observed_frees += 1
                self._bytes -= meta.nbytes

    # --- reading the pool -------------------------------------------------------------------
    def _pool_manager(self) -> Any:
        """The manager whose pool the queries read, or None (observer mode, or closed)."""
        if not self.reads_pool:
            return None
        mgr = self.manager
        return None if mgr is None or mgr.closed else mgr

    def _from_pool(self, mgr: Any) -> list[BufferMetadata]:
        """The live buffers of mgr's pool and of its CPU-fallback host pool."""
        out: list[BufferMetadata] = []
        pending = mgr.pending_free_ids()
        now_mono, now_wall = time.monotonic(), time.time()
        learnt: dict[tuple[str, int], tuple[float, bool]] = {}
        all_live: set[tuple[str, int]] = set()
        with self._lock:
            known, ignored = dict(self._times), set(self._ignored)
        for location, owner in (("device", mgr), ("cpu", mgr.fallback_manager)):
            if owner is None:
                continue
            blocks = [(b["id"], b["requested"], b["stream"]) for seg in owner.pool.segments()
                      for b in seg["blocks"] if b["state"] == "allocated"
                      and (location == "cpu" or b["id"] not in pending)]
            all_live.update((location, bid) for bid, _, _ in blocks)
            live = [b for b in blocks if (location, b[0]) not in ignored]
            if not live:
                continue
            missing = [bid for bid, _, _ in live if (location, bid) not in known]
            times = _creation_times(owner.pool, missing) if missing else {}
            tags = owner._tags or {}
            device = "cpu" if location == "cpu" else mgr.device_string
            for bid, nbytes, stream in live:
                key = (location, bid)
                created, exact = known.get(key) or times.get(bid) or (now_mono, False)
                learnt[key] = (created, exact)
                out.append(_new_meta(BufferMetadata, (
                    bid, nbytes, nbytes, location, tags.get(bid), created,
                    now_wall - (now_mono - created), device, stream, None, exact)))
        with self._lock:
            self._times = learnt                  # only live buffers: forgets the freed ones
            self._ignored &= all_live          # ids are never reused: forget the freed ones
        return out

    def _entries(self) -> list[BufferMetadata]:
        with self._lock:
            observed = list(self._live.values())
        mgr = self._pool_manager()
        return observed if mgr is None else observed + self._from_pool(mgr)

    # --- queries ----------------------------------------------------------------------------------
    def get(self, buffer_id: int, location: str = "device") -> BufferMetadata | None:
        with self._lock:
            meta = self._live.get((location, buffer_id))
        if meta is not None or self._pool_manager() is None:
            return meta
        return next((m for m in self._entries()
                     if m.id == buffer_id and m.location == location), None)

    def live(self) -> list[BufferMetadata]:
        """Every live buffer, oldest first."""
        return sorted(self._entries(), key=lambda m: (m.created_at, m.id))

    def count(self) -> int:
        """Number of live buffers."""
        mgr = self._pool_manager()
        if mgr is None:
            return len(self._live)
        if self._ignored or mgr.pending_free_count:
            return len(self._entries())
        n = mgr.pool.counters()["active_blocks"] + len(self._live)
        if mgr.fallback_manager is not None:
            n += mgr.fallback_manager.pool.counters()["active_blocks"]
        return n

    def total_bytes(self) -> int:
        """Bytes of the live buffers (as requested)."""
        mgr = self._pool_manager()
        if mgr is None:
            return self._bytes
        if self._ignored or mgr.pending_free_count:
            return sum(m.nbytes for m in self._entries())
        n = mgr.pool.counters()["requested_bytes"] + self._bytes
        if mgr.fallback_manager is not None:
            n += mgr.fallback_manager.pool.counters()["requested_bytes"]
        return n

    def __len__(self) -> int:
        return self.count()

    @property
    def total_allocs(self) -> int:
        """Allocations since the tracker started."""
        return self._observed_allocs + self._pool_counts()[0]

    @property
    def total_frees(self) -> int:
        """Frees since the tracker started (a free waiting for other streams counts once the
        pool has the block back)."""
        return self._observed_frees + self._pool_counts()[1]

    def _pool_counts(self) -> tuple[int, int]:
        mgr = self._pool_manager()
        if mgr is None:
            return 0, 0
        a, f = _counts(mgr)
        a0, f0 = self._base["device"]
        if mgr.fallback_manager is not None:
            ha, hf = _counts(mgr.fallback_manager)
            a, f = a + ha, f + hf
        return a - a0, f - f0

    @property
    def peak_bytes(self) -> int:
        """The most requested bytes live at once since the tracker started (device memory;
        CPU fallback buffers count while observed)."""
        mgr = self._pool_manager()
        if mgr is None:
            return self._observed_peak
        with self._lock:
            self._replay_peak(mgr.pool)
            return max(self._peak, self._observed_peak)

    def _replay_peak(self, pool: Any) -> None:
        """Walk the history events since the last read (lock held). Events that left the
        history are skipped: the level is then taken from the requested-bytes counter."""
        c = pool.counters()
        total = c["num_allocs"] + c["num_frees"]
        new = total - self._peak_events
        if new <= 0:
            return
        h = pool.history(new)
        sizes = h["size"] * (1 - 2 * h["op"].astype("int64"))       # + alloc, - free
        level = c["requested_bytes"] - int(sizes.sum()) if len(sizes) < new \
            else self._peak_level
        if len(sizes):
            self._peak = max(self._peak, level + int(sizes.cumsum().max()), level)
        self._peak_level = c["requested_bytes"]
        self._peak_events = total

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
        found = [m for m in self._entries() if m.nbytes >= n]
        return sorted(found, key=lambda m: (-m.nbytes, m.created_at))

    def by_tag(self) -> dict[Any, tuple[int, int]]:
        """``{tag: (count, bytes)}`` over the live buffers."""
        out: dict[Any, list[int]] = {}
        for m in self._entries():
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
        """Forget the buffers live now: they are no longer reported (the plug-ins call this
        after reporting, so that close() does not report them again)."""
        mgr = self._pool_manager()
        keys = {(m.location, m.id) for m in self._from_pool(mgr)} if mgr is not None else set()
        with self._lock:
            self._live.clear()
            self._bytes = 0
            self._ignored |= keys

    def __repr__(self) -> str:
        return (f"<gpumem.AllocationTracker {self.count()} live buffers, "
                f"{format_bytes(self.total_bytes())}, "
                f"stacks {'on' if self.capture_stacks else 'off'}>")


def _counts(manager: Any) -> tuple[int, int]:
    """(allocations, frees) the manager's pool has counted, (0, 0) without one."""
    if manager is None:
        return 0, 0
    c = manager.pool.counters()
    return c["num_allocs"], c["num_frees"]


def _creation_times(pool: Any, ids: list[int]) -> dict[int, tuple[float, bool]]:
    """``{id: (time.monotonic() seconds, exact)}`` for these live ids, from the allocation
    events in the pool's history; ids whose event has left it get the oldest time there,
    inexact (now when the history is off or empty)."""
    h = pool.history()
    alloc = h["op"] == 0
    found = dict(zip(h["id"][alloc].tolist(), (h["t_ns"][alloc] / 1e9).tolist()))
    oldest = float(h["t_ns"][0]) / 1e9 if len(h["t_ns"]) else time.monotonic()
    return {bid: (found[bid], True) if bid in found else (oldest, False) for bid in ids}


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
