# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The pool's introspection: counters with the front caches folded in, the largest free block,
the segment table for snapshots, and the invariant walker behind ``check_invariants``.

CachingPool (pool.pyx) calls these through this module's capsule table; none is on the hot
path. They follow the pool's lock rules (pool.pyx): what they report is copied into C records
under the locks (taken with ``_lock_all_gil``: a GIL holder never spins) and turned into Python
objects, or errors, only after unlocking. Lock-free reads (``counters(consistent=False)``,
``in_use_bytes``) load the std::atomic counters only. Shared state: only the pool's C
structures, owned by its lock.
"""
from libc.stdint cimport uint64_t
from libc.stdlib cimport malloc, free

from gpumem._core.pool_layout cimport (
    GM_NCLASSES, GM_NWORDS, GM_NSHARDS, GM_FRONT_BINS, GM_UNMAPPED, gm_block, gm_heap, gm_pool, gm_segment,
    gm_stats, gm_front_bin)
from gpumem._core._pool_inline cimport (_lock_all_gil, _unlock_all, _class_of, _class_floor,
                                        gm_clz64)

from gpumem.stats import StatsDict

# ---------------------------------------------------------------------------------------------
# introspection: copied out under the lock into these C records, turned into Python after it
ctypedef struct _segrow:
    uint64_t handle
    size_t base
    size_t size
    int is_small
    uint64_t stream
    size_t first_row                 # its blocks are rows first_row .. first_row+nblocks-1
    size_t nblocks

ctypedef struct _blockrow:
    size_t offset
    size_t size
    size_t requested
    int state                        # index into _STATES
    uint64_t stream
    uint64_t serial

cdef enum:
    _NCOUNTERS = 14

_COUNTER_NAMES = ("reserved_bytes", "in_use_bytes", "requested_bytes", "peak_in_use_bytes",
                  "peak_reserved_bytes", "active_blocks", "num_segments", "num_allocs",
                  "num_frees", "pool_hits", "pool_misses", "segments_created",
                  "segments_released", "whole_free_bytes")


class PoolCounters(StatsDict):
    """``CachingPool.counters()``: the vocabulary of gpumem.stats; the names used before
    still read, with a DeprecationWarning."""
    what = "CachingPool.counters()"
    renamed = {"hits": "pool_hits", "misses": "pool_misses"}

cdef void _read_counters(gm_pool* p, size_t* v) noexcept nogil:
    """The counters in _COUNTER_NAMES order, front caches folded in: the pool counts a block in
    a front cache as in use, the user does not. The pool's counters are read before the
    shards', so a block moving meanwhile can only make in_use look higher, never negative."""
    cdef gm_stats* st = &p.stats
    cdef size_t fbytes = 0, fblocks = 0, freq = 0, fallocs = 0, ffrees = 0
    cdef int i
    v[0] = st.reserved_bytes.load()
    v[1] = st.in_use_bytes.load()
    v[2] = st.requested_bytes.load()
    v[3] = st.peak_in_use_bytes.load()
    v[4] = st.peak_reserved_bytes.load()
    v[5] = st.active_blocks.load()
    v[6] = st.num_segments.load()
    v[7] = st.num_allocs.load()
    v[8] = st.num_frees.load()
    v[9] = st.hits.load()
    v[10] = st.misses.load()
    v[11] = st.segments_created.load()
    v[12] = st.segments_released.load()
    v[13] = st.whole_free_bytes.load()
    for i in range(GM_NSHARDS):
        fbytes += p.shards[i].cached_bytes.load()
        fblocks += p.shards[i].cached_blocks.load()
        freq += p.shards[i].requested_delta.load()
        fallocs += p.shards[i].allocs.load()
        ffrees += p.shards[i].frees.load()
    v[1] = v[1] - fbytes if v[1] > fbytes else 0
    v[2] = v[2] + freq if <long long>(v[2] + freq) > 0 else 0
    v[5] = v[5] - fblocks if v[5] > fblocks else 0
    v[7] += fallocs
    v[8] += ffrees
    v[9] += fallocs



cdef size_t _largest_free(gm_pool* p) noexcept nogil:
    """The biggest free block (all locks held): the highest non-empty class of each heap, and
    the blocks in front caches."""
    cdef gm_heap* h
    cdef gm_block* b
    cdef size_t best = 0
    cdef int i, w, c, j
    for i in range(GM_NSHARDS):
        for c in range(GM_FRONT_BINS):
            for j in range(p.shards[i].bins[c].count):
                best = max(best, p.shards[i].bins[c].blocks[j].size)
    for i in range(p.nheaps):
        h = p.heaps[i]
        if h.top == 0:
            continue
        w = 63 - gm_clz64(h.top)
        c = (w << 6) + 63 - gm_clz64(h.words[w])
        b = h.heads[c]
        while b != NULL:          # one class: sizes within 1/32 of each other
            if b.size > best:
                best = b.size
            b = b.free_next
    return best


# Findings of check_invariants: a code and up to three numbers each; the text is formatted after
# unlocking. Codes index _FINDINGS.
cdef enum:
    _MAX_FINDINGS = 64

ctypedef struct _finding:
    int code
    size_t a, b, c

ctypedef struct _findings:
    _finding items[_MAX_FINDINGS]
    size_t n                          # recorded
    size_t total                      # found (the rest are only counted)

_FINDINGS = (
    "segment {0:#x}: bad first block",                                          # 0
    "segment {0:#x}: block at {1} points elsewhere",                            # 1
    "segment {0:#x}: gap or overlap at offset {1} (block starts at {2})",       # 2
    "segment {0:#x}: block size {1} not a positive multiple of the granularity",  # 3
    "segment {0:#x}: broken prev link at {1}",                                  # 4
    "segment {0:#x}: live block without serial at {1}",                         # 5
    "free block at {0} keeps a serial",                                         # 6
    "free block at {0} in the heap of another stream",                          # 7
    "free block at {0} in the wrong pool's heap",                               # 8
    "free block at {0} filed under a wrong class",                              # 9
    "segment {0:#x}: adjacent free blocks at {1} and {2} left unmerged",        # 10
    "block at {0} has a bad heap index {1}",                                    # 11
    "segment {0:#x}: blocks cover {1} of {2} bytes",                            # 12
    "segment {0:#x}: live_blocks {1} but {2} live blocks",                      # 13
    "heap {0}: bitmap disagrees with list of class {1}",                        # 14
    "heap {0}: head of class {1} has a predecessor",                            # 15
    "heap {0}: class {1} lists a block that is not its own",                    # 16
    "heap {0}: block of {1} below class {2}'s floor",                           # 17
    "heap {0}: top bitmap disagrees with word {1}",                             # 18
    "heap {0}: free_bytes {1} but recount {2}",                                 # 19
    "heap {0}: free_blocks {1} but recount {2}",                                # 20
    "{0} free blocks in segments but {1} listed",                               # 21
    "counter " + _COUNTER_NAMES[0] + " is {0} but a recount gives {1}",         # 22
    "counter " + _COUNTER_NAMES[1] + " is {0} but a recount gives {1}",         # 23
    "counter " + _COUNTER_NAMES[2] + " is {0} but a recount gives {1}",         # 24
    "counter active_blocks is {0} but a recount gives {1}",                     # 25
    "counter num_segments is {0} but a recount gives {1}",                      # 26
    "counter whole_free_bytes is {0} but a recount gives {1}",                  # 27
    "num_allocs - num_frees is {0} but there are {1} live blocks",              # 28
    "front cache {0}, bin {1}: block at {2} is not a cached block of the bin",  # 29
    "front cache {0}: cached_bytes {1} but a recount gives {2}",                # 30
    "{0} carved blocks without a serial but {1} in front caches",               # 31
    "counter in_use_bytes (front caches in) is {0} but a recount gives {1}",    # 32
    "segment {0:#x}: unmapped block at {1} keeps a serial or is in the small pool",  # 33
    "segment {0:#x}: adjacent unmapped blocks at {1} and {2} left unmerged",    # 34
    "segment {0:#x}: unmapped {1} but a recount gives {2}",                     # 35
)

cdef inline void _note(_findings* f, int code, size_t a=0, size_t b=0,
                       size_t c=0) noexcept nogil:
    if f.n < _MAX_FINDINGS:
        f.items[f.n].code = code
        f.items[f.n].a = a
        f.items[f.n].b = b
        f.items[f.n].c = c
        f.n += 1
    f.total += 1

cdef void _walk_invariants(gm_pool* p, _findings* f) noexcept nogil:
    """check_invariants' walk (lock held): every finding goes to *f, nothing else is touched."""
    cdef gm_segment* s
    cdef gm_block* b
    cdef gm_heap* h
    cdef size_t reserved = 0, in_use = 0, requested = 0, nseg = 0, live = 0, seg_live
    cdef size_t list_free_blocks = 0, free_blocks = 0
    cdef size_t hbytes, hcount, offset, whole_free = 0, unmapped
    cdef size_t fronted = 0, fronted_bytes = 0, binned = 0, binned_bytes = 0
    cdef size_t v[_NCOUNTERS]
    cdef int i, c, j
    cdef bint nonempty
    cdef gm_stats* st = &p.stats
    cdef gm_front_bin* bin
    s = p.segments
    while s != NULL:
        nseg += 1
        offset = 0
        unmapped = 0
        seg_live = 0
        b = s.first
        if b == NULL or b.prev != NULL:
            _note(f, 0, s.handle)
        while b != NULL:
            if b.segment != s:
                _note(f, 1, s.handle, b.offset)
            if b.offset != offset:
                _note(f, 2, s.handle, offset, b.offset)
            if b.size == 0 or b.size % p.cfg.granularity:
                _note(f, 3, s.handle, b.size)
            if b.next != NULL and b.next.prev != b:
                _note(f, 4, s.handle, b.next.offset)
            offset = b.offset + b.size
            if b.heap_index == -1:
                seg_live += 1         # live, or in a front cache (serial 0): out of the heaps
                if b.serial != 0:
                    in_use += b.size
                    requested += b.requested
                else:
                    fronted += 1
                    fronted_bytes += b.size
            elif b.heap_index >= 0 and b.heap_index < p.nheaps:
                free_blocks += 1
                if b.serial != 0:
                    _note(f, 6, b.offset)
                if p.heaps[b.heap_index].stream != b.stream:
                    _note(f, 7, b.offset)
                if (b.heap_index % 2 == 0) != (s.is_small != 0):
                    _note(f, 8, b.offset)
                if b.size_class != _class_of(b.size):
                    _note(f, 9, b.offset)
                if b.next != NULL and b.next.heap_index == b.heap_index:
                    _note(f, 10, s.handle, b.offset, b.next.offset)
            elif b.heap_index == GM_UNMAPPED:
                unmapped += b.size
                if b.serial != 0 or s.is_small:
                    _note(f, 33, s.handle, b.offset)
                if b.next != NULL and b.next.heap_index == GM_UNMAPPED:
                    _note(f, 34, s.handle, b.offset, b.next.offset)
            else:
                _note(f, 11, b.offset, <size_t>b.heap_index)
            b = b.next
        if unmapped != s.unmapped:
            _note(f, 35, s.handle, s.unmapped, unmapped)
        reserved += s.size - unmapped
        if s.first != NULL and s.first.next == NULL and s.first.heap_index >= 0:
            whole_free += s.size
        if offset != s.size:
            _note(f, 12, s.handle, offset, s.size)
        if seg_live != s.live_blocks:
            _note(f, 13, s.handle, s.live_blocks, seg_live)
        live += seg_live
        s = s.next
    for i in range(p.nheaps):
        h = p.heaps[i]
        hbytes = 0
        hcount = 0
        for c in range(GM_NCLASSES):
            b = h.heads[c]
            nonempty = b != NULL
            if nonempty != ((h.words[c >> 6] & ((<uint64_t>1) << (c & 63))) != 0):
                _note(f, 14, i, c)
            if b != NULL and b.free_prev != NULL:
                _note(f, 15, i, c)
            while b != NULL:
                if b.heap_index != i or b.size_class != c:
                    _note(f, 16, i, c)
                if b.size < _class_floor(c):
                    _note(f, 17, i, b.size, c)
                hbytes += b.size
                hcount += 1
                b = b.free_next
        for c in range(GM_NWORDS):
            if (h.words[c] != 0) != ((h.top & ((<uint64_t>1) << c)) != 0):
                _note(f, 18, i, c)
        if hbytes != h.free_bytes:
            _note(f, 19, i, h.free_bytes, hbytes)
        if hcount != h.free_blocks:
            _note(f, 20, i, h.free_blocks, hcount)
        list_free_blocks += hcount
    if list_free_blocks != free_blocks:
        _note(f, 21, free_blocks, list_free_blocks)
    for i in range(GM_NSHARDS):
        hbytes = 0
        for c in range(GM_FRONT_BINS):
            bin = &p.shards[i].bins[c]
            for j in range(bin.count):
                b = bin.blocks[j]
                if (b.heap_index != -1 or b.serial != 0 or b.stream != bin.stream
                        or b.size < bin.size):
                    _note(f, 29, i, c, b.offset)
                hbytes += b.size
                binned += 1
        if hbytes != p.shards[i].cached_bytes.load():
            _note(f, 30, i, p.shards[i].cached_bytes.load(), hbytes)
        binned_bytes += hbytes
    if binned != fronted or binned_bytes != fronted_bytes:
        _note(f, 31, fronted, binned)
    _read_counters(p, v)                  # the user's view: front-cached blocks are not in use
    if v[0] != reserved:
        _note(f, 22, v[0], reserved)
    if v[1] != in_use:
        _note(f, 23, v[1], in_use)
    if v[2] != requested:
        _note(f, 24, v[2], requested)
    if v[5] != live - fronted:
        _note(f, 25, v[5], live - fronted)
    if v[6] != nseg:
        _note(f, 26, v[6], nseg)
    if v[13] != whole_free:
        _note(f, 27, v[13], whole_free)
    if v[7] - v[8] != live - fronted:
        _note(f, 28, v[7] - v[8], live - fronted)
    if st.in_use_bytes.load() != in_use + binned_bytes:
        _note(f, 32, st.in_use_bytes.load(), in_use + binned_bytes)


cdef object counters(gm_pool* p, bint consistent):
    """Every counter, as the user sees them (blocks in front caches are cached, not in use;
    ``peak_in_use_bytes`` counts them as in use, so it may exceed the true peak by at most
    what the front caches hold). By default read without the locks (each value exact
    unless a block moves between a front cache and the pool meanwhile, the set not one
    moment); with consistent=True copied under the locks, one moment, together with
    ``largest_free_block``. A PoolCounters (a dict), built after unlocking."""
    cdef size_t v[_NCOUNTERS]
    cdef size_t largest = 0
    if consistent:
        _lock_all_gil(p)
        _read_counters(p, v)
        largest = _largest_free(p)
        _unlock_all(p)
    else:
        _read_counters(p, v)
    out = PoolCounters()
    for i, name in enumerate(_COUNTER_NAMES):
        out[name] = v[i]
    out["cached_bytes"] = v[0] - v[1] if v[0] > v[1] else 0
    if consistent:
        out["largest_free_block"] = largest
    return out


cdef size_t in_use_bytes(gm_pool* p) noexcept nogil:
    """Bytes in live blocks (not counting blocks kept in front caches)."""
    cdef size_t v[_NCOUNTERS]
    _read_counters(p, v)
    return v[1]


cdef size_t largest_free_block(gm_pool* p) noexcept:
    """Size of the biggest cached free block (0 if none); shows fragmentation."""
    cdef size_t best
    _lock_all_gil(p)
    best = _largest_free(p)
    _unlock_all(p)
    return best


_STATES = ("free", "allocated", "unmapped")


cdef list segments(gm_pool* p):
    """Every segment with its blocks in address order, as plain dicts (for snapshots). A
    block kept in a front cache is "free" (cached), though not merged with its neighbours."""
    cdef gm_segment* s
    cdef gm_block* b
    cdef _segrow* segs = NULL
    cdef _blockrow* blocks = NULL
    cdef size_t nseg = 0, nblk = 0, i, j = 0, k
    _lock_all_gil(p)
    s = p.segments
    while s != NULL:                  # count, then copy: all in C, under the locks
        nseg += 1
        b = s.first
        while b != NULL:
            nblk += 1
            b = b.next
        s = s.next
    segs = <_segrow*>malloc(sizeof(_segrow) * (nseg + 1))
    blocks = <_blockrow*>malloc(sizeof(_blockrow) * (nblk + 1))
    if segs != NULL and blocks != NULL:
        i = 0
        s = p.segments
        while s != NULL:
            segs[i].handle = s.handle
            segs[i].base = s.base
            segs[i].size = s.size
            segs[i].is_small = s.is_small
            segs[i].stream = s.stream
            segs[i].first_row = j
            b = s.first
            while b != NULL:
                blocks[j].offset = b.offset
                blocks[j].size = b.size
                blocks[j].requested = b.requested
                # 1 allocated, 0 free (or in a front cache), 2 unmapped
                blocks[j].state = (1 if b.heap_index == -1 and b.serial != 0 else
                                       2 if b.heap_index == GM_UNMAPPED else 0)
                blocks[j].stream = b.stream
                blocks[j].serial = b.serial
                j += 1
                b = b.next
            segs[i].nblocks = j - segs[i].first_row
            i += 1
            s = s.next
    _unlock_all(p)
    try:
        if segs == NULL or blocks == NULL:
            raise MemoryError("cannot copy the segment table")
        out = []
        for i in range(nseg - 1, -1, -1):       # oldest first
            rows = []
            for k in range(segs[i].first_row, segs[i].first_row + segs[i].nblocks):
                rows.append({
                    "offset": blocks[k].offset, "size": blocks[k].size,
                    "requested": blocks[k].requested,
                    "state": _STATES[blocks[k].state],
                    "stream": blocks[k].stream, "id": blocks[k].serial,
                })
            out.append({"handle": segs[i].handle, "base": segs[i].base,
                        "size": segs[i].size, "pool": "small" if segs[i].is_small else "large",
                        "stream": segs[i].stream, "blocks": rows})
        return out
    finally:
        free(segs)
        free(blocks)


cdef int check_invariants(gm_pool* p) except -1:
    """Raise AssertionError unless: blocks tile each segment exactly; no two adjacent free
    blocks of the same heap are left unmerged; every free block is in the list of its class
    and every list holds only free blocks; the bitmaps match the lists; and every counter
    equals a recount. The walk records findings as C records under the lock; the messages
    are written after unlocking."""
    cdef _findings f
    cdef size_t i
    f.n = 0
    f.total = 0
    _lock_all_gil(p)
    _walk_invariants(p, &f)
    _unlock_all(p)
    if f.total:
        errors = [_FINDINGS[f.items[i].code].format(f.items[i].a, f.items[i].b,
                                                    f.items[i].c)
                  for i in range(f.n)]
        if f.total > f.n:
            errors.append(f"... and {f.total - f.n} more")
        raise AssertionError("pool invariants broken:\n  " + "\n  ".join(errors))
    return 0
