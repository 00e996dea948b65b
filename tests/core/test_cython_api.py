"""The public .pxd works for downstream Cython: a tiny extension compiled at test time cimports
``gpumem._core.pool`` and runs gm_alloc/gm_free on a live pool without the GIL, from several
threads at once (as numpy's test_extending does for numpy.random)."""
from __future__ import annotations

import textwrap
import threading

import pytest

from cython_build import build_extension
from invariants import check

MiB = 1 << 20

PYX = textwrap.dedent("""
    # cython: language_level=3
    # distutils: language = c++
    from libc.stdint cimport uint64_t
    from gpumem._core.pool cimport (CachingPool, gm_pool, gm_alloc, gm_free, gm_block, gm_round,
                                    gm_block_address, GM_OK, GM_MISS, GM_UNKNOWN_STREAM,
                                    GM_BAD_BLOCK)

    def hit_pairs(CachingPool pool, size_t nbytes, int n, uint64_t stream=0):
        '''n alloc/free pairs without the GIL; returns (pairs that were both GM_OK, the address
        of the first block).'''
        cdef gm_pool* p = pool._p
        cdef gm_block* b
        cdef int i, ok = 0
        cdef size_t first = 0
        with nogil:
            for i in range(n):
                if gm_alloc(p, nbytes, stream, &b) == GM_OK:
                    if i == 0:
                        first = gm_block_address(b)
                    if gm_free(p, b, b.serial) == GM_OK:
                        ok += 1
        return ok, first

    def alloc_code(CachingPool pool, size_t nbytes, uint64_t stream=0):
        '''The return code of one gm_alloc (the block, if any, is freed again).'''
        cdef gm_block* b = NULL
        cdef int rc
        with nogil:
            rc = gm_alloc(pool._p, nbytes, stream, &b)
            if rc == GM_OK:
                gm_free(pool._p, b, b.serial)
        return rc

    def double_free_code(CachingPool pool, size_t nbytes):
        '''gm_free twice on one block: the second must report GM_BAD_BLOCK.'''
        cdef gm_block* b
        cdef uint64_t serial
        cdef int rc, first = -1, second = -1
        with nogil:
            rc = gm_alloc(pool._p, nbytes, 0, &b)
            if rc == GM_OK:
                serial = b.serial
                first = gm_free(pool._p, b, serial)
                second = gm_free(pool._p, b, serial)
        return first, second

    def rounded(CachingPool pool, size_t nbytes):
        return gm_round(pool._p, nbytes)

    def nogil_alloc(CachingPool pool, size_t nbytes, uint64_t stream=0):
        '''One gm_alloc without the GIL: (code, block handle, address, serial).'''
        cdef gm_block* b = NULL
        cdef int rc
        with nogil:
            rc = gm_alloc(pool._p, nbytes, stream, &b)
        if rc != GM_OK:
            return rc, 0, 0, 0
        return rc, <size_t>b, gm_block_address(b), b.serial

    def nogil_free(CachingPool pool, size_t block, uint64_t serial):
        '''One gm_free without the GIL (block: a handle from nogil_alloc); the code.'''
        cdef int rc
        with nogil:
            rc = gm_free(pool._p, <gm_block*>block, serial)
        return rc

    CODES = dict(GM_OK=GM_OK, GM_MISS=GM_MISS, GM_UNKNOWN_STREAM=GM_UNKNOWN_STREAM,
                 GM_BAD_BLOCK=GM_BAD_BLOCK)
""")

@pytest.fixture(scope="module")
def downstream(tmp_path_factory):
    return build_extension(tmp_path_factory.mktemp("cython_api"), PYX)


@pytest.mark.slow
def test_nogil_hits_on_a_warmed_pool(downstream, manager):
    b = manager.malloc(4096)
    ptr = b.ptr
    b.free()                                            # one cached 2 MiB segment
    before = manager.pool.counters()
    ok, first = downstream.hit_pairs(manager.pool, 4096, 10_000)
    assert ok == 10_000
    assert first == ptr                                  # the same block the Python side had
    after = manager.pool.counters()
    assert after["pool_hits"] - before["pool_hits"] == 10_000
    assert after["num_allocs"] - before["num_allocs"] == 10_000
    assert after["num_frees"] - before["num_frees"] == 10_000
    assert after["pool_misses"] == before["pool_misses"] and after["reserved_bytes"] == 2 * MiB
    check(manager, [])
    # the Python side keeps working on the same pool
    c = manager.malloc(4096)
    assert c.ptr == ptr
    check(manager, [c])


@pytest.mark.slow
def test_return_codes(downstream, manager):
    codes = downstream.CODES
    assert codes == dict(GM_OK=0, GM_MISS=1, GM_UNKNOWN_STREAM=2, GM_BAD_BLOCK=3)
    assert downstream.alloc_code(manager.pool, 4096) == codes["GM_MISS"]       # empty pool
    manager.malloc(4096).free()
    assert downstream.alloc_code(manager.pool, 4096) == codes["GM_OK"]
    assert downstream.alloc_code(manager.pool, 4 * MiB) == codes["GM_MISS"]   # no large block
    assert downstream.alloc_code(manager.pool, 4096, 777) == codes["GM_UNKNOWN_STREAM"]
    assert downstream.double_free_code(manager.pool, 4096) == (codes["GM_OK"],
                                                               codes["GM_BAD_BLOCK"])
    for n in (0, 1, 512, 513, 1 << 40):
        assert downstream.rounded(manager.pool, n) == manager.pool.round_size(n)
    check(manager, [])


@pytest.mark.slow
def test_nogil_pairs_from_threads_with_python_traffic(downstream, manager):
    """Four threads hammer the pool without the GIL while the Python side allocates too."""
    dev = manager.device
    manager.malloc(4096).free()                          # one cached 2 MiB segment
    n = 20_000
    results: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(downstream.hit_pairs(manager.pool, 2048, n)[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    before = manager.pool.counters()
    for t in threads:
        t.start()
    py = [manager.malloc(8192) for _ in range(50)]       # concurrent Python-level traffic
    for b in py[::2]:
        b.free()
    for t in threads:
        t.join()
    assert not errors
    assert results == [n] * 4
    after = manager.pool.counters()
    assert after["num_allocs"] - before["num_allocs"] == 4 * n + 50
    assert after["num_frees"] - before["num_frees"] == 4 * n + 25
    check(manager, py[1::2])
    assert dev.live_bytes == manager.pool.reserved_bytes


# --- front caches (issue 12, item 2). Level: real (the compiled extension, the real pool on sim).
# gm_free from a nogil caller keeps small blocks in the calling thread's front cache; these tests
# prove that those blocks stay visible to stats, snapshots, empty_cache(), the OOM ladder and the
# invariant checker, and that a front cache never hands a block to another stream.

def _front_cached_block(downstream, manager, nbytes=4096, stream=0):
    """A block allocated and freed through the nogil C API: it now sits in a front cache."""
    rc, blk, addr, serial = downstream.nogil_alloc(manager.pool, nbytes, stream)
    if rc != downstream.CODES["GM_OK"]:       # a miss, or a stream the pool does not know yet
        manager.free(manager.malloc(nbytes, stream=stream))       # one cached segment
        rc, blk, addr, serial = downstream.nogil_alloc(manager.pool, nbytes, stream)
    assert rc == downstream.CODES["GM_OK"]
    assert downstream.nogil_free(manager.pool, blk, serial) == downstream.CODES["GM_OK"]
    return blk, addr, serial


@pytest.mark.slow
def test_front_cached_block_counts_as_cached_everywhere(downstream, manager):
    """stats(), segments() and check() see a front-cached block as cached (not in use); the
    next nogil alloc of the same size reuses it; freeing it twice is still a double free."""
    blk, addr, serial = _front_cached_block(downstream, manager)
    st = manager.stats()
    assert st.in_use_bytes == 0 and st.cached_bytes == 2 * MiB and st.active_buffers == 0
    (seg,) = manager.pool.segments()
    assert all(b["state"] == "free" for b in seg["blocks"])
    check(manager, [])
    assert downstream.nogil_free(manager.pool, blk, serial) == downstream.CODES["GM_BAD_BLOCK"]
    rc, blk2, addr2, serial2 = downstream.nogil_alloc(manager.pool, 4096)
    assert (rc, blk2, addr2) == (downstream.CODES["GM_OK"], blk, addr) and serial2 != serial
    assert manager.stats().in_use_bytes == 4096
    assert downstream.nogil_free(manager.pool, blk2, serial2) == downstream.CODES["GM_OK"]
    check(manager, [])


@pytest.mark.slow
def test_front_cache_never_serves_another_stream(downstream, manager):
    """A block freed on stream s1 into a front cache is not handed to stream s2, even with s2
    registered and asking for the same size (stream safety: s1's work may still use it)."""
    s1, s2 = manager.device.create_stream(), manager.device.create_stream()
    _, addr1, _ = _front_cached_block(downstream, manager, stream=s1)
    got, bufs = [], []
    for _ in range(8):
        rc, blk, addr, serial = downstream.nogil_alloc(manager.pool, 4096, s2)
        if rc == downstream.CODES["GM_OK"]:
            got.append((blk, serial))
        else:                        # nothing cached for s2: the manager's ladder serves it
            bufs.append(manager.malloc(4096, stream=s2))
            addr = bufs[-1].ptr
        assert addr != addr1, "a block freed on s1 went to s2"
    for blk, serial in got:
        assert downstream.nogil_free(manager.pool, blk, serial) == downstream.CODES["GM_OK"]
    check(manager, bufs)


@pytest.mark.slow
def test_empty_cache_releases_what_front_caches_hold(downstream, manager):
    """empty_cache() flushes every front cache: the segment goes back to the device."""
    _front_cached_block(downstream, manager)
    assert manager.pool.reserved_bytes == 2 * MiB
    manager.empty_cache()
    assert manager.pool.reserved_bytes == 0 and manager.device.live_bytes == 0
    check(manager, [])


@pytest.mark.slow
def test_oom_ladder_reclaims_front_cached_memory(downstream, make_manager, sim_device):
    """On a 4 MiB device whose one small segment is held by a front cache, a 3 MiB request
    still succeeds: the ladder's release step flushes the front caches and frees the segment."""
    sim_device("4MiB")
    mm = make_manager()
    _front_cached_block(downstream, mm)
    assert mm.pool.reserved_bytes == 2 * MiB
    buf = mm.malloc(3 * MiB)
    assert buf.nbytes == 3 * MiB
    check(mm, [buf])


@pytest.mark.slow
def test_threads_on_two_streams_with_concurrent_flushes(downstream, manager):
    """Two nogil threads on each of two streams while the main thread flushes the front caches,
    checks the invariants and takes snapshots: every pair succeeds, the pool stays consistent
    and empty_cache() then returns everything."""
    streams = [manager.device.create_stream() for _ in range(2)]
    held = [manager.malloc(2048, stream=s) for s in streams for _ in range(4)]
    for b in held:                   # each stream now caches room for its two threads
        b.free()
    n = 20_000
    results: list = []
    errors: list = []

    def run(stream) -> None:
        try:
            results.append(downstream.hit_pairs(manager.pool, 2048, n, stream)[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,))
               for s in (streams[0], streams[1], streams[0], streams[1])]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        manager.pool.flush_front_caches()
        manager.pool.check_invariants()
        manager.pool.segments()
    for t in threads:
        t.join()
    assert not errors and results == [n] * 4
    check(manager, [])
    # the always-on history has every event of the four threads (their front caches' rings)
    # and of the Python side (the pool's ring), each free after its allocation
    h = manager.pool.history()
    assert int((h["op"] == 0).sum()) == int((h["op"] == 1).sum()) == 4 * n + len(held)
    first_seen = {}
    for i, (op, bid) in enumerate(zip(h["op"].tolist(), h["id"].tolist())):
        if op == 0:
            first_seen[bid] = i
        else:
            assert first_seen.get(bid, len(h["op"])) < i, f"free of {bid} before its alloc"
    manager.empty_cache()
    assert manager.pool.reserved_bytes == 0 and manager.device.live_bytes == 0
