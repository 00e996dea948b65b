"""C threads on the pool's nogil API while Python runs its cold paths; host leaks of the pool.

Level: **real** (the Cython pool on the ``cpu`` backend: real host addresses, so the C threads
write into the blocks they get; a tiny Cython module compiled at test time, see
tests/cython_build.py, starts pthreads that never touch Python).

What a user relies on, and how these tests could fail:

- a block is never handed to two threads at once: each C thread fills every block it gets with
  its own byte and checks it before freeing; a block given out twice shows another thread's
  byte (and, under ci/sanitize.sh's TSan build, the two threads' unordered writes are a race
  report);
- the nogil hot path (front caches, shard and pool locks, the history rings, serials) stays
  consistent while Python-side calls take the locks from another thread: counters (lock-free
  and consistent), history export, front-cache flushes, empty_cache, set_history, segment
  tables, the invariant checker, and Python allocations on the GIL path. Every alloc/free pair
  of every thread is counted exactly, the invariants hold, and everything returns to the
  device afterwards;
- 16 threads on 8 front caches: threads share front caches (their locks are contended).

The last test is the host-memory leak check that ci/sanitize.sh's ASan run leaves out
(LeakSanitizer cannot tell CPython's deliberate leaks from ours): pools with segments, front
caches, streams and history rings, created and closed many times, give back their C memory.
"""
from __future__ import annotations

import ctypes
import gc

import pytest

from conftest import permissive_config
from cython_build import build_extension
from gpumem import MemoryManager
from invariants import check

KiB, MiB = 1 << 10, 1 << 20

PYX = """
# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from gpumem._core.pool cimport (CachingPool, gm_pool, gm_block, gm_alloc, gm_free,
                                gm_block_address, GM_OK, GM_MISS)

cdef extern from *:
    '''
    #include <atomic>
    #include <pthread.h>
    typedef void* (*gmt_start_fn)(void*);
    struct gmt_flag { std::atomic<int> v; };
    static inline int gmt_load(gmt_flag* f) { return f->v.load(); }
    static inline void gmt_add(gmt_flag* f, int d) { f->v.fetch_add(d); }
    static inline int gmt_spawn(pthread_t* t, gmt_start_fn fn, void* arg) {
        return pthread_create(t, NULL, fn, arg);
    }
    '''
    ctypedef struct gmt_flag:
        pass
    ctypedef unsigned long pthread_t
    ctypedef void* (*gmt_start_fn)(void*) noexcept nogil
    int gmt_load(gmt_flag* f) nogil
    void gmt_add(gmt_flag* f, int d) nogil
    int gmt_spawn(pthread_t* t, gmt_start_fn fn, void* arg) nogil
    int pthread_join(pthread_t t, void** ret) nogil

cdef enum:
    HELD = 8            # blocks a thread holds at once
    MAX_SIZES = 16
    MAX_STREAMS = 4
    CHECKED = 32        # bytes checked at each end of a block before its free

cdef struct Worker:
    gm_pool* pool
    gmt_flag* running
    unsigned rng
    long iterations
    int nsizes
    int nstreams
    size_t sizes[MAX_SIZES]
    uint64_t streams[MAX_STREAMS]
    uint8_t tag
    long allocs
    long frees
    long misses
    long other_codes
    long bad_frees
    long corrupt

cdef inline unsigned _next(Worker* w) noexcept nogil:
    w.rng ^= w.rng << 13
    w.rng ^= w.rng >> 17
    w.rng ^= w.rng << 5
    return w.rng

cdef bint _intact(size_t addr, size_t n, uint8_t tag) noexcept nogil:
    cdef const uint8_t* p = <const uint8_t*>addr
    cdef size_t i, k = CHECKED if n > CHECKED else n
    for i in range(k):
        if p[i] != tag or p[n - 1 - i] != tag:
            return False
    return True

cdef void _release(Worker* w, gm_block* b, uint64_t serial, size_t n) noexcept nogil:
    if not _intact(gm_block_address(b), n, w.tag):
        w.corrupt += 1
    if gm_free(w.pool, b, serial) == GM_OK:
        w.frees += 1
    else:
        w.bad_frees += 1

cdef void* _work(void* arg) noexcept nogil:
    cdef Worker* w = <Worker*>arg
    cdef gm_block* held[HELD]
    cdef uint64_t serials[HELD]
    cdef size_t lengths[HELD]
    cdef gm_block* b
    cdef long i
    cdef int k, rc
    cdef size_t n
    for k in range(HELD):
        held[k] = NULL
    for i in range(w.iterations):
        k = _next(w) % HELD
        if held[k] != NULL:
            _release(w, held[k], serials[k], lengths[k])
            held[k] = NULL
            continue
        n = w.sizes[_next(w) % w.nsizes]
        rc = gm_alloc(w.pool, n, w.streams[_next(w) % w.nstreams], &b)
        if rc == GM_OK:
            memset(<void*>gm_block_address(b), w.tag, n)
            held[k], serials[k], lengths[k] = b, b.serial, n
            w.allocs += 1
        elif rc == GM_MISS:
            w.misses += 1
        else:
            w.other_codes += 1
    for k in range(HELD):
        if held[k] != NULL:
            _release(w, held[k], serials[k], lengths[k])
    gmt_add(w.running, -1)
    return NULL


cdef class Run:
    '''C threads running _work on one pool; join() waits for them and returns their counts.'''
    cdef object pool            # kept alive while the threads use its C structure
    cdef Worker* workers
    cdef pthread_t* threads
    cdef gmt_flag* flag
    cdef int started
    cdef bint joined

    def running(self):
        return gmt_load(self.flag)

    cdef void _join_threads(self):
        cdef int i
        if not self.joined:
            with nogil:
                for i in range(self.started):
                    pthread_join(self.threads[i], NULL)
            self.joined = True

    def join(self):
        self._join_threads()
        return [dict(allocs=self.workers[i].allocs, frees=self.workers[i].frees,
                     misses=self.workers[i].misses, other_codes=self.workers[i].other_codes,
                     bad_frees=self.workers[i].bad_frees, corrupt=self.workers[i].corrupt)
                for i in range(self.started)]

    def __dealloc__(self):
        self._join_threads()
        free(self.workers)
        free(self.threads)
        free(self.flag)


def start(CachingPool pool, int nthreads, long iterations, sizes, streams, unsigned seed=1):
    '''nthreads pthreads, each doing `iterations` steps: free one of its blocks (checked), or
    gm_alloc a size of `sizes` on a stream of `streams` and fill the block with its byte.'''
    cdef Run r = Run.__new__(Run)
    cdef Worker* w
    cdef int i, j
    if not 0 < len(sizes) <= MAX_SIZES or not 0 < len(streams) <= MAX_STREAMS:
        raise ValueError("1..16 sizes and 1..4 streams")
    r.pool = pool
    r.workers = <Worker*>calloc(nthreads, sizeof(Worker))
    r.threads = <pthread_t*>calloc(nthreads, sizeof(pthread_t))
    r.flag = <gmt_flag*>calloc(1, sizeof(gmt_flag))
    if r.workers == NULL or r.threads == NULL or r.flag == NULL:
        raise MemoryError()
    for i in range(nthreads):
        w = &r.workers[i]
        w.pool = pool._p
        w.running = r.flag
        w.rng = seed * 2654435761u + <unsigned>i * 40503u + 1
        w.iterations = iterations
        w.nsizes = len(sizes)
        w.nstreams = len(streams)
        for j in range(w.nsizes):
            w.sizes[j] = sizes[j]
        for j in range(w.nstreams):
            w.streams[j] = streams[j]
        w.tag = <uint8_t>(i + 1)
    for i in range(nthreads):
        gmt_add(r.flag, 1)
        if gmt_spawn(&r.threads[i], _work, &r.workers[i]) != 0:
            gmt_add(r.flag, -1)
            break
        r.started += 1
    return r
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_extension(tmp_path_factory.mktemp("nogil_stress"), PYX, "gm_nogil_stress")


SIZES = [256, 512, 700, 2 * KiB, 4 * KiB, 6000, 16 * KiB, 64 * KiB, 200 * KiB, 2 * MiB]


@pytest.mark.slow
def test_c_threads_on_the_nogil_api_while_python_runs_the_cold_paths(harness, make_manager):
    """16 pthreads (two per front cache), 4,000 steps each on two streams, while the main
    thread runs every cold path of the pool in a loop; then every count is exact."""
    mm = make_manager("cpu")
    mm.pool.set_history(4096)
    streams = [0, mm.device.create_stream()]
    for s in streams:               # cached segments of both pools for both streams
        for b in [mm.malloc(n, stream=s) for n in SIZES for _ in range(4)]:
            b.free()
    # one live block of each size on each stream keeps a cached segment of every kind through
    # the loop's empty_cache() calls: the C threads cannot make segments, and without these a
    # thread scheduled after the first empty_cache() found nothing but misses (flaky)
    pins = [mm.malloc(n, stream=s) for s in streams for n in SIZES]
    before = mm.pool.counters()
    run = harness.start(mm.pool, 16, 4000, SIZES, streams)
    rounds = py_pairs = 0
    while run.running():
        mm.pool.counters()
        mm.pool.counters(consistent=True)
        mm.stats()
        mm.pool.history(last=512)
        mm.pool.segments()
        mm.pool.largest_free_block()
        mm.pool.check_invariants()
        mm.pool.flush_front_caches()
        held = [mm.malloc(n, stream=streams[rounds % 2]) for n in SIZES[rounds % 3::3]]
        for b in held:                  # Python-side traffic on the GIL path
            b.free()
        py_pairs += len(held)
        if rounds % 8 == 7:
            mm.empty_cache()            # flushes and releases what is wholly free
        if rounds % 16 == 15:
            mm.pool.set_history(1024 if rounds % 32 == 15 else 4096)
        rounds += 1
    results = run.join()
    assert len(results) == 16
    assert all(r["corrupt"] == 0 for r in results), results     # no block given out twice
    assert all(r["bad_frees"] == 0 and r["other_codes"] == 0 for r in results), results
    allocs = sum(r["allocs"] for r in results)
    assert allocs == sum(r["frees"] for r in results)
    assert allocs > 16 * 1000, results              # most steps found a block (not all misses)
    after = mm.pool.counters()
    assert after["num_allocs"] - before["num_allocs"] == allocs + py_pairs
    assert after["num_frees"] - before["num_frees"] == allocs + py_pairs
    assert rounds > 0
    check(mm, pins)
    for b in pins:
        b.free()
    check(mm, [])
    mm.empty_cache()
    assert mm.pool.reserved_bytes == 0
    assert mm.device.properties().extra["bytes_held"] == 0


def _host_bytes_in_use() -> int | None:
    """Bytes of the C heap in use: ASan's count when its runtime is loaded (it replaces malloc),
    else glibc's mallinfo2 (arena plus mmapped chunks); None where neither exists."""
    me = ctypes.CDLL(None)
    if hasattr(me, "__sanitizer_get_current_allocated_bytes"):
        me.__sanitizer_get_current_allocated_bytes.restype = ctypes.c_size_t
        return me.__sanitizer_get_current_allocated_bytes()
    if not hasattr(me, "mallinfo2"):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    me.mallinfo2.restype = MallInfo2
    info = me.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.slow
def test_closed_pools_give_back_their_host_memory(harness):
    """30 managers, each with segments on two streams, front caches filled by 8 C threads and
    a 64 Ki-event history (2 MiB per ring), then closed: the C heap grows by less than one
    pool's history ring. A pool that kept its rings, block chunks, heaps or front caches
    would leave at least 2 MiB behind per manager (60 MiB in all)."""
    if _host_bytes_in_use() is None:
        pytest.skip("no mallinfo2 (not glibc) and no sanitizer allocator")

    def one_pool() -> None:
        mm = MemoryManager("cpu", permissive_config())
        mm.pool.set_history(65536)
        streams = [0, mm.device.create_stream()]
        for s in streams:
            for b in [mm.malloc(n, stream=s) for n in SIZES for _ in range(2)]:
                b.free()
        harness.start(mm.pool, 8, 500, SIZES[:6], streams).join()
        assert mm.pool.counters()["num_allocs"] > 2 * len(SIZES)
        mm.close()
        del mm
        gc.collect()                    # the manager's cycles: its pool is freed with it

    for _ in range(3):                  # warm-up: interpreter caches, numpy, the backend
        one_pool()
    start = _host_bytes_in_use()
    for _ in range(30):
        one_pool()
    grown = _host_bytes_in_use() - start
    assert grown < 2 * MiB, f"the C heap grew by {grown} bytes over 30 pools"
