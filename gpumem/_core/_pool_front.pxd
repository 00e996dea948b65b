# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# Internal to gpumem: the per-thread front caches of the hot path (see gm_shard in pool.pxd), as
# `cdef inline` functions compiled into pool.pyx, the only module that cimports this file (it
# defines the thread numbering, so there is one per process).
#
# gm_free keeps a block (up to 4 MiB), still carved, in the calling thread's front cache (one of
# GM_NSHARDS, given out round-robin), and gm_alloc of the same (stream, rounded size) takes it
# back without the pool lock. Each front cache has its own lock (taken before the pool lock,
# never after) and its own counters and history ring, one cache line away from the others.
from libc.stdint cimport uint64_t
from libcpp.atomic cimport memory_order_relaxed

from gpumem._core.pool_layout cimport (
    GM_NSHARDS, GM_FRONT_BINS, GM_FRONT_DEPTH, GM_FRONT_BYTES, gm_block, gm_front_bin, gm_pool,
    gm_shard)
from gpumem._core._pool_inline cimport _ring_init, _round_size, gm_add, gm_sub
from gpumem._core._pool_clock cimport _record

cdef extern from *:
    """
    #include <atomic>
    // A small number per thread, handed out round-robin on the thread's first call: it picks
    // the thread's front cache, so the first GM_NSHARDS threads never share one. Only pool.pyx
    // cimports this file: one counter per process.
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


# ---------------------------------------------------------------------------------------------
# front caches (see pool.pxd): a shard's lock is taken before the pool's, never after
cdef inline gm_shard* _my_shard(gm_pool* p) noexcept nogil:
    return &p.shards[gm_thread_index() % GM_NSHARDS]

cdef inline gm_front_bin* _bin(gm_shard* sh, size_t s, uint64_t stream) noexcept nogil:
    return &sh.bins[((s >> 9) ^ (s >> 14) ^ stream ^ (stream >> 8)) & (GM_FRONT_BINS - 1)]

cdef inline gm_block* _front_take(gm_pool* p, gm_shard* sh, size_t s, size_t nbytes,
                                  uint64_t stream) noexcept nogil:
    """A block of the shard's bin for (stream, s), made live; NULL if the bin has none or the
    shard's serials are used up (the caller's pool path then tops them up). Shard lock held,
    not the pool's."""
    cdef gm_front_bin* bin = _bin(sh, s, stream)
    cdef gm_block* b
    cdef uint64_t serial = sh.serial_next
    if bin.count == 0 or bin.size != s or bin.stream != stream or serial == sh.serial_end:
        return NULL
    bin.count -= 1
    b = bin.blocks[bin.count]
    b.serial = serial
    sh.serial_next = serial + 1
    b.requested = nbytes
    if sh.history.events == NULL and p.history_capacity.load(memory_order_relaxed):
        _ring_init(&sh.history, p.history_capacity.load(memory_order_relaxed))
    _record(&sh.history, 0, serial, nbytes, stream)   # a local: no reload after the stores
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

cdef inline bint _front_put(gm_pool* p, gm_shard* sh, gm_block* b) noexcept nogil:
    """Keep the live block b (already validated) in the shard's bins; False when it does not
    belong there (a full bin, or the shard's byte budget spent: that also bounds the size of a
    block a front cache can hold)."""
    cdef size_t s
    cdef gm_front_bin* bin
    if sh.cached_bytes.load(memory_order_relaxed) + b.size > GM_FRONT_BYTES:
        return False
    s = _round_size(p, b.requested)
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
