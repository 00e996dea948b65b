"""History recording: a ring buffer of a manager's alloc/free events, saved as a trace.

>>> rec = mm.record_history(max_entries=100_000)     # doctest: +SKIP
>>> ...                                               # run the workload
>>> rec.stop(); rec.write("run.csv.gz")               # doctest: +SKIP
>>> print(gpumem.replay.replay("run.csv.gz", "sim:24GiB"))   # doctest: +SKIP

``MemoryManager.record_history()`` builds the recorder and registers it as an observer; a recorder
built by hand must be registered with ``manager.add_observer(rec)``.

Each event is ``(t_ns, op, id, size, stream, tag, location, ptr)`` with ``t_ns`` from
``time.perf_counter_ns()`` relative to the recorder's start, ``op`` ``"a"``/``"f"``, ``id`` the
buffer's id, ``size`` its requested bytes and ``ptr`` its address (allocations only; 0 on a
free, which pairs with its allocation by ``id``; :func:`gpumem.export_memory_viz` uses it). The ring keeps the newest ``max_entries`` events;
``dropped`` counts those pushed out.

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
    from gpumem.trace import TraceData

__all__ = ["HistoryRecorder", "HistoryEvent"]


class HistoryEvent(NamedTuple):
    t_ns: int
    op: str
    id: int
    size: int
    stream: int
    tag: Any
    location: str
    ptr: int = 0


class HistoryRecorder:
    """A bounded ring of alloc/free events observed on a manager."""

    def __init__(self, manager: Any = None, max_entries: int = 1_000_000) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise InvalidInputError(f"max_entries must be a positive int, got {max_entries!r}")
        self._manager_ref = weakref.ref(manager) if manager is not None else None
        self.device = getattr(manager, "device_string", "") if manager is not None else ""
        self.max_entries = max_entries
        self._ring: deque[tuple] = deque(maxlen=max_entries)
        self._t0 = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._recorded = 0
        self.stopped = False

    @property
    def manager(self) -> Any:
        return self._manager_ref() if self._manager_ref is not None else None

    # --- observer protocol --------------------------------------------------------------------
    def on_alloc(self, buf: Any) -> None:
        if self.stopped:
            return
        ev = (time.perf_counter_ns() - self._t0, "a", buf.id, buf.nbytes, buf.stream, buf.tag,
              buf.location, buf.ptr)
        with self._lock:
            self._ring.append(ev)
            self._recorded += 1

    def on_free(self, buf: Any) -> None:
        if self.stopped:
            return
        ev = (time.perf_counter_ns() - self._t0, "f", buf.id, buf.nbytes, buf.stream, buf.tag,
              buf.location, 0)
        with self._lock:
            self._ring.append(ev)
            self._recorded += 1

    # --- control --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop recording and unregister from the manager (idempotent); the events stay."""
        self.stopped = True
        mgr = self.manager
        if mgr is not None:
            try:
                mgr.remove_observer(self)
            except ValueError:
                pass            # not registered (built by hand, or stopped already)

    def clear(self) -> None:
        """Forget the recorded events (recording goes on)."""
        with self._lock:
            self._ring.clear()
            self._recorded = 0

    def __enter__(self) -> "HistoryRecorder":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.stop()
        return False

    # --- contents --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ring)

    @property
    def recorded(self) -> int:
        """Events seen since start (or clear()), including dropped ones."""
        return self._recorded

    @property
    def dropped(self) -> int:
        """Events pushed out of the ring by newer ones."""
        return self._recorded - len(self._ring)

    def events(self) -> list[HistoryEvent]:
        """The events in the ring, oldest first, with the buffers' own ids."""
        with self._lock:
            raw = list(self._ring)
        return [HistoryEvent(*e) for e in raw]

    def _renumbered(self) -> tuple[list[tuple], int]:
        """Rows (t_ns, op, new_id, size, stream, device, tag) and the count of dropped frees."""
        with self._lock:
            raw = list(self._ring)
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
        """The recorded events as a :class:`gpumem.trace.TraceData` (renumbered like
        :meth:`write`), ready for :func:`gpumem.replay.replay`."""
        from gpumem.trace import OP_ALLOC, OP_FREE, TraceData
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
        from gpumem.trace import EXTRA_COLUMNS, write_trace
        rows, _ = self._renumbered()
        return write_trace(path, rows, extra_columns=EXTRA_COLUMNS)

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "recording"
        return (f"<gpumem.HistoryRecorder {state}, {len(self)} events "
                f"({self.dropped} dropped), max {self.max_entries}>")
