# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The caching pool: segments carved into blocks, in C structures, behind a spin mutex.

Free blocks live in two-level segregated size-class lists (TLSF): 32 classes per power of two,
a 64-bit word of "class non-empty" bits per 64 classes and one top word, so finding the smallest
non-empty class that fits is two count-trailing-zeros, whatever the number of cached blocks.
Each stream has its own pair of heaps (small pool, large pool): a block freed on stream S is
reused by S at once and handed to another stream only through `reclaim_idle`, which the
manager calls once the backend says S is idle.

Counters are std::atomic so `counters()` reads them without the lock; they are written only
under the lock, so a relaxed load+store (no locked read-modify-write) is enough.

The lock (one owner: the pool; it guards every C structure of the pool and nothing else):

- While it is held **no Python object is created, no Python code runs and the GIL is never
  needed**. Any allocation of a Python object can start the cyclic GC, which can free a Buffer
  whose ``__dealloc__`` needs this lock (a self-deadlock), or run a finalizer that lets the GIL
  go while another thread spins on the lock. So methods that return Python objects copy what
  they need into C memory under the lock and build their result after unlocking; arguments are
  converted to C before locking; errors are raised after unlocking.
- A caller that holds the GIL never spins on the lock: it tries it once and otherwise releases
  the GIL while it waits (``_lock_gil``; CuPy's idiom). ``gm_alloc_gil``/``gm_free_gil`` are
  the GIL-holding variants of ``gm_alloc``/``gm_free``; nogil callers use the plain ones.

Front caches (threads that scale, see pool.pxd): ``gm_free`` keeps a block (up to 4 MiB), still
carved, in the calling thread's front cache (one of GM_NSHARDS, given out round-robin), and
``gm_alloc`` of the same (stream, rounded size) takes it back without the pool lock. Each front
cache has its own lock (taken before the pool lock, never after) and its own counters, one cache
line away from the others. The pool counts a front-cached block as in use; ``counters()``,
``in_use_bytes``, ``segments()``, ``largest_free_block()`` and ``check_invariants()`` fold the
front caches in, and ``release_free_segments()``/``excess_free_segments()`` (empty_cache, the OOM
ladder, trimming) flush them first. The GIL-holding path takes from its thread's front cache
but always frees to the pool, so Python-only use never fills one.

History: alloc/free events go to C rings (gm_ring), the pool's under the pool lock and each front
cache's under its own lock; ``history()`` copies them out under all locks and merges by time.
"""
cimport cython
from libc.stdint cimport uint64_t, int64_t, SIZE_MAX
from libc.stdlib cimport malloc, calloc, free, realloc
from libc.string cimport memset, memcpy

cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)
from libcpp.atomic cimport atomic, memory_order_relaxed, memory_order_acquire, memory_order_release

cdef extern from *:
    """
    #include <sched.h>
    #include <time.h>
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
    static inline unsigned long long gm_coarse_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
        return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
    }
    // A small number per thread, handed out round-robin on the thread's first call: it picks
    // the thread's front cache, so the first GM_NSHARDS threads never share one.
    static std::atomic<unsigned> gm_thread_counter{0};
    // initial-exec: a plain %fs-relative load instead of a __tls_get_addr call on every
    // gm_alloc/gm_free (about 2 ns each here); 4 bytes of the static TLS surplus that glibc
    // keeps for dlopen'ed modules (jemalloc and tcmalloc do the same)
    static thread_local int gm_thread_no __attribute__((tls_model("initial-exec"))) = -1;
    static inline unsigned gm_thread_index(void) {
        if (gm_thread_no < 0) gm_thread_no = (int)(gm_thread_counter.fetch_add(1) & 0x7fffffff);
        return (unsigned)gm_thread_no;
    }
    """
    unsigned gm_thread_index() nogil
    unsigned long long gm_coarse_ns() nogil
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


# ---------------------------------------------------------------------------------------------
# history rings (gm_ring in pool.pxd): each is written under one lock, the one that guards it
cdef inline void _record(gm_ring* r, uint64_t op, uint64_t id, size_t size,
                         uint64_t stream) noexcept nogil:
    cdef gm_event* e
    if r.events == NULL:
        return
    e = &r.events[r.count & (r.capacity - 1)]
    e.t_ns = gm_coarse_ns()
    e.id = id
    e.size_op = size | (op << 63)
    e.stream = stream
    r.count += 1

cdef inline void _ring_init(gm_ring* r, size_t capacity) noexcept nogil:
    """Start recording into r with room for `capacity` events (a power of two; 0: off). The
    caller holds r's lock. Stays off when host memory runs out."""
    free(r.events)
    r.events = NULL
    r.count = 0
    r.capacity = capacity
    if capacity:
        r.events = <gm_event*>malloc(sizeof(gm_event) * capacity)
        if r.events == NULL:
            r.capacity = 0


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

cdef gm_block* _take_fit(gm_pool* p, gm_heap* h, size_t s) noexcept nogil:
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
cdef gm_block* _new_block(gm_pool* p) noexcept nogil:
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

cdef int _register_stream(gm_pool* p, uint64_t stream) noexcept nogil:
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
# carving and accounting
cdef inline bint _worth_splitting(const gm_pool* p, const gm_block* b, size_t s) noexcept nogil:
    cdef size_t rest = b.size - s
    if b.segment.is_small:
        return rest >= p.cfg.granularity
    return rest >= p.cfg.large_split_min and s < p.cfg.max_split_size

cdef int _carve(gm_pool* p, gm_block* b, size_t s, size_t requested, uint64_t stream,
                int hi) noexcept nogil:
    """Make b (already out of every heap) a live block of s bytes; its remainder, if worth
    keeping, goes back to heap hi. Returns -1 when no block struct could be had."""
    cdef gm_block* r
    cdef size_t in_use
    if b.offset == 0 and b.next == NULL:
        gm_sub(p.stats.whole_free_bytes, b.segment.size)
    if _worth_splitting(p, b, s):
        r = _new_block(p)
        if r == NULL:
            return -1
        r.segment = b.segment
        r.offset = b.offset + s
        r.size = b.size - s
        r.stream = p.heaps[hi].stream
        r.prev = b
        r.next = b.next
        if b.next != NULL:
            b.next.prev = r
        b.next = r
        b.size = s
        _heap_insert(p.heaps[hi], r, hi)
    b.requested = requested
    b.stream = stream
    b.heap_index = -1
    b.serial = p.stats.next_serial.load(memory_order_relaxed) + 1
    p.stats.next_serial.store(b.serial, memory_order_relaxed)
    _record(&p.history, 0, b.serial, requested, stream)
    b.segment.live_blocks += 1
    gm_add(p.stats.in_use_bytes, b.size)
    gm_add(p.stats.requested_bytes, requested)
    gm_add(p.stats.active_blocks, 1)
    gm_add(p.stats.num_allocs, 1)
    in_use = p.stats.in_use_bytes.load(memory_order_relaxed)
    gm_max(p.stats.peak_in_use_bytes, in_use)
    return 0


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
# allocation and free with the pool lock held
cdef size_t gm_round(const gm_pool* p, size_t nbytes) noexcept nogil:
    cdef size_t g = p.cfg.granularity
    if nbytes == 0:
        return g
    if nbytes > SIZE_MAX - g:
        return SIZE_MAX & ~(g - 1)
    return (nbytes + g - 1) & ~(g - 1)

cdef inline int _alloc_locked(gm_pool* p, size_t nbytes, uint64_t stream,
                              gm_block** out) noexcept nogil:
    cdef size_t s = gm_round(p, nbytes)
    cdef int k, hi
    cdef gm_block* b
    k = _slot(p, stream)
    if k < 0:
        return GM_UNKNOWN_STREAM
    hi = 2 * k + (0 if s <= p.cfg.small_size else 1)
    b = _take_fit(p, p.heaps[hi], s)
    if b == NULL:
        return GM_MISS
    if _carve(p, b, s, nbytes, stream, hi) < 0:
        _heap_insert(p.heaps[hi], b, hi)
        return GM_MISS
    gm_add(p.stats.hits, 1)
    out[0] = b
    return GM_OK

cdef inline int _free_locked(gm_pool* p, gm_block* b, uint64_t serial) noexcept nogil:
    cdef int k, hi
    if serial == 0 or b.serial != serial or b.heap_index != -1:
        return GM_BAD_BLOCK
    k = _slot(p, b.stream)
    hi = 2 * k + (0 if b.segment.is_small else 1)
    gm_sub(p.stats.in_use_bytes, b.size)
    gm_sub(p.stats.requested_bytes, b.requested)
    gm_sub(p.stats.active_blocks, 1)
    gm_add(p.stats.num_frees, 1)
    _record(&p.history, 1, serial, b.requested, b.stream)
    b.serial = 0
    b.requested = 0
    b.segment.live_blocks -= 1
    _coalesce_insert(p, b, hi)
    return GM_OK

# ---------------------------------------------------------------------------------------------
# front caches (see pool.pxd): a shard's lock is taken before the pool's, never after
cdef inline gm_shard* _my_shard(gm_pool* p) noexcept nogil:
    return &p.shards[gm_thread_index() % GM_NSHARDS]

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

cdef inline gm_front_bin* _bin(gm_shard* sh, size_t s, uint64_t stream) noexcept nogil:
    return &sh.bins[((s >> 9) ^ (s >> 14) ^ stream ^ (stream >> 8)) & (GM_FRONT_BINS - 1)]

cdef inline gm_block* _front_take(gm_pool* p, gm_shard* sh, size_t s, size_t nbytes,
                                  uint64_t stream) noexcept nogil:
    """A block of the shard's bin for (stream, s), made live; NULL if the bin has none or the
    shard's serials are used up (the caller's pool path then tops them up). Shard lock held,
    not the pool's."""
    cdef gm_front_bin* bin = _bin(sh, s, stream)
    cdef gm_block* b
    if (bin.count == 0 or bin.size != s or bin.stream != stream
            or sh.serial_next == sh.serial_end):
        return NULL
    bin.count -= 1
    b = bin.blocks[bin.count]
    b.serial = sh.serial_next
    sh.serial_next += 1
    b.requested = nbytes
    if sh.history.events == NULL and p.history_capacity.load(memory_order_relaxed):
        _ring_init(&sh.history, p.history_capacity.load(memory_order_relaxed))
    _record(&sh.history, 0, b.serial, nbytes, stream)
    gm_sub(sh.cached_bytes, b.size)
    gm_sub(sh.cached_blocks, 1)
    gm_add(sh.requested_delta, nbytes)
    gm_add(sh.allocs, 1)
    return b

cdef inline void _top_up_serials(gm_pool* p, gm_shard* sh) noexcept nogil:
    """Both locks held: a fresh range of 256 serials for the shard once it has used its own
    (every writer of next_serial holds the pool lock, so a plain load+store is enough)."""
    cdef uint64_t serial
    if sh.serial_next == sh.serial_end:
        serial = p.stats.next_serial.load(memory_order_relaxed)
        p.stats.next_serial.store(serial + 256, memory_order_relaxed)
        sh.serial_next = serial + 1
        sh.serial_end = serial + 257

cdef inline int _alloc_from_pool(gm_pool* p, gm_shard* sh, size_t nbytes, uint64_t stream,
                                gm_block** out) noexcept nogil:
    """Both locks held, after a front-cache miss: top up the shard's serials (the miss may have
    been for want of them, then the front cache serves after all), else the pool's heaps."""
    cdef gm_block* b
    if sh.serial_next == sh.serial_end:
        _top_up_serials(p, sh)
        b = _front_take(p, sh, gm_round(p, nbytes), nbytes, stream)
        if b != NULL:
            out[0] = b
            return GM_OK
    return _alloc_locked(p, nbytes, stream, out)

cdef inline bint _front_put(gm_pool* p, gm_shard* sh, gm_block* b) noexcept nogil:
    """Keep the live block b (already validated) in the shard's bins; False when it does not
    belong there (a full bin, or the shard's byte budget spent: that also bounds the size of a
    block a front cache can hold)."""
    cdef size_t s
    cdef gm_front_bin* bin
    if sh.cached_bytes.load(memory_order_relaxed) + b.size > GM_FRONT_BYTES:
        return False
    s = gm_round(p, b.requested)
    bin = _bin(sh, s, b.stream)
    if bin.count == 0:
        bin.size = s
        bin.stream = b.stream
    elif bin.size != s or bin.stream != b.stream or bin.count == GM_FRONT_DEPTH:
        return False
    bin.blocks[bin.count] = b
    bin.count += 1
    if sh.history.events == NULL and p.history_capacity.load(memory_order_relaxed):
        _ring_init(&sh.history, p.history_capacity.load(memory_order_relaxed))
    _record(&sh.history, 1, b.serial, b.requested, b.stream)
    gm_add(sh.cached_bytes, b.size)
    gm_add(sh.cached_blocks, 1)
    gm_sub(sh.requested_delta, b.requested)
    gm_add(sh.frees, 1)
    b.serial = 0
    b.requested = 0
    return True

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

cdef void _lock_all_gil(gm_pool* p) noexcept:
    """Every shard's lock, then the pool's (GIL held: never spins with it)."""
    cdef int i
    for i in range(GM_NSHARDS):
        _shard_lock_gil(&p.shards[i])
    _lock_gil(p)

cdef void _unlock_all(gm_pool* p) noexcept nogil:
    cdef int i
    _unlock(p)
    for i in range(GM_NSHARDS):
        _shard_unlock(&p.shards[i])


# ---------------------------------------------------------------------------------------------
# the public C API
cdef int gm_alloc(gm_pool* p, size_t nbytes, uint64_t stream, gm_block** out) noexcept nogil:
    cdef gm_shard* sh = _my_shard(p)
    cdef gm_block* b
    cdef int rc
    _shard_lock(sh)
    b = _front_take(p, sh, gm_round(p, nbytes), nbytes, stream)
    if b != NULL:
        _shard_unlock(sh)
        out[0] = b
        return GM_OK
    out[0] = NULL
    _lock(p)                          # shard lock kept: it comes first in the lock order
    rc = _alloc_from_pool(p, sh, nbytes, stream, out)
    _unlock(p)
    _shard_unlock(sh)
    return rc

cdef int gm_free(gm_pool* p, gm_block* b, uint64_t serial) noexcept nogil:
    cdef gm_shard* sh
    cdef int rc
    # a live block's serial, stream, size and segment change only when its owner frees it
    if serial == 0 or b.serial != serial or b.heap_index != -1:
        return GM_BAD_BLOCK
    sh = _my_shard(p)
    _shard_lock(sh)
    if _front_put(p, sh, b):
        _shard_unlock(sh)
        return GM_OK
    _shard_unlock(sh)
    _lock(p)
    rc = _free_locked(p, b, serial)
    _unlock(p)
    return rc

cdef int gm_alloc_gil(gm_pool* p, size_t nbytes, uint64_t stream, gm_block** out) noexcept:
    cdef gm_shard* sh = _my_shard(p)
    cdef gm_block* b
    cdef int rc
    if sh.cached_blocks.load(memory_order_relaxed):
        # this thread's front cache has blocks (nogil gm_free calls put them there): use them
        _shard_lock_gil(sh)
        b = _front_take(p, sh, gm_round(p, nbytes), nbytes, stream)
        if b != NULL:
            _shard_unlock(sh)
            out[0] = b
            return GM_OK
        out[0] = NULL
        _lock_gil(p)
        rc = _alloc_from_pool(p, sh, nbytes, stream, out)
        _unlock(p)
        _shard_unlock(sh)
        return rc
    out[0] = NULL
    _lock_gil(p)
    rc = _alloc_locked(p, nbytes, stream, out)
    _unlock(p)
    return rc

cdef int gm_free_gil(gm_pool* p, gm_block* b, uint64_t serial) noexcept:
    cdef int rc
    _lock_gil(p)
    rc = _free_locked(p, b, serial)
    _unlock(p)
    return rc


# ---------------------------------------------------------------------------------------------
cdef gm_segment* _link_new_segment(gm_pool* p, uint64_t handle, size_t base, size_t size,
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


ctypedef struct _segdesc:            # a detached segment, copied out under the lock
    uint64_t handle
    size_t base
    size_t size
    int is_small
    uint64_t stream


cdef void _detach_segment(gm_pool* p, gm_segment* seg, _segdesc* desc) noexcept nogil:
    """Unlink a wholly free segment (lock held), drop its blocks; describe it in *desc. Its
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
    if b.next == NULL:
        gm_sub(p.stats.whole_free_bytes, seg.size)
    while b != NULL:
        nxt = b.next
        _heap_remove(p.heaps[b.heap_index], b)
        _drop_block(p, b)
        b = nxt
    if seg.prev != NULL:
        seg.prev.next = seg.next
    else:
        p.segments = seg.next
    if seg.next != NULL:
        seg.next.prev = seg.prev
    gm_sub(p.stats.reserved_bytes, seg.size)
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


cdef list _desc_list(const _segdesc* d, size_t n):
    """The detached segments as Python tuples (built after unlocking)."""
    cdef size_t i
    return [(d[i].handle, d[i].base, d[i].size, bool(d[i].is_small), d[i].stream)
            for i in range(n)]


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
    int allocated
    uint64_t stream
    uint64_t serial

cdef enum:
    _NCOUNTERS = 14

_COUNTER_NAMES = ("reserved_bytes", "in_use_bytes", "requested_bytes", "peak_in_use_bytes",
                  "peak_reserved_bytes", "active_blocks", "num_segments", "num_allocs",
                  "num_frees", "hits", "misses", "segments_created", "segments_released",
                  "whole_free_bytes")

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
    cdef size_t hbytes, hcount, offset, whole_free = 0
    cdef size_t fronted = 0, fronted_bytes = 0, binned = 0, binned_bytes = 0
    cdef size_t v[_NCOUNTERS]
    cdef int i, c, j
    cdef bint nonempty
    cdef gm_stats* st = &p.stats
    cdef gm_front_bin* bin
    s = p.segments
    while s != NULL:
        nseg += 1
        reserved += s.size
        offset = 0
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
            else:
                _note(f, 11, b.offset, <size_t>b.heap_index)
            b = b.next
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


cdef inline size_t _round_up(size_t n, size_t to) noexcept nogil:
    return ((n + to - 1) // to) * to


cdef gm_segment* _find_segment(gm_pool* p, uint64_t handle) noexcept nogil:
    cdef gm_segment* s = p.segments
    while s != NULL and s.handle != handle:
        s = s.next
    return s


cdef inline gm_block* _last_block(gm_segment* seg) noexcept nogil:
    cdef gm_block* b = seg.first
    while b.next != NULL:
        b = b.next
    return b


_MAX_HISTORY = 1 << 30          # events per ring (32 GiB): a bound against typos, not a budget


def _event_dtype():
    import numpy as np
    return np.dtype([("t_ns", "<u8"), ("id", "<u8"), ("size_op", "<u8"), ("stream", "<u8")])


def _allocs_before_frees(ops, ids):
    """An order (index array) of the events with each free after its allocation. Events of two
    rings with the same coarse time can sort a free before its allocation (a block allocated
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


@cython.final
cdef class CachingPool:
    """Segments and blocks of one device, without the device: the manager feeds it segments.

    Python code uses this class for introspection (segments, invariants, counters) and the
    manager's slow paths; the hot path is gm_alloc/gm_free.
    """

    def __cinit__(self, *, size_t granularity=512, size_t small_size=1 << 20,
                  size_t small_segment=2 << 20, size_t large_segment=20 << 20,
                  size_t large_threshold=10 << 20, size_t large_round=2 << 20,
                  max_split_size=None, size_t large_split_min=1 << 20,
                  size_t oversize_slack=20 << 20, history_events=100_000):
        if granularity == 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a power of two, got {granularity}")
        if small_size > small_segment:
            raise ValueError(f"small_size ({small_size}) must not exceed small_segment "
                             f"({small_segment})")
        if large_round == 0 or large_segment < large_threshold:
            raise ValueError("large_round must be > 0 and large_segment >= large_threshold")
        self._p = <gm_pool*>calloc(1, sizeof(gm_pool))
        if self._p == NULL:
            raise MemoryError("cannot allocate the pool structure")
        self._p.cfg.granularity = granularity
        self._p.cfg.small_size = small_size
        self._p.cfg.small_segment = _round_up(small_segment, granularity)
        self._p.cfg.large_segment = _round_up(large_segment, granularity)
        self._p.cfg.large_threshold = large_threshold
        self._p.cfg.large_round = _round_up(large_round, granularity)
        self._p.cfg.max_split_size = SIZE_MAX if max_split_size is None else <size_t>max_split_size
        self._p.cfg.large_split_min = max(large_split_min, granularity)
        self._p.cfg.oversize_slack = oversize_slack
        self._p.last_slot = -1
        if _register_stream(self._p, 0) < 0:
            raise MemoryError("cannot allocate the default stream's heaps")
        # aligned_alloc wants a multiple of the alignment
        self._p.shards = <gm_shard*>aligned_alloc(
            64, _round_up(sizeof(gm_shard) * GM_NSHARDS, 64))
        if self._p.shards == NULL:
            raise MemoryError("cannot allocate the front caches")
        memset(self._p.shards, 0, sizeof(gm_shard) * GM_NSHARDS)
        self.set_history(history_events)

    def __dealloc__(self):
        cdef gm_segment* s
        cdef gm_segment* nxt
        cdef int i
        if self._p == NULL:
            return
        s = self._p.segments
        while s != NULL:
            nxt = s.next
            free(s)
            s = nxt
        for i in range(self._p.nchunks):
            free(self._p.chunks[i])
        free(self._p.chunks)
        for i in range(self._p.nheaps):
            free(self._p.heaps[i])
        free(self._p.heaps)
        free(self._p.history.events)
        if self._p.shards != NULL:
            for i in range(GM_NSHARDS):
                free(self._p.shards[i].history.events)
        free(self._p.shards)
        free(self._p)
        self._p = NULL

    # --- sizes ------------------------------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._p.cfg.granularity

    @property
    def small_size(self) -> int:
        return self._p.cfg.small_size

    def round_size(self, size_t nbytes) -> int:
        """The bytes a request of nbytes occupies in the pool."""
        return gm_round(self._p, nbytes)

    cdef size_t segment_size_for(self, size_t rounded) noexcept nogil:
        if rounded <= self._p.cfg.small_size:
            return self._p.cfg.small_segment
        if rounded < self._p.cfg.large_threshold:
            # a whole number of such blocks: same-size requests (the common case) tile the
            # segment with no tail too small for them
            return (self._p.cfg.large_segment // rounded) * rounded
        return _round_up(rounded, self._p.cfg.large_round)

    def segment_size(self, size_t nbytes) -> int:
        """Size of the segment a miss for nbytes asks the backend for."""
        return self.segment_size_for(gm_round(self._p, nbytes))

    # --- streams ------------------------------------------------------------------------------
    def register_stream(self, uint64_t stream) -> None:
        cdef int k
        _lock_gil(self._p)
        k = _register_stream(self._p, stream)
        _unlock(self._p)
        if k < 0:
            raise MemoryError("cannot allocate heaps for a new stream")

    def has_stream(self, uint64_t stream) -> bool:
        cdef int k
        _lock_gil(self._p)
        k = _slot(self._p, stream)
        _unlock(self._p)
        return k >= 0

    def streams_with_free(self, uint64_t stream) -> list:
        """Streams other than `stream` that hold cached free blocks."""
        cdef gm_pool* p = self._p
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

    def reclaim_idle(self, idle_streams, uint64_t into) -> int:
        """Re-file every free block of `idle_streams` under stream `into`, merging neighbours.

        The caller has checked with the backend that each of those streams has no pending
        work, so their cached blocks are safe for `into`. Returns the bytes re-filed.
        """
        cdef gm_pool* p = self._p
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

    # --- segments ---------------------------------------------------------------------------
    cdef int add_segment_and_alloc(self, uint64_t handle, size_t base, size_t seg_size,
                                   size_t nbytes, uint64_t stream, gm_block** out) except -1:
        """Adopt a fresh segment and carve the request from its start."""
        cdef gm_pool* p = self._p
        cdef size_t s = gm_round(p, nbytes)
        cdef gm_segment* seg
        cdef int hi, failed = 0
        if seg_size < s:
            raise ValueError(f"segment of {seg_size} bytes cannot hold a {s}-byte block")
        _lock_gil(p)
        seg = _link_new_segment(p, handle, base, seg_size, s <= p.cfg.small_size, stream, &hi)
        if seg == NULL:
            failed = 1
        else:
            gm_max(p.stats.peak_reserved_bytes, p.stats.reserved_bytes.load(memory_order_relaxed))
            gm_add(p.stats.segments_created, 1)
            gm_add(p.stats.misses, 1)
            if _carve(p, seg.first, s, nbytes, stream, hi) < 0:
                # undo the adoption: the caller returns the segment to the driver
                _heap_insert(p.heaps[hi], seg.first, hi)
                _detach_segment(p, seg, NULL)
                gm_sub(p.stats.segments_created, 1)
                gm_sub(p.stats.segments_released, 1)
                gm_sub(p.stats.misses, 1)
                failed = 2
            else:
                out[0] = seg.first
        _unlock(p)
        if failed == 1:
            raise MemoryError("cannot allocate a segment record")
        if failed == 2:
            raise MemoryError("cannot allocate a block record")
        return 0

    # --- expandable segments (virtual memory: the segment's end moves) ----------------------
    # The manager (gpumem/expandable.py) maps pages at a segment's end, then grows it here; or
    # shrinks a free tail here, then unmaps the pages. The pool only sees `size` change. The
    # segment's blocks may sit in other streams' heaps (reclaim_idle moves them), so a free
    # block at offset 0 need not be the segment's last: whole_free_bytes follows each change.
    # Callers hold the GIL: _lock_gil.
    def tail_free_bytes(self, uint64_t handle, uint64_t stream) -> int:
        """Size of the free block at the end of segment `handle` when it is cached for
        `stream` (growing the segment extends it), else 0."""
        cdef gm_pool* p = self._p
        cdef gm_segment* seg
        cdef gm_block* last
        cdef size_t out = 0
        cdef int k
        _lock_gil(p)
        seg = _find_segment(p, handle)
        k = _slot(p, stream)
        if seg != NULL and k >= 0:
            last = _last_block(seg)
            if last.heap_index == 2 * k + (0 if seg.is_small else 1):
                out = last.size
        _unlock(p)
        return out

    cdef int grow_segment_and_alloc(self, uint64_t handle, size_t extra, size_t nbytes,
                                    uint64_t stream, gm_block** out) except -1:
        """Segment `handle` gains `extra` bytes at its end (already mapped by the caller; 0
        when its free tail is already large enough) and the request is carved from that tail. Returns 0, or 1 when nothing changed (unknown
        segment or stream, a tail too small, no block record): the caller unmaps the pages."""
        cdef gm_pool* p = self._p
        cdef size_t s = gm_round(p, nbytes)
        cdef gm_segment* seg
        cdef gm_block* last
        cdef gm_block* tail
        cdef int k, hi
        _lock_gil(p)
        seg = _find_segment(p, handle)
        k = _slot(p, stream)
        if seg == NULL or k < 0 or extra % p.cfg.granularity:
            _unlock(p)
            return 1
        hi = 2 * k + (0 if seg.is_small else 1)
        last = _last_block(seg)
        if last.heap_index == hi:
            if last.size + extra < s:
                _unlock(p)
                return 1
            _heap_remove(p.heaps[hi], last)
            if last.offset == 0:
                gm_sub(p.stats.whole_free_bytes, seg.size)
                gm_add(p.stats.whole_free_bytes, seg.size + extra)   # _carve takes it off
            last.size += extra
            tail = last
        else:
            if extra < s:               # also refuses extra == 0 without a free tail
                _unlock(p)
                return 1
            tail = _new_block(p)
            if tail == NULL:
                _unlock(p)
                return 1
            if last.offset == 0 and last.heap_index >= 0:
                # wholly free, in another stream's heap: no longer once the tail is added
                gm_sub(p.stats.whole_free_bytes, seg.size)
            tail.segment = seg
            tail.offset = seg.size
            tail.size = extra
            tail.stream = stream
            tail.prev = last
            last.next = tail
        seg.size += extra
        gm_add(p.stats.reserved_bytes, extra)
        gm_max(p.stats.peak_reserved_bytes, p.stats.reserved_bytes.load(memory_order_relaxed))
        gm_add(p.stats.misses, 1)
        if _carve(p, tail, s, nbytes, stream, hi) < 0:
            _coalesce_insert(p, tail, hi)   # the pages stay, as a cached free tail
            _unlock(p)
            raise MemoryError("cannot allocate a block record")
        out[0] = tail
        _unlock(p)
        return 0

    def free_tail_offset(self, uint64_t handle) -> int:
        """Offset where segment `handle`'s free tail begins (its size when the last block is
        live): the bytes from there on could be given back."""
        cdef gm_pool* p = self._p
        cdef gm_segment* seg
        cdef gm_block* last
        cdef size_t out = 0
        _lock_gil(p)
        seg = _find_segment(p, handle)
        if seg != NULL:
            last = _last_block(seg)
            out = last.offset if last.heap_index >= 0 else seg.size
        _unlock(p)
        if seg == NULL:
            raise KeyError(handle)
        return out

    def trim_segment_tail(self, uint64_t handle, size_t new_size) -> int:
        """Shrink segment `handle` to `new_size` bytes when everything past it is one free
        block (checked under the lock: a hit may have taken the tail meanwhile) and at least
        one byte stays (a wholly free segment is released whole instead). Returns the
        segment's size afterwards; the caller unmaps what lies past it."""
        cdef gm_pool* p = self._p
        cdef gm_segment* seg
        cdef gm_block* last
        cdef size_t size = 0
        cdef int hi
        if new_size % p.cfg.granularity:
            raise ValueError(f"{new_size} is not a multiple of the granularity")
        _lock_gil(p)
        seg = _find_segment(p, handle)
        if seg != NULL:
            size = seg.size
            last = _last_block(seg)
            if (last.heap_index >= 0 and 0 < new_size < seg.size and last.offset <= new_size
                    and last.offset > 0):
                hi = last.heap_index
                _heap_remove(p.heaps[hi], last)
                if new_size == last.offset:
                    last.prev.next = NULL
                    if last.prev.offset == 0 and last.prev.heap_index >= 0:
                        # one free block left (of another stream's heap): wholly free now
                        gm_add(p.stats.whole_free_bytes, new_size)
                    _drop_block(p, last)
                else:
                    last.size = new_size - last.offset
                    _heap_insert(p.heaps[hi], last, hi)
                gm_sub(p.stats.reserved_bytes, seg.size - new_size)
                seg.size = new_size
                size = new_size
        _unlock(p)
        if seg == NULL:
            raise KeyError(handle)
        return size

    def release_free_segments(self, size_t max_bytes=SIZE_MAX, int small=-1) -> list:
        """Detach wholly free segments, largest first, until max_bytes have been released;
        only those of the small pool (small=1) or of the large pool (small=0) if asked.

        Returns ``[(handle, base, size, is_small, stream), ...]``; the caller returns each to the
        backend, or hands it back with :meth:`restore_segment` if the backend refuses.
        """
        cdef gm_pool* p = self._p
        cdef gm_segment* s
        cdef gm_segment* best
        cdef size_t released = 0, n = 0
        cdef _segdesc* out
        cdef int i
        _lock_all_gil(p)
        for i in range(GM_NSHARDS):       # what the front caches hold can be released too
            _flush_shard(p, &p.shards[i])
        out = <_segdesc*>malloc(sizeof(_segdesc) * (_count_free_segments(p) + 1))
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
            released += best.size
            _detach_segment(p, best, &out[n])
            n += 1
        _unlock_all(p)
        if out == NULL:
            raise MemoryError("cannot list the segments to release")
        try:
            return _desc_list(out, n)
        finally:
            free(out)

    def excess_free_segments(self, size_t per_class) -> list:
        """Detach wholly free large-pool segments beyond `per_class` of one size class (the
        newest of each class are kept). Same return value as release_free_segments."""
        cdef gm_pool* p = self._p
        cdef gm_segment* s
        cdef gm_segment* nxt
        cdef size_t* seen = <size_t*>calloc(GM_NCLASSES, sizeof(size_t))
        cdef _segdesc* out = NULL
        cdef size_t n = 0
        cdef int c
        if seen == NULL:
            raise MemoryError("cannot count the segments per class")
        _lock_all_gil(p)
        for c in range(GM_NSHARDS):
            _flush_shard(p, &p.shards[c])
        out = <_segdesc*>malloc(sizeof(_segdesc) * (_count_free_segments(p) + 1))
        s = p.segments if out != NULL else NULL       # newest first
        while s != NULL:
            nxt = s.next
            if s.live_blocks == 0 and not s.is_small:
                c = _class_of(s.size)
                seen[c] += 1
                if seen[c] > per_class:
                    _detach_segment(p, s, &out[n])
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

    def flush_front_caches(self) -> int:
        """Return the blocks of every thread's front cache to the pool (merging them with
        their neighbours); the bytes returned. release_free_segments does this first."""
        cdef gm_pool* p = self._p
        cdef size_t before = 0
        cdef int i
        _lock_all_gil(p)
        for i in range(GM_NSHARDS):
            before += p.shards[i].cached_bytes.load()
            _flush_shard(p, &p.shards[i])
        _unlock_all(p)
        return before

    def restore_segment(self, uint64_t handle, size_t base, size_t size, bint is_small,
                        uint64_t stream) -> None:
        """Put back a segment detached by release_free_segments (the backend kept it)."""
        cdef gm_pool* p = self._p
        cdef gm_segment* seg
        cdef int hi
        _lock_gil(p)
        seg = _link_new_segment(p, handle, base, size, is_small, stream, &hi)
        if seg != NULL:
            _heap_insert(p.heaps[hi], seg.first, hi)
            gm_sub(p.stats.segments_released, 1)
        _unlock(p)
        if seg == NULL:
            raise MemoryError("cannot allocate a segment record")

    def live_segment_handles(self) -> list:
        """Handles of every segment (for close(): all are returned to the backend)."""
        cdef gm_pool* p = self._p
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

    # --- statistics ---------------------------------------------------------------------------
    def counters(self, bint consistent=False) -> dict:
        """Every counter, as the user sees them (blocks in front caches are cached, not in use;
        ``peak_in_use_bytes`` counts them as in use, so it may exceed the true peak by at most
        what the front caches hold). By default read without the locks (each value exact
        unless a block moves between a front cache and the pool meanwhile, the set not one
        moment); with consistent=True copied under the locks, one moment, together with
        ``largest_free_block``."""
        cdef size_t v[_NCOUNTERS]
        cdef size_t largest = 0
        if consistent:
            _lock_all_gil(self._p)
            _read_counters(self._p, v)
            largest = _largest_free(self._p)
            _unlock_all(self._p)
        else:
            _read_counters(self._p, v)
        out = {name: v[i] for i, name in enumerate(_COUNTER_NAMES)}
        if consistent:
            out["largest_free_block"] = largest
        return out

    @property
    def whole_free_bytes(self) -> int:
        """Bytes in segments that are entirely one free block: releasable without a search."""
        return self._p.stats.whole_free_bytes.load()

    @property
    def reserved_bytes(self) -> int:
        return self._p.stats.reserved_bytes.load()

    @property
    def in_use_bytes(self) -> int:
        """Bytes in live blocks (not counting blocks kept in front caches)."""
        cdef size_t v[_NCOUNTERS]
        _read_counters(self._p, v)
        return v[1]

    @property
    def peak_reserved_bytes(self) -> int:
        return self._p.stats.peak_reserved_bytes.load()

    def reset_peaks(self) -> None:
        _lock_gil(self._p)
        self._p.stats.peak_in_use_bytes.store(self._p.stats.in_use_bytes.load())
        self._p.stats.peak_reserved_bytes.store(self._p.stats.reserved_bytes.load())
        _unlock(self._p)

    def largest_free_block(self) -> int:
        """Size of the biggest cached free block (0 if none); shows fragmentation."""
        cdef size_t best
        _lock_all_gil(self._p)
        best = _largest_free(self._p)
        _unlock_all(self._p)
        return best

    # --- history ------------------------------------------------------------------------------
    def set_history(self, events) -> None:
        """Keep the newest `events` alloc/free events (at least; rounded up to a power of two)
        in C rings; 0 turns recording off. Forgets what was recorded."""
        cdef gm_pool* p = self._p
        cdef size_t cap = 0
        cdef int i
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

    @property
    def history_capacity(self) -> int:
        """Events kept per ring (0: history off)."""
        return self._p.history_capacity.load()

    def history(self, last=None) -> dict:
        """The recorded events, oldest first, as numpy arrays ``t_ns`` (CLOCK_MONOTONIC_COARSE
        nanoseconds), ``op`` (0 alloc, 1 free), ``id``, ``size`` (bytes requested), ``stream``;
        only the newest `last` if given. Events of different threads are ordered by time, each
        free after its allocation."""
        import numpy as np
        cdef gm_pool* p = self._p
        cdef gm_ring* rings[GM_NSHARDS + 1]
        cdef size_t counts[GM_NSHARDS + 1]
        cdef size_t total = 0, k, j, start, n
        cdef gm_event* buf
        cdef unsigned char[::1] dst
        cdef int i
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

    # --- introspection ------------------------------------------------------------------------
    def segments(self) -> list:
        """Every segment with its blocks in address order, as plain dicts (for snapshots). A
        block kept in a front cache is "free" (cached), though not merged with its neighbours."""
        cdef gm_pool* p = self._p
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
                    blocks[j].allocated = b.heap_index == -1 and b.serial != 0
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
                        "state": "allocated" if blocks[k].allocated else "free",
                        "stream": blocks[k].stream, "id": blocks[k].serial,
                    })
                out.append({"handle": segs[i].handle, "base": segs[i].base,
                            "size": segs[i].size, "pool": "small" if segs[i].is_small else "large",
                            "stream": segs[i].stream, "blocks": rows})
            return out
        finally:
            free(segs)
            free(blocks)

    def check_invariants(self) -> None:
        """Raise AssertionError unless: blocks tile each segment exactly; no two adjacent free
        blocks of the same heap are left unmerged; every free block is in the list of its class
        and every list holds only free blocks; the bitmaps match the lists; and every counter
        equals a recount. The walk records findings as C records under the lock; the messages
        are written after unlocking."""
        cdef _findings f
        cdef size_t i
        f.n = 0
        f.total = 0
        _lock_all_gil(self._p)
        _walk_invariants(self._p, &f)
        _unlock_all(self._p)
        if f.total:
            errors = [_FINDINGS[f.items[i].code].format(f.items[i].a, f.items[i].b,
                                                        f.items[i].c)
                      for i in range(f.n)]
            if f.total > f.n:
                errors.append(f"... and {f.total - f.n} more")
            raise AssertionError("pool invariants broken:\n  " + "\n  ".join(errors))
