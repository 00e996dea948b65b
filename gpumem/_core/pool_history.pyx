# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The pool's allocation history: sizing the C rings (gm_ring in pool.pxd) and exporting them
as numpy arrays, merged by time across the pool's ring and the front caches' rings.

The hot path writes the rings itself (``_record`` in _pool_clock.pxd, under the lock that
guards each ring); this module only (re)starts them and copies them out, under all the locks
(``_lock_all_gil``: a GIL holder never spins), building the numpy arrays after unlocking.
numpy is imported when a history is read, not at import. Shared state: only the pool's C
structures, owned by its locks.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from gpumem._core.pool_layout cimport GM_NSHARDS, gm_event, gm_pool, gm_ring
from gpumem._core._pool_inline cimport _lock_all_gil, _unlock_all, _ring_init

_MAX_HISTORY = 1 << 30          # events per ring (32 GiB): a bound against typos, not a budget


def _event_dtype():
    import numpy as np
    return np.dtype([("t_ns", "<u8"), ("id", "<u8"), ("size_op", "<u8"), ("stream", "<u8")])


def _allocs_before_frees(ops, ids):
    """An order (index array) of the events with each free after its allocation. Events of two
    rings with the same clock tick can sort a free before its allocation (a block allocated
    on one thread and freed on another within one clock tick): such a free moves to just after
    its allocation. Rare, so done in Python."""
    import numpy as np
    n = len(ops)
    allocs = np.flatnonzero(ops == 0)
    frees = np.flatnonzero(ops == 1)
    if len(allocs) == 0 or len(frees) == 0:
        return np.arange(n)
    by_id = np.argsort(ids[allocs], kind="stable")
    ids_sorted = ids[allocs][by_id]
    where = np.minimum(np.searchsorted(ids_sorted, ids[frees]), len(ids_sorted) - 1)
    matched = ids_sorted[where] == ids[frees]
    alloc_pos = np.where(matched, allocs[by_id][where], -1)
    late = frees[alloc_pos > frees]
    if len(late) == 0:
        return np.arange(n)
    fix = dict(zip(frees.tolist(), alloc_pos.tolist()))
    moved = set(late.tolist())
    after: dict = {}
    for f in late.tolist():
        after.setdefault(fix[f], []).append(f)
    out = []
    for i in range(n):
        if i not in moved:
            out.append(i)
            out.extend(after.get(i, ()))
    return np.asarray(out, dtype=np.int64)


cdef int set_history(gm_pool* p, events) except -1:
    """Keep the newest `events` alloc/free events (at least; rounded up to a power of two)
    in C rings; 0 turns recording off. Forgets what was recorded."""
    cdef size_t cap = 0
    cdef int i
    cdef bint failed              # C: nothing Python is made under the locks
    if (isinstance(events, bool) or not isinstance(events, int)
            or not 0 <= events <= _MAX_HISTORY):
        from gpumem.errors import InvalidInputError
        raise InvalidInputError(f"history_events must be an int in [0, {_MAX_HISTORY}], "
                                f"got {events!r}")
    if events:
        cap = 1
        while cap < events:
            cap <<= 1
    _lock_all_gil(p)
    p.history_capacity.store(cap)
    _ring_init(&p.history, cap)
    for i in range(GM_NSHARDS):
        _ring_init(&p.shards[i].history, 0)     # front caches start theirs when used
    failed = cap != 0 and p.history.events == NULL
    _unlock_all(p)
    if failed:
        raise MemoryError(f"cannot allocate a history of {cap} events")
    return 0


cdef dict history(gm_pool* p, last):
    """The recorded events, oldest first, as numpy arrays ``t_ns`` (CLOCK_MONOTONIC
    nanoseconds, to the history clock's tick: _pool_clock.pxd), ``op`` (0 alloc, 1 free), ``id``, ``size`` (bytes requested), ``stream``;
    only the newest `last` if given. Events of different threads are ordered by time, each
    free after its allocation."""
    cdef gm_ring* rings[GM_NSHARDS + 1]
    cdef size_t counts[GM_NSHARDS + 1]
    cdef size_t total = 0, k, j, start, n
    cdef gm_event* buf
    cdef unsigned char[::1] dst
    cdef int i
    import numpy as np
    rings[0] = &p.history
    for i in range(GM_NSHARDS):
        rings[i + 1] = &p.shards[i].history
    _lock_all_gil(p)
    for i in range(GM_NSHARDS + 1):
        counts[i] = min(rings[i].count, rings[i].capacity) if rings[i].events != NULL else 0
        total += counts[i]
    buf = <gm_event*>malloc(sizeof(gm_event) * (total + 1))
    if buf != NULL:
        k = 0
        for i in range(GM_NSHARDS + 1):
            n = counts[i]
            start = rings[i].count - n
            for j in range(n):
                buf[k] = rings[i].events[(start + j) & (rings[i].capacity - 1)]
                k += 1
    _unlock_all(p)
    if buf == NULL:
        raise MemoryError("cannot copy the history")
    try:
        raw = np.empty(total, dtype=_event_dtype())
        if total:
            dst = raw.view(np.uint8)
            memcpy(&dst[0], buf, sizeof(gm_event) * total)
    finally:
        free(buf)
    k = 0
    for i in range(GM_NSHARDS + 1):
        # a ring's events are in lock order; a ticker starting or stopping while another
        # thread reads the clock itself can leave a time a few us behind the one before it
        if counts[i] > 1:
            np.maximum.accumulate(raw["t_ns"][k:k + counts[i]], out=raw["t_ns"][k:k + counts[i]])
        k += counts[i]
    ring = np.repeat(np.arange(GM_NSHARDS + 1), [counts[i] for i in range(GM_NSHARDS + 1)])
    order = np.lexsort((np.arange(total), ring, raw["t_ns"]))   # by time, then ring order
    raw = raw[order]
    ops = (raw["size_op"] >> np.uint64(63)).astype(np.uint8)
    sizes = (raw["size_op"] & np.uint64((1 << 63) - 1)).astype(np.int64)
    keep = _allocs_before_frees(ops, raw["id"])
    if last is not None:
        keep = keep[max(0, len(keep) - int(last)):]
    return {"t_ns": raw["t_ns"][keep].astype(np.int64), "op": ops[keep],
            "id": raw["id"][keep].astype(np.int64), "size": sizes[keep],
            "stream": raw["stream"][keep]}
