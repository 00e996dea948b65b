# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""C-level micro-benchmarks of the caching pool through its public .pxd API.

Compiled at benchmark time by ``asv_benchmarks/build_cbench.py`` (include path = repo root, so
``from gpumem._core.pool cimport ...`` resolves exactly as it does for downstream Cython code).
Nothing here touches a device: `BlockPool` feeds a standalone `CachingPool` synthetic segments
(``add_segment_and_alloc`` with made-up handles and addresses), the way a manager feeds it real
ones on a miss, so the timed loops measure the pool and nothing else.

- `hit_pair_ns(pool, sizes, n)`: n gm_alloc+gm_free pairs in one nogil loop, cycling over
  `sizes`, timed with clock_gettime(CLOCK_MONOTONIC); returns ns per pair. Every alloc must hit.
- `threaded_pairs_per_us(pool, nbytes, n, streams)`: one native thread per entry of `streams`
  (std::thread, no GIL), each running n hit pairs on its stream after a common start; returns
  total pairs per microsecond over the wall time from the first start to the last end.
- `BlockPool.populate(n, ...)`: n blocks of log-uniform random sizes, then every other block (in
  address order) freed where both its neighbours are live, so the freed blocks cannot coalesce.
"""
cimport cython
from libc.stdint cimport uint64_t
from libc.stdlib cimport malloc, calloc, free
from libcpp.atomic cimport atomic
from libc.math cimport exp, log
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef extern from "<time.h>" nogil:
    enum: CLOCK_THREAD_CPUTIME_ID

from gpumem._core.pool cimport (CachingPool, gm_pool, gm_segment, gm_block, gm_alloc, gm_free,
                                gm_alloc_gil, gm_free_gil, gm_round, GM_OK)


cdef extern from *:
    """
    #include <thread>
    #include <vector>
    #include <atomic>
    typedef void (*gmb_worker_fn)(void* arg);
    // Run fn(args[i]) on n native threads at once and join them all.
    static int gmb_run_threads(int n, gmb_worker_fn fn, void** args) {
        std::vector<std::thread> ts;
        try {
            for (int i = 0; i < n; i++) ts.emplace_back(fn, args[i]);
        } catch (...) {
            for (auto& t : ts) t.join();
            return -1;
        }
        for (auto& t : ts) t.join();
        return 0;
    }
    """
    ctypedef void (*gmb_worker_fn)(void* arg) noexcept nogil
    int gmb_run_threads(int n, gmb_worker_fn fn, void** args) nogil


cdef inline long long _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <long long>ts.tv_sec * 1000000000LL + ts.tv_nsec


cdef inline long long _cpu_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts)
    return <long long>ts.tv_sec * 1000000000LL + ts.tv_nsec


cdef inline uint64_t _xorshift(uint64_t* s) noexcept nogil:
    cdef uint64_t x = s[0]
    x ^= x >> 12
    x ^= x << 25
    x ^= x >> 27
    s[0] = x
    return x * 2685821657736338717ULL


cdef inline size_t _log_uniform(uint64_t* s, double lo, double hi) noexcept nogil:
    cdef double u = (_xorshift(s) >> 11) * (1.0 / 9007199254740992.0)
    return <size_t>exp(log(lo) + u * (log(hi) - log(lo)))


def clock_overhead_ns(size_t n=100000):
    """ns per clock_gettime call (for reference; each timed loop calls it twice)."""
    cdef long long t0, t1
    cdef size_t i
    with nogil:
        t0 = _now_ns()
        for i in range(n):
            _now_ns()
        t1 = _now_ns()
    return (t1 - t0) / <double>n


def hit_pair_ns(CachingPool pool not None, sizes, size_t n, uint64_t stream=0, bint cpu=False,
                bint front=True):
    """ns per gm_alloc+gm_free pair: n pairs in a nogil loop, request sizes cycling over `sizes`
    (wall time, or with cpu=True the thread's CPU time: steadier on a loaded machine). With
    front=False the loop holds the GIL and calls gm_alloc_gil/gm_free_gil, which free into the
    pool's heaps: the pool's own lookup (TLSF), not a front cache, serves every pair.

    Raises RuntimeError if any alloc misses (the pool must already hold fitting free blocks) or
    any free fails."""
    cdef gm_pool* p = pool._p
    cdef gm_block* b
    cdef size_t i, j = 0, k = len(sizes), failed_at = <size_t>-1
    cdef size_t* sz
    cdef long long t0, t1
    cdef int rc = GM_OK
    if k == 0 or n == 0:
        raise ValueError("need at least one size and one pair")
    sz = <size_t*>malloc(k * sizeof(size_t))
    if sz == NULL:
        raise MemoryError()
    try:
        for i in range(k):
            sz[i] = sizes[i]
        if not front:
            t0 = _cpu_ns() if cpu else _now_ns()
            for i in range(n):
                rc = gm_alloc_gil(p, sz[j], stream, &b)
                if rc != GM_OK:
                    failed_at = i
                    break
                rc = gm_free_gil(p, b, b.serial)
                if rc != GM_OK:
                    failed_at = i
                    break
                j += 1
                if j == k:
                    j = 0
            t1 = _cpu_ns() if cpu else _now_ns()
        else:
            with nogil:
                t0 = _cpu_ns() if cpu else _now_ns()
                for i in range(n):
                    rc = gm_alloc(p, sz[j], stream, &b)
                    if rc != GM_OK:
                        failed_at = i
                        break
                    rc = gm_free(p, b, b.serial)
                    if rc != GM_OK:
                        failed_at = i
                        break
                    j += 1
                    if j == k:
                        j = 0
                t1 = _cpu_ns() if cpu else _now_ns()
        if failed_at != <size_t>-1:
            raise RuntimeError(f"pair {failed_at} (size {sz[j]}) failed with code {rc}: the pool "
                               f"must hold a fitting free block for every size")
    finally:
        free(sz)
    return (t1 - t0) / <double>n


ctypedef struct _worker:
    gm_pool* pool
    size_t nbytes
    uint64_t stream
    size_t n
    atomic[int]* ready                # threads at the start line; all go once it reaches nthreads
    int nthreads
    long long t0, t1
    long long cpu0, cpu1
    size_t failed


cdef void _pairs_worker(void* arg) noexcept nogil:
    cdef _worker* w = <_worker*>arg
    cdef gm_block* b
    cdef size_t i
    w.ready[0].fetch_add(1)
    while w.ready[0].load() < w.nthreads:
        pass
    w.t0 = _now_ns()
    w.cpu0 = _cpu_ns()
    for i in range(w.n):
        if gm_alloc(w.pool, w.nbytes, w.stream, &b) != GM_OK:
            w.failed += 1
            continue
        if gm_free(w.pool, b, b.serial) != GM_OK:
            w.failed += 1
    w.cpu1 = _cpu_ns()
    w.t1 = _now_ns()


def threaded_pairs_per_us(CachingPool pool not None, size_t nbytes, size_t n, streams,
                          bint cpu=False, pools=None):
    """Hit pairs per microsecond of `len(streams)` native threads together, thread i on
    streams[i] (each stream registered and holding a fitting free block): over the wall time
    from the first start to the last end, or with cpu=True over the largest CPU time a thread
    used (what the threads would do each on its own core: on a loaded machine the wall time
    also counts the time they waited for a core). `pools`: one pool per thread instead (threads
    that share nothing: the machine's own ceiling for the same loop)."""
    cdef int k = len(streams), i
    cdef _worker* ws
    cdef void** args
    cdef atomic[int] ready
    cdef long long t0, t1, cpu_max
    cdef size_t failed = 0
    cdef int rc
    if k < 1:
        raise ValueError("need at least one stream")
    ws = <_worker*>calloc(k, sizeof(_worker))
    args = <void**>calloc(k, sizeof(void*))
    if ws == NULL or args == NULL:
        free(ws)
        free(args)
        raise MemoryError()
    ready.store(0)
    for i in range(k):
        ws[i].pool = (<CachingPool>pools[i])._p if pools is not None else pool._p
        ws[i].nbytes = nbytes
        ws[i].stream = streams[i]
        ws[i].n = n
        ws[i].ready = &ready
        ws[i].nthreads = k
        args[i] = &ws[i]
    with nogil:
        rc = gmb_run_threads(k, _pairs_worker, args)
    t0 = ws[0].t0
    t1 = ws[0].t1
    cpu_max = 0
    for i in range(k):
        t0 = min(t0, ws[i].t0)
        t1 = max(t1, ws[i].t1)
        cpu_max = max(cpu_max, ws[i].cpu1 - ws[i].cpu0)
        failed += ws[i].failed
    free(ws)
    free(args)
    if rc != 0:
        raise RuntimeError("could not start the threads")
    if failed:
        raise RuntimeError(f"{failed} of {k * n} pairs failed: each stream needs a fitting "
                           f"free block")
    return k * n / (((cpu_max if cpu else t1 - t0) or 1) / 1000.0)


def free_block_count(CachingPool pool not None):
    """Cached free blocks in every heap of the pool."""
    cdef gm_pool* p = pool._p
    cdef size_t total = 0
    cdef int i
    for i in range(p.nheaps):
        total += p.heaps[i].free_blocks
    return total


@cython.final
cdef class BlockPool:
    """A standalone CachingPool fed synthetic segments, with blocks allocated and freed from C
    (through the GIL-holding calls, so that blocks freed while building go to the heaps)."""

    cdef readonly CachingPool pool
    cdef size_t _next_base
    cdef uint64_t _next_handle
    cdef readonly size_t segments_added

    def __cinit__(self):
        self._next_base = (<size_t>1) << 44
        self._next_handle = 1
        self.segments_added = 0

    def __init__(self, CachingPool pool=None, **pool_kwargs):
        self.pool = pool if pool is not None else CachingPool(**pool_kwargs)

    cdef gm_block* _alloc(self, size_t nbytes, uint64_t stream=0) except NULL:
        """A block from the cache, or from a new synthetic segment on a miss."""
        cdef gm_block* b = NULL
        cdef gm_pool* p = self.pool._p
        cdef size_t seg
        if gm_alloc_gil(p, nbytes, stream, &b) == GM_OK:
            return b
        seg = self.pool.segment_size_for(gm_round(p, nbytes))
        self.pool.add_segment_and_alloc(self._next_handle, self._next_base, seg, nbytes, stream,
                                        &b)
        self._next_handle += 1
        self._next_base += (seg + 4095) & ~(<size_t>4095)
        self.segments_added += 1
        return b

    def populate(self, size_t nblocks, uint64_t seed=12345, size_t lo=512,
                 size_t hi=16 << 20, size_t target_free=0):
        """Allocate nblocks of log-uniform random sizes in [lo, hi]; then walk every segment in
        address order and free every other live block whose two neighbours are live (so no
        freed block can coalesce), stopping once the pool caches `target_free` free blocks
        (0: no limit). Returns the number of cached free blocks."""
        cdef uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 1
        cdef gm_pool* p = self.pool._p
        cdef gm_segment* seg
        cdef gm_block* b
        cdef gm_block* nxt
        cdef size_t i, nfree
        cdef bint toggle = 0
        for i in range(nblocks):
            self._alloc(_log_uniform(&s, <double>lo, <double>hi))
        nfree = free_block_count(self.pool)
        seg = p.segments
        while seg != NULL and (target_free == 0 or nfree < target_free):
            b = seg.first
            while b != NULL and (target_free == 0 or nfree < target_free):
                nxt = b.next
                if b.heap_index == -1:
                    toggle = not toggle
                    if (not toggle and (b.prev == NULL or b.prev.heap_index == -1)
                            and (nxt == NULL or nxt.heap_index == -1)):
                        if gm_free_gil(p, b, b.serial) != GM_OK:
                            raise RuntimeError("gm_free failed while populating")
                        nfree += 1
                b = nxt
            seg = seg.next
        return free_block_count(self.pool)

    def ensure_hits(self, sizes, uint64_t stream=0):
        """Make sure an alloc of each size hits on `stream` (registering it, and adding a
        segment where one would miss), then return every such block. Returns the number of
        segments it had to add."""
        cdef size_t before = self.segments_added
        cdef gm_block* b
        self.pool.register_stream(stream)
        for n in sizes:
            b = self._alloc(<size_t>n, stream)
            if gm_free_gil(self.pool._p, b, b.serial) != GM_OK:
                raise RuntimeError("gm_free failed")
        return self.segments_added - before

    @property
    def free_blocks(self):
        return free_block_count(self.pool)

    @property
    def live_blocks(self):
        return self.pool._p.stats.active_blocks.load()

    def hit_pair_ns(self, sizes, size_t n, bint cpu=False, bint front=True):
        return hit_pair_ns(self.pool, sizes, n, 0, cpu, front)


ctypedef void* (*torch_alloc_fn)(Py_ssize_t, int, void*) noexcept nogil
ctypedef void (*torch_free_fn)(void*, Py_ssize_t, int, void*) noexcept nogil


def entry_pair_ns(size_t alloc_addr, size_t free_addr, Py_ssize_t nbytes, size_t n,
                  int device=0):
    """n alloc+free pairs through C entry points with torch's pluggable-allocator signatures
    (addresses of the functions, e.g. from ctypes), in one nogil loop; ns per pair, or -1 if an
    alloc returned NULL."""
    cdef torch_alloc_fn a = <torch_alloc_fn>alloc_addr
    cdef torch_free_fn f = <torch_free_fn>free_addr
    cdef long long t0, t1
    cdef size_t i
    cdef void* p = NULL
    if n == 0:
        raise ValueError("n must be > 0")
    with nogil:
        t0 = _now_ns()
        for i in range(n):
            p = a(nbytes, device, NULL)
            if p == NULL:
                break
            f(p, nbytes, device, NULL)
        t1 = _now_ns()
    if p == NULL:
        return -1.0
    return (t1 - t0) / <double>n


# --- the floor under the Python hit pair -------------------------------------------------------
@cython.final
@cython.freelist(64)
@cython.no_gc_clear
cdef class FloorBuffer:
    """The shape of gpumem.Buffer (the same decorators, C fields, object fields, weak-reference
    slot and a __dealloc__ that finds nothing to do) with no pool behind it."""
    cdef size_t _ptr
    cdef readonly size_t nbytes
    cdef readonly uint64_t id
    cdef readonly object tag
    cdef uint64_t _stream
    cdef void* _block
    cdef FloorManager _owner
    cdef list _used_on
    cdef bint _free_after_exports
    cdef Py_ssize_t _exports
    cdef object __weakref__

    def __dealloc__(self):
        if self._block == NULL or self._owner is None:
            return


cdef class FloorManager:
    """``malloc(nbytes, *, stream, tag, fallback)`` / ``free(buf)`` with ManagerCore's calling
    convention that build and drop a FloorBuffer and do nothing else: what the Python hit
    pair would cost if the pool, its lock, its history and gpumem's checks were free."""
    cdef size_t _next

    def malloc(self, nbytes, *, stream=None, tag=None, fallback=True):
        cdef FloorBuffer b = FloorBuffer.__new__(FloorBuffer)
        b.nbytes = nbytes
        b._ptr = self._next
        b.tag = tag
        b._owner = self
        b._block = <void*>b
        return b

    def free(self, buffer) -> None:
        if type(buffer) is FloorBuffer:
            (<FloorBuffer>buffer)._block = NULL
