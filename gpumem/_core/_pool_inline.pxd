# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# Internal to gpumem: the helpers that more than one of the pool's modules needs (pool.pyx: the
# hot path and CachingPool; pool_segments.pyx, pool_inspect.pyx, pool_history.pyx: cold paths),
# as `cdef inline` functions so each module compiles them in place: the hot path calls no
# function through another module's capsule table. Not part of the public C API (pool.pxd).
# Locking rules: see pool.pyx's docstring; every helper here says which lock its caller holds.
from libc.stdint cimport uint64_t, SIZE_MAX
from libc.stdlib cimport malloc, calloc, free, realloc
from libcpp.atomic cimport atomic, memory_order_relaxed, memory_order_acquire, memory_order_release

from gpumem._core.pool_layout cimport (
    GM_SLI, GM_NCLASSES, GM_NWORDS, GM_NSHARDS, gm_block, gm_event, gm_heap, gm_pool, gm_ring,
    gm_segment, gm_shard)

cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)

cdef extern from *:
    """
    #include <sched.h>
    #include <atomic>
    static inline int gm_clz64(unsigned long long x) { return __builtin_clzll(x); }
    static inline int gm_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    template <typename A, typename V> static inline void gm_add(A &c, V v) {
        c.store(c.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
    }
    template <typename A, typename V> static inline void gm_sub(A &c, V v) {
        c.store(c.load(std::memory_order_relaxed) - v, std::memory_order_relaxed);
    }
    template <typename A, typename V> static inline void gm_max(A &c, V v) {
        if (c.load(std::memory_order_relaxed) < v) c.store(v, std::memory_order_relaxed);
    }
    """
    int gm_clz64(unsigned long long x) nogil
    int gm_ctz64(unsigned long long x) nogil
    void gm_add(atomic[size_t]& c, size_t v) nogil
    void gm_sub(atomic[size_t]& c, size_t v) nogil
    void gm_max(atomic[size_t]& c, size_t v) nogil
    int sched_yield() nogil

cdef enum:
    _BLOCK_CHUNK = 4096          # block structs malloc'd at a time
    _EXACT_SCAN = 4              # blocks examined in the request's own class before moving up


# ---------------------------------------------------------------------------------------------
# lock
cdef inline void _lock(gm_pool* p) noexcept nogil:
    cdef int spins = 0
    while p.lock.exchange(1, memory_order_acquire):
        while p.lock.load(memory_order_relaxed):
            spins += 1
            if spins >= 64:       # the holder was descheduled: let it run
                sched_yield()
                spins = 0

cdef inline void _unlock(gm_pool* p) noexcept nogil:
    p.lock.store(0, memory_order_release)

cdef inline void _lock_gil(gm_pool* p) noexcept:
    """_lock for a caller holding the GIL: one try, else wait with the GIL released (a holder
    never needs the GIL, but a thread spinning with it would stall every other Python thread)."""
    if not p.lock.exchange(1, memory_order_acquire):
        return
    with nogil:
        _lock(p)


# front-cache (shard) locks: a shard's lock is taken before the pool's, never after
cdef inline void _shard_lock(gm_shard* sh) noexcept nogil:
    cdef int spins = 0
    while sh.lock.exchange(1, memory_order_acquire):
        while sh.lock.load(memory_order_relaxed):
            spins += 1
            if spins >= 64:
                sched_yield()
                spins = 0

cdef inline void _shard_lock_gil(gm_shard* sh) noexcept:
    if not sh.lock.exchange(1, memory_order_acquire):
        return
    with nogil:
        _shard_lock(sh)

cdef inline void _shard_unlock(gm_shard* sh) noexcept nogil:
    sh.lock.store(0, memory_order_release)

cdef inline void _lock_all_gil(gm_pool* p) noexcept:
    """Every shard's lock, then the pool's (GIL held: never spins with it)."""
    cdef int i
    for i in range(GM_NSHARDS):
        _shard_lock_gil(&p.shards[i])
    _lock_gil(p)

cdef inline void _unlock_all(gm_pool* p) noexcept nogil:
    cdef int i
    _unlock(p)
    for i in range(GM_NSHARDS):
        _shard_unlock(&p.shards[i])


# ---------------------------------------------------------------------------------------------
# history rings (gm_ring in pool.pxd); the hot path's write, _record, is in _pool_clock.pxd
cdef inline void _ring_init(gm_ring* r, size_t capacity) noexcept nogil:
    """Start recording into r with room for `capacity` events (a power of two; 0: off). The
    caller holds r's lock. Stays off when host memory runs out."""
    free(r.events)
    r.events = NULL
    r.count = 0
    r.capacity = capacity
    r.mask = capacity - 1 if capacity else 0
    r.last_t = <uint64_t>-1           # no event yet: the first one takes _record's tick path
    if capacity:
        r.events = <gm_event*>malloc(sizeof(gm_event) * capacity)
        if r.events == NULL:
            r.capacity = 0
            r.mask = 0


# ---------------------------------------------------------------------------------------------
# size classes
cdef inline int _class_of(size_t s) noexcept nogil:
    cdef int fl
    if s < 32:
        return <int>s
    fl = 63 - gm_clz64(s)
    return (fl - GM_SLI + 1) * 32 + <int>((s >> (fl - GM_SLI)) & 31)

cdef inline size_t _class_floor(int c) noexcept nogil:
    """Smallest size that maps to class c."""
    cdef int fl
    if c < 32:
        return <size_t>c
    fl = c // 32 + GM_SLI - 1
    return (<size_t>(32 + c % 32)) << (fl - GM_SLI)


# ---------------------------------------------------------------------------------------------
# heaps
cdef inline void _heap_insert(gm_heap* h, gm_block* b, int hi) noexcept nogil:
    cdef int c = _class_of(b.size)
    b.size_class = c
    b.heap_index = hi
    b.free_prev = NULL
    b.free_next = h.heads[c]
    if h.heads[c] != NULL:
        h.heads[c].free_prev = b
    else:
        h.words[c >> 6] |= (<uint64_t>1) << (c & 63)
        h.top |= (<uint64_t>1) << (c >> 6)
    h.heads[c] = b
    h.free_bytes += b.size
    h.free_blocks += 1

cdef inline void _heap_remove(gm_heap* h, gm_block* b) noexcept nogil:
    cdef int c = b.size_class
    if b.free_prev != NULL:
        b.free_prev.free_next = b.free_next
    else:
        h.heads[c] = b.free_next
    if b.free_next != NULL:
        b.free_next.free_prev = b.free_prev
    if h.heads[c] == NULL:
        h.words[c >> 6] &= ~((<uint64_t>1) << (c & 63))
        if h.words[c >> 6] == 0:
            h.top &= ~((<uint64_t>1) << (c >> 6))
    h.free_bytes -= b.size
    h.free_blocks -= 1
    b.heap_index = -1
    b.free_prev = NULL
    b.free_next = NULL

cdef inline int _first_class_from(const gm_heap* h, int c) noexcept nogil:
    """The first non-empty class >= c, or -1."""
    cdef int w
    cdef uint64_t m
    if c >= GM_NCLASSES:
        return -1
    w = c >> 6
    m = h.words[w] & (~(<uint64_t>0) << (c & 63))
    if m:
        return (w << 6) + gm_ctz64(m)
    if w + 1 >= GM_NWORDS:
        return -1
    m = h.top & (~(<uint64_t>0) << (w + 1))
    if not m:
        return -1
    w = gm_ctz64(m)
    return (w << 6) + gm_ctz64(h.words[w])

cdef inline gm_block* _take_fit(gm_pool* p, gm_heap* h, size_t s) noexcept nogil:
    """Remove and return a free block of at least s bytes from h, or NULL. O(1)."""
    cdef int c = _class_of(s)
    cdef int n = 0
    cdef gm_block* b = h.heads[c]
    while b != NULL and n < _EXACT_SCAN:
        if b.size >= s:
            break
        b = b.free_next
        n += 1
    if b == NULL or b.size < s:
        c = _first_class_from(h, c + 1)
        if c < 0:
            return NULL
        b = h.heads[c]
    if s < p.cfg.max_split_size:
        if b.size >= p.cfg.max_split_size:
            return NULL           # do not shred an oversize block for a smaller request
    elif b.size - s > p.cfg.oversize_slack:
        return NULL               # oversize blocks are not split; take only a close fit
    _heap_remove(h, b)
    return b


# ---------------------------------------------------------------------------------------------
# block structs
cdef inline gm_block* _new_block(gm_pool* p) noexcept nogil:
    cdef gm_block* b = p.spare_blocks
    cdef gm_block* chunk
    cdef void** grown
    cdef int i
    if b == NULL:
        if p.nchunks == p.chunks_cap:
            grown = <void**>realloc(p.chunks, sizeof(void*) * (p.chunks_cap * 2 + 8))
            if grown == NULL:
                return NULL
            p.chunks = grown
            p.chunks_cap = p.chunks_cap * 2 + 8
        chunk = <gm_block*>aligned_alloc(64, sizeof(gm_block) * _BLOCK_CHUNK)
        if chunk == NULL:
            return NULL
        p.chunks[p.nchunks] = chunk
        p.nchunks += 1
        for i in range(_BLOCK_CHUNK - 1):
            chunk[i].next = &chunk[i + 1]
        chunk[_BLOCK_CHUNK - 1].next = NULL
        b = chunk
    p.spare_blocks = b.next
    b.serial = 0
    b.requested = 0
    b.heap_index = -1
    b.free_prev = NULL
    b.free_next = NULL
    b.prev = NULL
    b.next = NULL
    return b

cdef inline void _drop_block(gm_pool* p, gm_block* b) noexcept nogil:
    b.serial = 0                  # a stale (block, serial) pair never matches again
    b.heap_index = -2
    b.next = p.spare_blocks
    p.spare_blocks = b


# ---------------------------------------------------------------------------------------------
# streams
cdef inline int _slot(gm_pool* p, uint64_t stream) noexcept nogil:
    cdef int k = p.last_slot
    if k >= 0 and p.heaps[2 * k].stream == stream:
        return k
    for k in range(p.nheaps // 2):
        if p.heaps[2 * k].stream == stream:
            p.last_slot = k
            return k
    return -1

cdef inline int _register_stream(gm_pool* p, uint64_t stream) noexcept nogil:
    """Slot of `stream`, creating its heaps if new; -1 when host memory runs out."""
    cdef int k = _slot(p, stream)
    cdef gm_heap** grown
    cdef gm_heap* small
    cdef gm_heap* large
    if k >= 0:
        return k
    grown = <gm_heap**>realloc(p.heaps, sizeof(gm_heap*) * (p.nheaps + 2))
    if grown == NULL:
        return -1
    p.heaps = grown
    small = <gm_heap*>calloc(1, sizeof(gm_heap))
    large = <gm_heap*>calloc(1, sizeof(gm_heap))
    if small == NULL or large == NULL:
        free(small)
        free(large)
        return -1
    small.stream = stream
    large.stream = stream
    p.heaps[p.nheaps] = small
    p.heaps[p.nheaps + 1] = large
    p.nheaps += 2
    return p.nheaps // 2 - 1


# ---------------------------------------------------------------------------------------------
# coalescing (the free path, and the cold paths that re-file free blocks)
cdef inline void _coalesce_insert(gm_pool* p, gm_block* b, int hi) noexcept nogil:
    """File the free block b (in no heap) under heap hi, merged with neighbours already there."""
    cdef gm_heap* h = p.heaps[hi]
    cdef gm_block* n = b.next
    if n != NULL and n.heap_index == hi:
        _heap_remove(h, n)
        b.size += n.size
        b.next = n.next
        if n.next != NULL:
            n.next.prev = b
        _drop_block(p, n)
    n = b.prev
    if n != NULL and n.heap_index == hi:
        _heap_remove(h, n)
        n.size += b.size
        n.next = b.next
        if b.next != NULL:
            b.next.prev = n
        _drop_block(p, b)
        b = n
    if b.offset == 0 and b.next == NULL:
        gm_add(p.stats.whole_free_bytes, b.segment.size)
    _heap_insert(h, b, hi)


# ---------------------------------------------------------------------------------------------
# rounding
cdef inline size_t _round_size(const gm_pool* p, size_t nbytes) noexcept nogil:
    """gm_round: the bytes a request of nbytes occupies (a multiple of the granularity)."""
    cdef size_t g = p.cfg.granularity
    if nbytes == 0:
        return g
    if nbytes > SIZE_MAX - g:
        return SIZE_MAX & ~(g - 1)
    return (nbytes + g - 1) & ~(g - 1)

cdef inline size_t _round_up(size_t n, size_t to) noexcept nogil:
    return ((n + to - 1) // to) * to


# ---------------------------------------------------------------------------------------------
# segments
cdef inline gm_segment* _find_segment(gm_pool* p, uint64_t handle) noexcept nogil:
    cdef gm_segment* s = p.segments
    while s != NULL and s.handle != handle:
        s = s.next
    return s


cdef inline gm_block* _last_block(gm_segment* seg) noexcept nogil:
    cdef gm_block* b = seg.first
    while b.next != NULL:
        b = b.next
    return b
