"""History recording: the pool's always-on C history, OOM dumps, and the HistoryRecorder.

**Always on** (issue 12): every CachingPool keeps its newest alloc/free events in C rings
(``history_events``, 100,000 by default: 4 MiB; ``pool.set_history(0)`` turns it off). Recording
costs two loads of the history clock (a C ticker thread stores CLOCK_MONOTONIC about every ms:
``gpumem/_core/_pool_clock.pxd``) and two 32-byte events per alloc/free pair, with no Python
involved. :func:`pool_trace` turns those rings into a :class:`gpumem.observe.trace.TraceData`; every
:class:`gpumem.OutOfMemoryError` raised by a manager carries the last :data:`OOM_HISTORY_EVENTS`
as ``err.history``; and with :func:`dump_on_oom` (or ``GPUMEM_DUMP_ON_OOM=DIR``) each OOM also
writes ``DIR/oom-<device>-<n>.csv.gz`` (the history as a trace: ``gpumem replay FILE --plot
out.png``) and ``DIR/oom-<device>-<n>.json`` (a snapshot: ``gpumem snapshot --load FILE --plot
out.png``).

Thread safety: the dump directory is module state owned by this module, guarded by
``_dump_lock``; the rings are guarded by the pool's locks (see gpumem/_core/pool.pyx).

**HistoryRecorder**: a manager's alloc/free events from the moment it starts, read from the
pool's C history, with tags and locations, saved as a trace.

>>> rec = mm.record_history(max_entries=100_000)     # doctest: +SKIP
>>> ...                                               # run the workload
>>> rec.stop(); rec.write("run.csv.gz")               # doctest: +SKIP
>>> print(gpumem.observe.replay.replay("run.csv.gz", "sim:24GiB"))   # doctest: +SKIP

``MemoryManager.record_history()`` (or ``HistoryRecorder(manager)``) starts one; no observer is
registered, so ``malloc``/``free`` of an untagged buffer run no Python for it. While it runs the
pool's history holds at least ``max_entries`` events (grown if needed, given back by the last
recorder to stop), the manager keeps tags of tagged buffers and the addresses of allocations in
a C log, and tells it of CPU-fallback buffers.

Each event is ``(t_ns, op, id, size, stream, tag, location, ptr)`` with ``t_ns`` from the pool's
history clock (``time.monotonic_ns()``'s, to ~1 ms) relative to the recorder's start, ``op`` ``"a"``/``"f"``, ``id`` the buffer's id,
``size`` its requested bytes and ``ptr`` its address (allocations only; 0 on a free, which pairs
with its allocation by ``id``; :func:`gpumem.export_memory_viz` uses it). The newest
``max_entries`` events are kept; ``dropped`` counts those pushed out. A free waiting for other
streams (``Buffer.record_stream``) is recorded when the pool gets the block back.

:meth:`HistoryRecorder.write` produces the ``gpumem/data/traces`` format, so a recorded run can be
replayed on any device or configuration:

- ids are renumbered 0..N-1 in allocation order (as the shared traces are);
- a free whose allocation is not in the ring (it fell out, or the buffer was allocated before
  recording started) is left out, so every free in the file pairs with an allocation;
- allocations still live at the end are kept without a free (a replay frees them at the end);
- ``t_ns`` starts at 0 at the first event written;
- extra columns ``stream``, ``device`` (``cpu`` for a CPU-fallback buffer, else the manager's
  device) and ``tag`` (``str(tag)``, empty for None) follow the four standard ones.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gpumem.errors import InvalidInputError

if TYPE_CHECKING:
    from gpumem.observe.trace import TraceData

__all__ = ["HistoryRecorder", "HistoryEvent", "pool_trace", "dump_on_oom", "OOM_HISTORY_EVENTS"]

#: events of the pool's history an OutOfMemoryError carries (the dump holds all of them)
OOM_HISTORY_EVENTS = 10_000

_dump_lock = threading.Lock()
_dump_dir: str | None = None          # set by dump_on_oom(); None: GPUMEM_DUMP_ON_OOM decides
_dump_set = False
_dump_count = 0


def pool_trace(pool: Any, *, last: int | None = None, until_ns: int | None = None,
               name: str = "pool history") -> "TraceData":
    """The pool's recorded events (the newest `last`, of those recorded up to `until_ns` on the
    rings' clock if given) as a TraceData in the shared trace format: ids renumbered 0..N-1 in
    allocation order, frees whose allocation is not in the history left out, ``t_ns`` from 0
    at the first event, a ``stream`` extra column."""
    from gpumem.observe.trace import OP_ALLOC, TraceData
    h = pool.history()
    if until_ns is not None:
        upto = int(np.searchsorted(h["t_ns"], until_ns, side="right"))
        h = {k: v[:upto] for k, v in h.items()}
    if last is not None:
        h = {k: v[max(0, len(v) - last):] for k, v in h.items()}
    ops, ids = h["op"], h["id"]
    alloc_pos = np.flatnonzero(ops == OP_ALLOC)
    free_pos = np.flatnonzero(ops != OP_ALLOC)
    renum = np.full(len(ids), -1, np.int64)
    renum[alloc_pos] = np.arange(len(alloc_pos))          # new ids in allocation order
    if len(alloc_pos) and len(free_pos):
        order = np.argsort(ids[alloc_pos], kind="stable")
        sorted_ids = ids[alloc_pos][order]
        w = np.minimum(np.searchsorted(sorted_ids, ids[free_pos]), len(sorted_ids) - 1)
        hit = sorted_ids[w] == ids[free_pos]
        renum[free_pos[hit]] = order[w[hit]]             # a free takes its allocation's id
    keep = renum >= 0
    t = h["t_ns"][keep]
    t = t - t[0] if len(t) else t
    return TraceData(t.astype(np.int64), ops[keep].astype(np.uint8), renum[keep],
                     h["size"][keep].astype(np.int64), name=name,
                     extra={"stream": [str(x) for x in h["stream"][keep].tolist()]})


def _clock_ns() -> int:
    """Now on the rings' clock: CLOCK_MONOTONIC (the ticker of _pool_clock.pxd samples it)."""
    return time.monotonic_ns()


def _history_until_now(manager: Any) -> Any:
    """A callable building the history of `manager`'s pool up to now (held weakly: an error
    kept around does not keep its manager alive)."""
    manager_ref = weakref.ref(manager)
    until = _clock_ns()
    name = f"history before an OOM on {manager.device_string}"

    def build() -> "TraceData | None":
        live = manager_ref()
        if live is None:
            return None
        return pool_trace(live.pool, last=OOM_HISTORY_EVENTS, until_ns=until, name=name)
    return build


def dump_on_oom(directory: Any) -> None:
    """Write the history (a trace) and a snapshot into `directory` on every OutOfMemoryError
    a manager raises (``None``: stop; this overrides ``GPUMEM_DUMP_ON_OOM``)."""
    global _dump_dir, _dump_set
    if directory is not None:
        import os
        directory = os.fspath(directory)
        if not directory:
            raise InvalidInputError("dump_on_oom takes a directory path or None, got ''")
    with _dump_lock:
        _dump_dir = directory
        _dump_set = True


def _dump_directory() -> str | None:
    import os
    with _dump_lock:
        if _dump_set:
            return _dump_dir
    return os.environ.get("GPUMEM_DUMP_ON_OOM") or None


def on_oom(manager: Any, err: Any) -> None:
    """Called by the manager for each OutOfMemoryError: attach the recent history as
    ``err.history`` (a TraceData, or None when history is off) and write the dump if asked.
    Never raises: a failure to record is a warning, the OOM stays the error."""
    import os
    import warnings
    global _dump_count
    try:
        if manager.pool.history_capacity:
            # built on first access of err.history (a program that catches OOMs and retries
            # would otherwise pay a copy and sort of the rings per error), from the events up
            # to now: those recorded later are left out
            err._history_source = _history_until_now(manager)
        directory = _dump_directory()
        if directory is None:
            return
        from gpumem.observe.snapshot import save_snapshot, take_snapshot
        from gpumem.observe.trace import write_trace
        with _dump_lock:
            _dump_count += 1
            n = _dump_count
        stem = os.path.join(directory, f"oom-{manager.device_string.replace(':', '')}-"
                                       f"{os.getpid()}-{n}")
        os.makedirs(directory, exist_ok=True)
        write_trace(stem + ".csv.gz", pool_trace(manager.pool), extra_columns=("stream",))
        save_snapshot(take_snapshot(manager), stem + ".json")
        err.dump_files = (stem + ".csv.gz", stem + ".json")
    except Exception as exc:   # the OOM is the error the user must see
        warnings.warn(f"gpumem: could not record the history of an OOM: {exc}", RuntimeWarning)



class HistoryEvent(NamedTuple):
    t_ns: int
    op: str
    id: int
    size: int
    stream: int
    tag: Any
    location: str
    ptr: int = 0


def _event_count(pool: Any) -> int:
    """Events the pool has recorded since it was made: one per allocation and per free."""
    c = pool.counters()
    return c["num_allocs"] + c["num_frees"]


class HistoryRecorder:
    """The alloc/free events of a manager from a point on, read from the pool's C history.

    Recording costs nothing per allocation beyond the pool's always-on history, plus, while
    a recorder runs, a dict store for each *tagged* buffer (its tag) and two C stores (its
    address, for :func:`gpumem.export_memory_viz`). CPU-fallback buffers (the slow path) are
    noted by the manager as they come and go. Built with a manager it records at once
    (``MemoryManager.record_history()`` does this); built without one it stays empty.

    Thread safety: the recorder's own state (start marks, fallback events, frozen events) is
    guarded by ``_lock``; the manager's list of recorders by the manager's ``_slow`` lock; the
    rings by the pool's locks. Events of other threads appear in time order (the history's
    clock ticks every few ms).
    """

    def __init__(self, manager: Any = None, max_entries: int = 1_000_000) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise InvalidInputError(f"max_entries must be a positive int, got {max_entries!r}")
        self._manager_ref = weakref.ref(manager) if manager is not None else None
        self.device = getattr(manager, "device_string", "") if manager is not None else ""
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._frozen: list[tuple] | None = None      # the events, once stopped
        self._frozen_recorded = 0
        self._start = 0                              # the pool's event count at the start
        self._t0 = 0
        # CPU-fallback events as (pool events before it, event), and how many were noted
        self._fallback: deque[tuple[int, tuple]] = deque(maxlen=max_entries)
        self._fallback_noted = 0
        self.stopped = manager is None
        if manager is not None:
            manager._start_recording(self)
            self._mark_start()

    @property
    def manager(self) -> Any:
        return self._manager_ref() if self._manager_ref is not None else None

    def _mark_start(self) -> None:
        """Record from now on."""
        start = _event_count(self.manager.pool)
        with self._lock:
            self._start, self._t0 = start, _clock_ns()
            self._fallback.clear()
            self._fallback_noted = 0

    def note_fallback(self, buf: Any, op: str) -> None:
        """The manager tells of a CPU-fallback buffer allocated or freed (op "a"/"f")."""
        mgr = self.manager
        position = _event_count(mgr.pool) if mgr is not None else 0
        with self._lock:
            ev = (max(0, _clock_ns() - self._t0), op, buf.id, buf.nbytes, buf.stream, buf.tag,
                  "cpu", buf.ptr if op == "a" else 0)
            self._fallback.append((position, ev))
            self._fallback_noted += 1

    def _live_events(self) -> tuple[list[tuple], int]:
        """(events since the start, oldest first, at most max_entries; events recorded)."""
        mgr = self.manager
        if mgr is None or mgr.closed:
            return [], 0
        with self._lock:
            start, t0 = self._start, self._t0
            fallback, noted = list(self._fallback), self._fallback_noted
        total = _event_count(mgr.pool)
        n = min(total - start, self.max_entries)
        keyed: list[tuple[tuple[int, int], tuple]] = []
        if n > 0:
            h = mgr.pool.history(n)
            tags = mgr._tags or {}
            addrs = mgr._addresses()
            first = total - len(h["id"])                 # the pool's number of the first event
            for i, (t, op, bid, size, stream) in enumerate(zip(
                    h["t_ns"].tolist(), h["op"].tolist(), h["id"].tolist(),
                    h["size"].tolist(), h["stream"].tolist())):
                keyed.append(((first + i, 1), (max(0, t - t0), "f" if op else "a", bid, size,
                                               stream, tags.get(bid), "device",
                                               0 if op else addrs.get(bid, 0))))
        if fallback:                 # a fallback event goes before the pool's next event
            keyed.extend(((pos, 0), ev) for pos, ev in fallback)
            keyed.sort(key=lambda k: k[0])
        return [ev for _, ev in keyed[-self.max_entries:]], total - start + noted

    def _current(self) -> tuple[list[tuple], int]:
        with self._lock:
            if self._frozen is not None:
                return self._frozen, self._frozen_recorded
        return self._live_events()

    # --- control --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop recording (idempotent); the events recorded so far stay."""
        if self.stopped:
            return
        events, recorded = self._live_events()
        with self._lock:
            self._frozen, self._frozen_recorded = events, recorded
        self.stopped = True
        mgr = self.manager
        if mgr is not None:
            mgr._stop_recording(self)

    def clear(self) -> None:
        """Forget the recorded events (recording goes on)."""
        with self._lock:
            if self._frozen is not None:
                self._frozen, self._frozen_recorded = [], 0
                return
        self._mark_start()

    def __enter__(self) -> "HistoryRecorder":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.stop()
        return False

    # --- contents --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._current()[0])

    @property
    def recorded(self) -> int:
        """Events seen since start (or clear()), including dropped ones."""
        return self._current()[1]

    @property
    def dropped(self) -> int:
        """Events pushed out of the ring by newer ones."""
        events, recorded = self._current()
        return recorded - len(events)

    def events(self) -> list[HistoryEvent]:
        """The events in the ring, oldest first, with the buffers' own ids."""
        return [HistoryEvent(*e) for e in self._current()[0]]

    def _renumbered(self) -> tuple[list[tuple], int]:
        """Rows (t_ns, op, new_id, size, stream, device, tag) and the count of dropped frees."""
        raw = self._current()[0]
        rows: list[tuple] = []
        ids: dict[tuple[str, int], int] = {}
        orphan_frees = 0
        t0 = raw[0][0] if raw else 0
        dev = self.device or "device"
        next_id = 0
        for t, op, bid, size, stream, tag, loc, _ptr in raw:
            key = (loc, bid)
            if op == "a":
                # buffer ids are unique per pool, so an id live in `ids` cannot come back;
                # if it ever did, the new allocation simply takes over the pairing
                ids[key] = new = next_id
                next_id += 1
            else:
                new = ids.pop(key, None)
                if new is None:
                    orphan_frees += 1
                    continue
            rows.append((t - t0, op, new, size, stream, "cpu" if loc == "cpu" else dev,
                         "" if tag is None else str(tag)))
        return rows, orphan_frees

    def to_trace(self) -> "TraceData":
        """The recorded events as a :class:`gpumem.observe.trace.TraceData` (renumbered like
        :meth:`write`), ready for :func:`gpumem.observe.replay.replay`."""
        from gpumem.observe.trace import OP_ALLOC, OP_FREE, TraceData
        rows, _ = self._renumbered()
        n = len(rows)
        return TraceData(
            np.fromiter((r[0] for r in rows), np.int64, n),
            np.fromiter((OP_ALLOC if r[1] == "a" else OP_FREE for r in rows), np.uint8, n),
            np.fromiter((r[2] for r in rows), np.int64, n),
            np.fromiter((r[3] for r in rows), np.int64, n),
            name=f"history of {self.device or 'a manager'}",
            extra={"stream": [str(r[4]) for r in rows], "device": [r[5] for r in rows],
                   "tag": [r[6] for r in rows]})

    def write(self, path: Any) -> int:
        """Write the ring as a trace file (gzip if ``path`` ends with ``.gz``); see the module
        docstring for the rules. Returns the number of events written."""
        from gpumem.observe.trace import EXTRA_COLUMNS, write_trace
        rows, _ = self._renumbered()
        return write_trace(path, rows, extra_columns=EXTRA_COLUMNS)

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "recording"
        events, recorded = self._current()
        return (f"<gpumem.HistoryRecorder {state}, {len(events)} events "
                f"({recorded - len(events)} dropped), max {self.max_entries}>")
