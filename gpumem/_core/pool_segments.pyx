# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The pool's cold paths over segments: adopting a segment's record, detaching wholly free
segments for release (empty_cache, the OOM ladder, trimming) and restoring them, flushing the
front caches back into the heaps, re-filing idle streams' free blocks, listing handles.

CachingPool (pool.pyx) calls these through this module's capsule table: each runs once per
driver call or per user request, never on the hot path. They follow the pool's lock rules
(pool.pyx): the caller's arguments are converted to C before locking, nothing Python is built
or raised while a lock is held, and a GIL holder takes the locks with ``_lock_gil`` /
``_lock_all_gil`` (never spinning with the GIL). Shared state: only the pool's C structures,
owned by its lock.
"""
from libc.stdint cimport uint64_t
from libc.stdlib cimport malloc, calloc, free

from gpumem._core.pool_layout cimport (
    GM_NCLASSES, GM_NSHARDS, GM_FRONT_BINS, gm_block, gm_heap, gm_pool, gm_segment, gm_shard,
    gm_front_bin)
from gpumem._core._pool_inline cimport (
    _lock_gil, _unlock, _lock_all_gil, _unlock_all, _class_of, _heap_insert, _heap_remove,
    _new_block, _drop_block, _slot, _register_stream, _coalesce_insert, gm_add, gm_sub, gm_ctz64)


cdef void _flush_shard(gm_pool* p, gm_shard* sh) noexcept nogil:
    """Return every block of the shard's bins to the pool's heaps (both locks held)."""
    cdef int i, j
    cdef gm_front_bin* bin
    cdef gm_block* b
    for i in range(GM_FRONT_BINS):
        bin = &sh.bins[i]
        for j in range(bin.count):
            b = bin.blocks[j]
            gm_sub(sh.cached_bytes, b.size)
            gm_sub(sh.cached_blocks, 1)
            gm_sub(p.stats.in_use_bytes, b.size)
            gm_sub(p.stats.active_blocks, 1)
            b.segment.live_blocks -= 1
            _coalesce_insert(p, b, 2 * _slot(p, b.stream) + (0 if b.segment.is_small else 1))
        bin.count = 0
        bin.size = 0


cdef gm_segment* link_new_segment(gm_pool* p, uint64_t handle, size_t base, size_t size,
                                  bint is_small, uint64_t stream, int* hi) noexcept nogil:
    """Lock held: a new segment record whose one free block spans it, linked into the pool and
    counted as reserved and wholly free but in no heap yet; *hi is the heap it belongs to.
    NULL when host memory for the records runs out (nothing changed then)."""
    cdef gm_segment* seg = <gm_segment*>calloc(1, sizeof(gm_segment))
    cdef gm_block* b
    cdef int k
    if seg == NULL:
        return NULL
    k = _register_stream(p, stream)
    b = _new_block(p) if k >= 0 else NULL
    if b == NULL:
        free(seg)
        return NULL
    seg.handle = handle
    seg.base = base
    seg.size = size
    seg.is_small = is_small
    seg.stream = stream
    seg.first = b
    seg.next = p.segments
    if p.segments != NULL:
        p.segments.prev = seg
    p.segments = seg
    b.segment = seg
    b.offset = 0
    b.size = size
    b.stream = stream
    gm_add(p.stats.reserved_bytes, size)
    gm_add(p.stats.num_segments, 1)
    gm_add(p.stats.whole_free_bytes, size)      # _carve takes it off again when carved
    hi[0] = 2 * k + (0 if is_small else 1)
    return seg


cdef void detach_segment(gm_pool* p, gm_segment* seg, segdesc* desc) noexcept nogil:
    """Unlink a segment without live blocks (lock held: free and unmapped ones), drop its
    blocks; describe it in *desc. Its
    stream is the one whose heap held the free block (the last stream to use the bytes), so
    restore_segment puts it back where it is safe, not under the stream that created it."""
    cdef gm_block* b = seg.first
    cdef gm_block* nxt
    if desc != NULL:
        desc.handle = seg.handle
        desc.base = seg.base
        desc.size = seg.size
        desc.is_small = seg.is_small
        desc.stream = b.stream
    if b.next == NULL and b.heap_index >= 0:
        gm_sub(p.stats.whole_free_bytes, seg.size)
    while b != NULL:
        nxt = b.next
        if b.heap_index >= 0:             # not an unmapped block (expandable segments)
            _heap_remove(p.heaps[b.heap_index], b)
        _drop_block(p, b)
        b = nxt
    if seg.prev != NULL:
        seg.prev.next = seg.next
    else:
        p.segments = seg.next
    if seg.next != NULL:
        seg.next.prev = seg.prev
    gm_sub(p.stats.reserved_bytes, seg.size - seg.unmapped)
    gm_sub(p.stats.num_segments, 1)
    gm_add(p.stats.segments_released, 1)
    free(seg)


cdef size_t _count_free_segments(gm_pool* p) noexcept nogil:
    """Segments without a live block (lock held): a bound on what one release can detach."""
    cdef gm_segment* s = p.segments
    cdef size_t n = 0
    while s != NULL:
        n += s.live_blocks == 0
        s = s.next
    return n


cdef list _desc_list(const segdesc* d, size_t n):
    """The detached segments as Python tuples (built after unlocking)."""
    cdef size_t i
    return [(d[i].handle, d[i].base, d[i].size, bool(d[i].is_small), d[i].stream)
            for i in range(n)]


cdef list streams_with_free(gm_pool* p, uint64_t stream):
    """Streams other than `stream` that hold cached free blocks."""
    cdef uint64_t* found
    cdef int k, n = 0
    _lock_gil(p)
    found = <uint64_t*>malloc(sizeof(uint64_t) * (p.nheaps // 2 + 1))
    if found != NULL:
        for k in range(p.nheaps // 2):
            if (p.heaps[2 * k].stream != stream
                    and p.heaps[2 * k].free_blocks + p.heaps[2 * k + 1].free_blocks):
                found[n] = p.heaps[2 * k].stream
                n += 1
    _unlock(p)
    if found == NULL:
        raise MemoryError("cannot list the streams")
    try:
        return [found[k] for k in range(n)]
    finally:
        free(found)


cdef size_t reclaim_idle(gm_pool* p, idle_streams, uint64_t into) except? 0:
    """Re-file every free block of `idle_streams` under stream `into`, merging neighbours.

    The caller has checked with the backend that each of those streams has no pending
    work, so their cached blocks are safe for `into`. Returns the bytes re-filed.
    """
    cdef gm_heap* h
    cdef gm_block* b
    cdef int k, kin, part, c
    cdef size_t i, nids
    cdef size_t moved = 0
    cdef uint64_t* ids
    idle = [int(sid) for sid in idle_streams]      # converted before locking
    nids = len(idle)
    ids = <uint64_t*>malloc(sizeof(uint64_t) * (nids + 1))
    if ids == NULL:
        raise MemoryError("cannot copy the stream list")
    try:
        for i in range(nids):
            ids[i] = idle[i]
        _lock_gil(p)
        kin = _register_stream(p, into)
        if kin >= 0:
            for i in range(nids):
                k = _slot(p, ids[i])
                if k < 0 or k == kin:
                    continue
                for part in range(2):
                    h = p.heaps[2 * k + part]
                    while h.top:
                        c = (gm_ctz64(h.top) << 6) + gm_ctz64(h.words[gm_ctz64(h.top)])
                        b = h.heads[c]
                        _heap_remove(h, b)
                        if b.offset == 0 and b.next == NULL:
                            gm_sub(p.stats.whole_free_bytes, b.segment.size)
                        b.stream = into
                        moved += b.size
                        _coalesce_insert(p, b, 2 * kin + part)
            p.last_slot = kin
        _unlock(p)
    finally:
        free(ids)
    if kin < 0:
        raise MemoryError("cannot allocate heaps for a new stream")
    return moved


cdef list release_free_segments(gm_pool* p, size_t max_bytes, int small):
    """Detach wholly free segments, largest first, until max_bytes have been released;
    only those of the small pool (small=1) or of the large pool (small=0) if asked.

    Returns ``[(handle, base, size, is_small, stream), ...]``; the caller returns each to the
    backend, or hands it back with :meth:`restore_segment` if the backend refuses.
    """
    cdef gm_segment* s
    cdef gm_segment* best
    cdef size_t released = 0, n = 0
    cdef segdesc* out
    cdef int i
    _lock_all_gil(p)
    for i in range(GM_NSHARDS):       # what the front caches hold can be released too
        _flush_shard(p, &p.shards[i])
    out = <segdesc*>malloc(sizeof(segdesc) * (_count_free_segments(p) + 1))
    while out != NULL and released < max_bytes:
        best = NULL
        s = p.segments
        while s != NULL:
            if (s.live_blocks == 0 and (small < 0 or (s.is_small != 0) == (small != 0))
                    and (best == NULL or s.size > best.size)):
                best = s
            s = s.next
        if best == NULL:
            break
        released += best.size - best.unmapped
        detach_segment(p, best, &out[n])
        n += 1
    _unlock_all(p)
    if out == NULL:
        raise MemoryError("cannot list the segments to release")
    try:
        return _desc_list(out, n)
    finally:
        free(out)

cdef list excess_free_segments(gm_pool* p, size_t per_class):
    """Detach wholly free large-pool segments beyond `per_class` of one size class (the
    newest of each class are kept). Same return value as release_free_segments."""
    cdef gm_segment* s
    cdef gm_segment* nxt
    cdef size_t* seen = <size_t*>calloc(GM_NCLASSES, sizeof(size_t))
    cdef segdesc* out = NULL
    cdef size_t n = 0
    cdef int c
    if seen == NULL:
        raise MemoryError("cannot count the segments per class")
    _lock_all_gil(p)
    for c in range(GM_NSHARDS):
        _flush_shard(p, &p.shards[c])
    out = <segdesc*>malloc(sizeof(segdesc) * (_count_free_segments(p) + 1))
    s = p.segments if out != NULL else NULL       # newest first
    while s != NULL:
        nxt = s.next
        if s.live_blocks == 0 and not s.is_small:
            c = _class_of(s.size)
            seen[c] += 1
            if seen[c] > per_class:
                detach_segment(p, s, &out[n])
                n += 1
        s = nxt
    _unlock_all(p)
    free(seen)
    if out == NULL:
        raise MemoryError("cannot list the segments to release")
    try:
        return _desc_list(out, n)
    finally:
        free(out)

cdef size_t flush_front_caches(gm_pool* p) noexcept:
    """Return the blocks of every thread's front cache to the pool (merging them with
    their neighbours); the bytes returned. release_free_segments does this first."""
    cdef size_t before = 0
    cdef int i
    _lock_all_gil(p)
    for i in range(GM_NSHARDS):
        before += p.shards[i].cached_bytes.load()
        _flush_shard(p, &p.shards[i])
    _unlock_all(p)
    return before


cdef int restore_segment(gm_pool* p, uint64_t handle, size_t base, size_t size, bint is_small,
                         uint64_t stream) except -1:
    """Put back a segment detached by release_free_segments (the backend kept it)."""
    cdef gm_segment* seg
    cdef int hi
    _lock_gil(p)
    seg = link_new_segment(p, handle, base, size, is_small, stream, &hi)
    if seg != NULL:
        _heap_insert(p.heaps[hi], seg.first, hi)
        gm_sub(p.stats.segments_released, 1)
    _unlock(p)
    if seg == NULL:
        raise MemoryError("cannot allocate a segment record")
    return 0


cdef list live_segment_handles(gm_pool* p):
    """Handles of every segment (for close(): all are returned to the backend)."""
    cdef gm_segment* s
    cdef uint64_t* handles
    cdef size_t i, n = 0
    _lock_gil(p)
    handles = <uint64_t*>malloc(sizeof(uint64_t) * (p.stats.num_segments.load() + 1))
    s = p.segments if handles != NULL else NULL
    while s != NULL:
        handles[n] = s.handle
        n += 1
        s = s.next
    _unlock(p)
    if handles == NULL:
        raise MemoryError("cannot list the segments")
    try:
        return [handles[i] for i in range(n)]
    finally:
        free(handles)


cdef void destroy_pool(gm_pool* p) noexcept nogil:
    """Free the pool structure and every C record it owns (its segments' device memory is the
    manager's to return). No lock: called from CachingPool.__dealloc__, the last reference."""
    cdef gm_segment* s
    cdef gm_segment* nxt
    cdef int i
    s = p.segments
    while s != NULL:
        nxt = s.next
        free(s)
        s = nxt
    for i in range(p.nchunks):
        free(p.chunks[i])
    free(p.chunks)
    for i in range(p.nheaps):
        free(p.heaps[i])
    free(p.heaps)
    free(p.history.events)
    if p.shards != NULL:
        for i in range(GM_NSHARDS):
            free(p.shards[i].history.events)
    free(p.shards)
    free(p)
