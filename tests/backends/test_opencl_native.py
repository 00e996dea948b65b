"""``Buffer.native`` on OpenCL: cached sub-buffers that kernels write and read through.

Level: **real** — pyopencl on PoCL (the CPU OpenCL driver CI installs); every kernel here runs.
Skipped with the reason when ``GPUMEM_TEST_BACKENDS`` leaves opencl out or no OpenCL device is
found. What a user relies on: the object ``buf.native`` returns is a ``pyopencl.Buffer`` of
exactly ``buf.nbytes`` bytes at the block's place in its segment, the same object when the same
range comes back from the pool (so the pool's speed is what a kernel user gets), never an alias
of another live buffer, and never a reference to a segment the pool has given back.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

from gpumem.errors import ClosedManagerError, InvalidInputError
from invariants import check, require_backend, run_threads, selected_backends

KiB, MiB = 1 << 10, 1 << 20

KERNELS = """
__kernel void fill(__global uint *p, uint value) { p[get_global_id(0)] = value; }
__kernel void add_one(__global const uint *src, __global uint *dst) {
    size_t i = get_global_id(0); dst[i] = src[i] + 1;
}
"""


@pytest.fixture(scope="module")
def cl_env():
    if "opencl" not in selected_backends():
        pytest.skip("opencl not selected by GPUMEM_TEST_BACKENDS")
    require_backend("opencl")
    import pyopencl as cl
    from gpumem import MemoryManager
    from conftest import permissive_config
    mm = MemoryManager("opencl:0", permissive_config())
    prg = cl.Program(mm.device.context, KERNELS).build()
    yield cl, mm, prg
    mm.close()


@pytest.fixture
def env(cl_env):
    cl, mm, prg = cl_env
    yield cl, mm, prg
    mm.empty_cache()


def fill(cl, mm, prg, buf, value):
    """A kernel writes `value` into every uint32 of buf.native."""
    kernel = cl.Kernel(prg, "fill")        # one per call: kernel objects are not thread-safe
    kernel(mm.device.queue(0), (buf.nbytes // 4,), None, buf.native, np.uint32(value))


def words(buf):
    mm = buf.manager
    mm.device.queue(0).finish()
    return buf.copy_to_host().view(np.uint32)


def test_native_is_a_sub_buffer_of_exactly_the_block(env):
    cl, mm, prg = env
    keep = [mm.malloc(4 * KiB) for _ in range(3)]
    buf = keep[1]
    sub = buf.native
    assert isinstance(sub, cl.Buffer) and sub.size == buf.nbytes
    fill(cl, mm, prg, buf, 7)
    for other in (keep[0], keep[2]):
        fill(cl, mm, prg, other, 1)
    assert (words(buf) == 7).all()
    assert (words(keep[0]) == 1).all() and (words(keep[2]) == 1).all()


def test_same_range_back_from_the_pool_is_the_same_object(env):
    cl, mm, prg = env
    buf = mm.malloc(4 * KiB)
    ptr, first = buf.ptr, buf.native
    assert buf.native is first                 # the fast path: no new sub-buffer per access
    buf.free()
    again = mm.malloc(4 * KiB)
    assert again.ptr == ptr and again.native is first
    fill(cl, mm, prg, again, 0xABCD)
    assert (words(again) == 0xABCD).all()
    again.free()


def test_other_size_at_the_same_address_gets_its_own_sub_buffer(env):
    """Device level (independent of the pool's placement): one address asked for with two
    sizes, as when a freed 4 KiB block comes back as the head of an 8 KiB one."""
    cl, mm, prg = env
    dev = mm.device
    h, base = dev.alloc_segment(64 * KiB)
    try:
        off = 4 * dev.sub_buffer_alignment
        small = dev.resolve(h, off, 4 * KiB)
        big = dev.resolve(h, off, 8 * KiB)
        assert big is not small and big.size == 8 * KiB
        assert dev.native_cache[base + off][0] == 8 * KiB      # replaced, not duplicated
        assert dev.resolve(h, off, 8 * KiB) is big
        cl.Kernel(prg, "fill")(dev.queue(0), (2 * KiB,), None, big, np.uint32(3))
        out = np.empty(2 * KiB, np.uint32)
        dev.queue(0).finish()
        dev.copy_to_host(h, off, memoryview(out).cast("B"))
        assert (out == 3).all()
    finally:
        dev.free_segment(h)
    assert base + off not in dev.native_cache


def test_split_and_merge_keep_native_right(env):
    """Blocks split, freed (merged back) and handed out again at other sizes: every .native
    is exactly its buffer's range, wherever the pool placed it."""
    cl, mm, prg = env
    for round_ in range(3):
        smalls = [mm.malloc(64 * KiB) for _ in range(8)]
        for i, s in enumerate(smalls):
            assert s.native.size == 64 * KiB
            fill(cl, mm, prg, s, i)
        for s in smalls:
            s.free()
        big = mm.malloc(512 * KiB)
        assert big.native.size == 512 * KiB
        fill(cl, mm, prg, big, 99)
        again = [mm.malloc(64 * KiB) for _ in range(2)]
        for i, s in enumerate(again):
            assert s.native.size == 64 * KiB
            fill(cl, mm, prg, s, 10 + i)
        assert (words(big) == 99).all()
        assert (words(again[0]) == 10).all() and (words(again[1]) == 11).all()
        big.free()
        for s in again:
            s.free()
        check(mm)


def test_kernel_reads_one_native_and_writes_another(env):
    cl, mm, prg = env
    src, dst = mm.malloc(16 * KiB), mm.malloc(16 * KiB)
    src.copy_from_host(np.arange(4 * KiB, dtype=np.uint32))
    cl.Kernel(prg, "add_one")(mm.device.queue(0), (4 * KiB,), None, src.native, dst.native)
    assert (words(dst) == np.arange(1, 4 * KiB + 1, dtype=np.uint32)).all()
    src.free()
    dst.free()


def test_released_segments_leave_no_cached_sub_buffer(env):
    cl, mm, prg = env
    bufs = [mm.malloc(4 * KiB) for _ in range(16)]
    for b in bufs:
        b.native
    dev = mm.device
    handles = {b.segment_location()[0] for b in bufs}
    assert any(e[2] in handles for e in dev.native_cache.values())
    for b in bufs:
        b.free()
    mm.empty_cache()                           # free_segment for every idle segment
    assert mm.pool.segments() == []
    assert not any(e[2] in handles for e in dev.native_cache.values())
    # A new segment's blocks resolve afresh and kernels still work through them.
    b = mm.malloc(4 * KiB)
    fill(cl, mm, prg, b, 5)
    assert (words(b) == 5).all()
    b.free()


def test_cache_is_bounded(env):
    cl, mm, prg = env
    dev = mm.device
    saved = dev.native_cache_limit
    dev.native_cache_limit = 8
    try:
        bufs = [mm.malloc(4 * KiB) for _ in range(20)]
        natives = [b.native for b in bufs]
        assert len(dev.native_cache) <= 8
        # evicted entries are only forgotten: their sub-buffers stay usable by their holders
        for i, b in enumerate(bufs):
            assert b.native.size == 4 * KiB
            fill(cl, mm, prg, b, i)
        assert [int(words(b)[0]) for b in bufs] == list(range(20))
        cached = set().union(*(s.cached for s in dev._segments.values()))
        assert cached == set(dev.native_cache)
        # Buffer.native's C index holds exactly the cached entries, eviction included
        assert dev.native_cache._index_size() == len(dev.native_cache)
        for b in bufs:
            entry = dev.native_cache.get(b.ptr)
            hit = dev.native_cache._find(b.ptr, b.nbytes)
            assert hit is (None if entry is None else entry[1])
            if hit is not None:
                assert b.native is hit
        del natives
        for b in bufs:
            b.free()
    finally:
        dev.native_cache_limit = saved


def test_close_clears_the_cache_and_native_refuses():
    if "opencl" not in selected_backends():
        pytest.skip("opencl not selected by GPUMEM_TEST_BACKENDS")
    require_backend("opencl")
    from gpumem import MemoryManager
    mm = MemoryManager("opencl:0")
    buf = mm.malloc(4 * KiB)
    buf.native
    assert mm.device.native_cache
    mm.close()
    assert mm.device.native_cache == {}
    with pytest.raises(ClosedManagerError):
        buf.native


def test_threads_get_their_own_blocks(env):
    cl, mm, prg = env
    def work(value):
        for _ in range(200):
            b = mm.malloc(4 * KiB)
            assert b.native.size == 4 * KiB
            fill(cl, mm, prg, b, value)
            w = words(b)
            assert (w == value).all(), f"thread {value} saw {set(w.tolist())}"
            b.free()

    errors = run_threads(work, (1, 2, 3))
    assert not errors, errors[0]
    gc.collect()
    check(mm)
