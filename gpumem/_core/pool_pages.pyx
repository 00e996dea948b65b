# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The pool's unmapped state, for expandable segments (gpumem/manager/expandable.py).

An expandable segment is a reserved address range whose pages the manager maps and unmaps. A
block whose pages are unmapped has ``heap_index == GM_UNMAPPED``: it is in no heap, not live,
not counted as reserved (``reserved = size - unmapped`` per segment) and merges only with
unmapped neighbours; a free block never merges across it. Three operations change it:

- ``carve_free_pages``: the whole mappings (physical handles; by default one page each)
  inside free blocks become unmapped blocks (the caller then unmaps them: after a trim they
  go back to the driver, after a stitch they move);
- ``fill_unmapped``: an unmapped range (or a range just past the segment's end) becomes a free
  block of a stream's heap, merged with its free neighbours (the caller has mapped it);
- ``plan_fill``: where mapping the fewest pages lets a request fit (into a hole between free
  neighbours, or at the growing end).

The pool never calls the driver: these run under the pool's C lock (taken with ``_lock_gil``,
caller holds the GIL), create no Python object while it is held and build their result after
unlocking. Shared state: only the pool's C structures, owned by its lock.
"""
from libc.stdint cimport uint64_t, SIZE_MAX
from libc.stdlib cimport malloc, free

from gpumem._core.pool_layout cimport GM_UNMAPPED, gm_block, gm_pool, gm_segment
from gpumem._core._pool_inline cimport (
    _lock_gil, _unlock, _heap_insert, _heap_remove, _new_block, _drop_block, _slot,
    _coalesce_insert, _find_segment, _last_block, _round_size, _round_up, gm_add, gm_sub, gm_max)


cdef inline void _mark_unmapped(gm_block* b) noexcept nogil:
    b.heap_index = GM_UNMAPPED
    b.serial = 0
    b.requested = 0
    b.stream = 0
    b.free_prev = NULL
    b.free_next = NULL


cdef inline void _link_after(gm_block* a, gm_block* b) noexcept nogil:
    """Put b (a fresh struct) right after a in a's segment."""
    b.segment = a.segment
    b.prev = a
    b.next = a.next
    if a.next != NULL:
        a.next.prev = b
    a.next = b


cdef inline void _unlink_merged(gm_pool* p, gm_block* keep, gm_block* gone) noexcept nogil:
    """keep absorbs its next neighbour gone (both unmapped)."""
    keep.size += gone.size
    keep.next = gone.next
    if gone.next != NULL:
        gone.next.prev = keep
    _drop_block(p, gone)


cdef gm_block* _carve_block(gm_pool* p, gm_block* b, size_t lo, size_t n) noexcept nogil:
    """Lock held: make [lo, lo + n) of the free block b (whole pages) an unmapped block; the
    free rest stays in b's heap. Returns the block that now ends where b ended (to go on
    walking from), or NULL when no block struct could be had (nothing changed)."""
    cdef gm_segment* seg = b.segment
    cdef int hi = b.heap_index
    cdef size_t end = b.offset + b.size
    cdef gm_block* u = NULL
    cdef gm_block* r = NULL
    if lo + n < end:
        r = _new_block(p)
        if r == NULL:
            return NULL
    if lo > b.offset:
        u = _new_block(p)
        if u == NULL:
            if r != NULL:
                _drop_block(p, r)
            return NULL
    _heap_remove(p.heaps[hi], b)
    if b.offset == 0 and b.next == NULL:
        gm_sub(p.stats.whole_free_bytes, seg.size)
    if u != NULL:                     # b keeps the free part before the pages
        _link_after(b, u)
        u.offset = lo
        b.size = lo - b.offset
        _heap_insert(p.heaps[hi], b, hi)
    else:
        u = b
    u.size = n
    _mark_unmapped(u)
    if r != NULL:                     # the free part after them
        _link_after(u, r)
        r.offset = lo + n
        r.size = end - lo - n
        r.stream = p.heaps[hi].stream
        _heap_insert(p.heaps[hi], r, hi)
    else:
        if u.next != NULL and u.next.heap_index == GM_UNMAPPED:
            _unlink_merged(p, u, u.next)
    if u.prev != NULL and u.prev.heap_index == GM_UNMAPPED:
        u = u.prev
        _unlink_merged(p, u, u.next)
    seg.unmapped += n
    gm_sub(p.stats.reserved_bytes, n)
    return r if r != NULL else u


cdef void _drop_unmapped_tail(gm_pool* p, gm_segment* seg) noexcept nogil:
    """An unmapped last block is cut off (the segment's span shrinks back; growth there maps
    at the end again), unless it is the segment's only block."""
    cdef gm_block* last = _last_block(seg)
    if last.heap_index != GM_UNMAPPED or last.prev == NULL:
        return
    seg.size -= last.size
    seg.unmapped -= last.size
    last.prev.next = NULL
    if last.prev.offset == 0 and last.prev.heap_index >= 0:
        gm_add(p.stats.whole_free_bytes, seg.size)       # one free block again
    _drop_block(p, last)


cdef inline size_t _unit_at_or_above(const unsigned long long* bd, size_t nb, size_t page,
                                     size_t x) noexcept nogil:
    """The smallest mapping boundary >= x (SIZE_MAX if none); every page when bd is NULL."""
    cdef size_t lo = 0, hi = nb, mid
    if bd == NULL:
        return _round_up(x, page)
    while lo < hi:
        mid = (lo + hi) // 2
        if bd[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return <size_t>bd[lo] if lo < nb else SIZE_MAX


cdef inline size_t _unit_at_or_below(const unsigned long long* bd, size_t nb, size_t page,
                                     size_t x) noexcept nogil:
    """The largest mapping boundary <= x (SIZE_MAX if none); every page when bd is NULL."""
    cdef size_t lo = 0, hi = nb, mid
    if bd == NULL:
        return x // page * page
    while lo < hi:
        mid = (lo + hi) // 2
        if bd[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return <size_t>bd[lo - 1] if lo > 0 else SIZE_MAX


cdef list carve_free_pages(gm_pool* p, uint64_t handle, size_t page, const unsigned long long* bd,
                           size_t nb, size_t max_bytes, int any_stream, uint64_t stream,
                           size_t keep_lo, size_t keep_hi, size_t min_offset, double ratio,
                           bint overshoot):
    """Turn up to ``max_bytes`` of whole mappings inside free blocks of segment ``handle`` into
    unmapped blocks: blocks of any heap (any_stream, after the device was synchronized) or of
    ``stream``'s large heap only; not from a block that overlaps [keep_lo, keep_hi) (the
    neighbours a planned fill needs) nor below ``min_offset``. A mapping is one physical
    handle, which the driver maps and unmaps whole: ``bd[0:nb]`` (ascending) are the offsets
    where mappings start and end (NULL: every page is its own mapping). With ``overshoot`` the
    last mapping taken may pass ``max_bytes`` (a trim that must return at least that much, a
    growth at a segment's end that can use the surplus); without it the mappings taken fit.
    A trim (ratio -1) takes the highest mappings first, a stitch the lowest. A block gives its
    mappings from its aligned end (its highest when both or neither end is aligned).
    ``ratio``: -1 every block gives its mappings (a trim); 0 only blocks with an aligned end
    (taking their mappings splits no free block); k > 0 those too, and a block whose whole
    mappings are at least k times the free bytes that would stay behind stranded around them.
    Returns ``[(offset, size), ...]`` of the ranges now unmapped (each a run of whole
    mappings), which the caller unmaps at the driver (or fills back)."""
    cdef gm_segment* seg
    cdef gm_block* b
    cdef gm_block* nxt
    cdef size_t* out = NULL
    cdef size_t n = 0, nblocks = 0, taken = 0, lo, top, take, start, i, r, cut, whole
    cdef bint low_end, from_top
    cdef int k, want = -1
    _lock_gil(p)
    seg = _find_segment(p, handle)
    k = _slot(p, stream)
    if seg != NULL and not seg.is_small and page and (any_stream or k >= 0):
        if not any_stream:
            want = 2 * k + 1
        b = seg.first
        while b != NULL:
            nblocks += 1
            b = b.next
        out = <size_t*>malloc(sizeof(size_t) * 2 * (nblocks + 1))
        # a trim walks down from the top: the span shrinks back first and the low free pages
        # stay cached (measured: resnet50_train 1.030 -> 1.022, no trace worse); a stitch
        # walks up
        from_top = ratio < 0
        b = (_last_block(seg) if from_top else seg.first) if out != NULL else NULL
        while b != NULL and taken < max_bytes:
            # walking down, b.prev survives a carve of b (merged into, at worst)
            nxt = b.prev if from_top else b.next
            if (b.heap_index >= 0 and (want < 0 or b.heap_index == want)
                    and not (b.offset < keep_hi and b.offset + b.size > keep_lo)):
                lo = _unit_at_or_above(bd, nb, page, b.offset if b.offset > min_offset
                                       else min_offset)
                top = _unit_at_or_below(bd, nb, page, b.offset + b.size)
                whole = top - lo if top != SIZE_MAX and lo != SIZE_MAX and top > lo else 0
                low_end = not top == b.offset + b.size and lo == b.offset
                # an aligned end gives mappings without splitting the block; otherwise they
                # must be worth `ratio` times the free bytes they leave stranded
                if whole and (ratio < 0 or top == b.offset + b.size or low_end
                              or (ratio > 0 and <double>whole >= ratio * <double>(b.size - whole))):
                    r = max_bytes - taken
                    if r >= whole:
                        start, take = lo, whole
                    elif low_end:         # from the low end: [lo, cut)
                        cut = (_unit_at_or_above(bd, nb, page, lo + r) if overshoot
                               else _unit_at_or_below(bd, nb, page, lo + r))
                        start, take = lo, cut - lo
                    else:                 # from the top: [cut, top)
                        cut = (_unit_at_or_below(bd, nb, page, top - r) if overshoot
                               else _unit_at_or_above(bd, nb, page, top - r))
                        start, take = cut, top - cut
                    if take:
                        # from an aligned end: the free rest stays one piece
                        b = _carve_block(p, b, start, take)
                        if b == NULL:
                            break
                        out[2 * n] = start
                        out[2 * n + 1] = take
                        n += 1
                        taken += take
                        if not from_top:
                            nxt = b.next
            b = nxt
        if n:
            _drop_unmapped_tail(p, seg)
    _unlock(p)
    try:
        return [(out[2 * i], out[2 * i + 1]) for i in range(n)]
    finally:
        free(out)


cdef int fill_unmapped(gm_pool* p, uint64_t handle, size_t offset, size_t size,
                       uint64_t stream) except -1:
    """[offset, offset + size) of segment ``handle`` (inside one unmapped block, or at or past
    the segment's end: it grows, any gap before the range unmapped) is mapped now: make it a free block of ``stream``'s heap,
    merged with free neighbours there. Returns 0, or 1 when nothing changed (unknown segment
    or stream, a range that is not unmapped, unaligned, or no block struct)."""
    cdef gm_segment* seg
    cdef gm_block* u
    cdef gm_block* f = NULL
    cdef gm_block* r = NULL
    cdef gm_block* g = NULL
    cdef size_t uend, gap
    cdef int k, hi, rc = 1
    _lock_gil(p)
    seg = _find_segment(p, handle)
    k = _slot(p, stream)
    if (seg != NULL and k >= 0 and size and not size % p.cfg.granularity
            and not offset % p.cfg.granularity):
        hi = 2 * k + (0 if seg.is_small else 1)
        if offset >= seg.size:
            # past the span: pages carved off its end come back (a rollback), not always the
            # first of them first; the gap between the span and them stays unmapped
            gap = offset - seg.size
            u = _last_block(seg)
            f = _new_block(p)
            if gap and u.heap_index != GM_UNMAPPED and f != NULL:
                g = _new_block(p)
                if g == NULL:
                    _drop_block(p, f)
                    f = NULL
            if f != NULL:
                if u.offset == 0 and u.heap_index >= 0:
                    gm_sub(p.stats.whole_free_bytes, seg.size)   # one free block no longer
                if g != NULL:
                    _link_after(u, g)
                    _mark_unmapped(g)
                    g.offset = seg.size
                    g.size = gap
                    u = g
                elif gap:
                    u.size += gap             # the only block, unmapped: the gap joins it
                _link_after(u, f)
                f.offset = offset
                seg.size += gap + size
                seg.unmapped += gap + size    # size taken off again below
                gm_add(p.stats.reserved_bytes, size)
                rc = 0
        else:
            u = seg.first
            while u != NULL and u.offset + u.size <= offset:
                u = u.next
            if u != NULL and u.heap_index == GM_UNMAPPED and offset + size <= u.offset + u.size:
                uend = u.offset + u.size
                rc = 0                        # unless a block struct cannot be had
                if offset + size < uend:
                    r = _new_block(p)
                    rc = r == NULL
                if rc == 0 and offset > u.offset:
                    f = _new_block(p)
                    if f == NULL:
                        if r != NULL:
                            _drop_block(p, r)
                        rc = 1
                elif rc == 0:
                    f = u
                if rc == 0:
                    if f != u:
                        _link_after(u, f)
                        f.offset = offset
                        u.size = offset - u.offset
                    if r != NULL:
                        _link_after(f, r)
                        r.offset = offset + size
                        r.size = uend - offset - size
                        _mark_unmapped(r)
                    gm_add(p.stats.reserved_bytes, size)
        if rc == 0:
            seg.unmapped -= size
            f.size = size
            f.stream = stream
            f.serial = 0
            f.requested = 0
            f.heap_index = -1
            gm_max(p.stats.peak_reserved_bytes, p.stats.reserved_bytes.load())
            _coalesce_insert(p, f, hi)
            # a fill into a hole that ended the segment leaves an unmapped tail: cut it, as a
            # carve does, so no segment ends in a hole (an end growth planned past such a tail
            # was mapped past the span once a carve cut it)
            _drop_unmapped_tail(p, seg)
    _unlock(p)
    return rc


cdef tuple plan_fill(gm_pool* p, uint64_t handle, uint64_t stream, size_t nbytes, size_t page,
                     size_t reservation):
    """Where in segment ``handle`` mapping the fewest pages gives ``stream`` a free block for
    ``nbytes``: into an unmapped hole, joined with its free neighbours, or at the end (joined
    with a free tail; the span stays within ``reservation`` bytes). Returns ``(offset, bytes to
    map, keep_lo, keep_hi, at_end)`` (the free neighbours the fill joins lie in [keep_lo,
    keep_hi): pages must not be taken from them), or None. Ties go to a hole (the address range
    does not grow)."""
    cdef gm_segment* seg
    cdef gm_block* b
    cdef gm_block* last = NULL
    cdef size_t s = _round_size(p, nbytes)
    cdef size_t f1, f2, m, best = SIZE_MAX, at = 0, klo = 0, khi = 0, tail
    cdef int k, hi
    cdef bint at_end = False
    _lock_gil(p)
    seg = _find_segment(p, handle)
    k = _slot(p, stream)
    if seg != NULL and k >= 0 and page:
        hi = 2 * k + (0 if seg.is_small else 1)
        b = seg.first
        while b != NULL:
            if b.heap_index == GM_UNMAPPED:
                f1 = b.prev.size if b.prev != NULL and b.prev.heap_index == hi else 0
                f2 = b.next.size if b.next != NULL and b.next.heap_index == hi else 0
                if f1 + b.size >= s:            # the hole's first pages, after f1
                    m = _round_up(s - f1, page) if s > f1 else 0
                    if m < best:
                        best = m
                        at = b.offset
                        klo = b.offset - f1
                        khi = b.offset + m
                if f2 + b.size >= s:            # its last pages, before f2
                    m = _round_up(s - f2, page) if s > f2 else 0
                    if m < best:
                        best = m
                        at = b.offset + b.size - m
                        klo = at
                        khi = b.offset + b.size + f2
                if f1 + b.size + f2 >= s and b.size < best:   # all of it, joining both
                    best = b.size
                    at = b.offset
                    klo = b.offset - f1
                    khi = b.offset + b.size + f2
            last = b
            b = b.next
        tail = last.size if last.heap_index == hi else 0
        m = _round_up(s - tail, page) if s > tail else 0
        if seg.size + m <= reservation and m < best:
            at_end = True
            best = m
            at = seg.size
            # keep the whole last block (its free part is the tail the fill joins): even a
            # live one, which a free on another thread may turn into a free tail before the
            # caller stitches; carving it would cut the segment's end back below `at`
            klo = last.offset
            khi = SIZE_MAX
    _unlock(p)
    if best == SIZE_MAX:
        return None
    return (at, best, klo, khi, at_end)


cdef size_t free_page_bytes(gm_pool* p, uint64_t handle, size_t page, const unsigned long long* bd,
                            size_t nb) except? 0:
    """Bytes of whole mappings (``bd`` as in carve_free_pages) inside the free blocks of
    segment ``handle`` (what a trim could unmap now)."""
    cdef gm_segment* seg
    cdef gm_block* b
    cdef size_t total = 0, lo, top
    _lock_gil(p)
    seg = _find_segment(p, handle)
    if seg != NULL and page:
        b = seg.first
        while b != NULL:
            if b.heap_index >= 0:
                lo = _unit_at_or_above(bd, nb, page, b.offset)
                top = _unit_at_or_below(bd, nb, page, b.offset + b.size)
                if top != SIZE_MAX and lo != SIZE_MAX and top > lo:
                    total += top - lo
            b = b.next
    _unlock(p)
    return total
