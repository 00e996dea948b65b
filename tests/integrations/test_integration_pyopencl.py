"""pyopencl arrays on gpumem memory (``gpumem.integrations.pyopencl``).

Level: **real** — pyopencl's own ``pyopencl.array`` and kernels on PoCL, the CPU OpenCL driver
CI installs. Skipped with the reason when ``GPUMEM_TEST_BACKENDS`` leaves opencl out or no
OpenCL device is found (the import test runs everywhere). What a user relies on: arrays made
with ``allocator=gm_cl.allocator(mm)`` compute right, live in ``mm``'s pool, return their block
when garbage-collected, and a program that owns its own context and queue can hand them to
gpumem instead.
"""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

from gpumem import MemoryManager
from gpumem.errors import InvalidInputError, OutOfMemoryError
from invariants import check, require_backend, selected_backends


def _require_opencl():
    if "opencl" not in selected_backends():
        pytest.skip("opencl not selected by GPUMEM_TEST_BACKENDS")
    require_backend("opencl")


@pytest.fixture
def mm():
    _require_opencl()
    from conftest import permissive_config
    m = MemoryManager("opencl:0", permissive_config())
    yield m
    m.close()


@pytest.fixture
def gm_cl():
    _require_opencl()
    from gpumem.integrations import pyopencl as module
    return module


def test_import_does_not_import_pyopencl():
    """Importing gpumem and the integration module leaves pyopencl unimported (lazy)."""
    code = ("import sys, gpumem, gpumem.integrations, gpumem.integrations.pyopencl; "
            "print('pyopencl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_array_arithmetic_on_gpumem_memory(mm, gm_cl):
    import pyopencl.array as cla
    alloc = gm_cl.allocator(mm)
    q = alloc.queue
    assert q is mm.device.queue(0) and alloc.context is mm.device.context
    x = np.arange(10_000, dtype=np.float32)
    y = np.linspace(0, 1, 10_000, dtype=np.float32)
    a = cla.to_device(q, x, allocator=alloc)
    b = cla.to_device(q, y, allocator=alloc)
    before = mm.stats()
    c = a + b                        # pyopencl allocates the result through a.allocator
    d = 2 * c - a                    # a temporary (2 * c), dropped at once, and d
    after = mm.stats()
    assert after.num_allocs == before.num_allocs + 3
    assert after.num_frees == before.num_frees + 1
    assert after.requested_bytes == 4 * x.nbytes
    np.testing.assert_allclose(c.get(), x + y)
    np.testing.assert_allclose(d.get(), 2 * (x + y) - x, rtol=1e-6)
    z = cla.zeros(q, 777, np.int32, allocator=alloc)
    assert (z.get() == 0).all()
    e = cla.empty(q, (3, 5), np.float64, allocator=alloc)
    e.fill(2.5)
    assert (e.get() == 2.5).all()
    assert mm.stats().in_use_bytes > 0
    del a, b, c, d, z, e
    gc.collect()
    assert mm.stats().in_use_bytes == 0
    check(mm)


def test_kernels_read_and_write_the_arrays(mm, gm_cl):
    import pyopencl as cl
    import pyopencl.array as cla
    from pyopencl.elementwise import ElementwiseKernel
    alloc = gm_cl.allocator(mm)
    q = alloc.queue
    prg = cl.Program(mm.device.context, """
        __kernel void square(__global const float *src, __global float *dst) {
            size_t i = get_global_id(0); dst[i] = src[i] * src[i];
        }""").build()
    src = cla.to_device(q, np.arange(4096, dtype=np.float32), allocator=alloc)
    dst = cla.empty_like(src)
    assert dst.allocator is alloc
    cl.Kernel(prg, "square")(q, (4096,), None, src.data, dst.data)
    np.testing.assert_array_equal(dst.get(), np.arange(4096, dtype=np.float32) ** 2)
    axpy = ElementwiseKernel(mm.device.context, "float a, float *x, float *y",
                             "y[i] = a * x[i] + y[i]")
    axpy(np.float32(3), src, dst, queue=q)
    expect = 3 * np.arange(4096, dtype=np.float32) + np.arange(4096, dtype=np.float32) ** 2
    np.testing.assert_array_equal(dst.get(), expect)
    # A view with an offset into a gpumem array: kernels reach the right bytes.
    tail = dst[1024:]
    tail.fill(-1)
    got = dst.get()
    assert (got[1024:] == -1).all() and (got[:1024] == expect[:1024]).all()


def test_thousands_of_arrays_leave_exact_counters(mm, gm_cl):
    import pyopencl.array as cla
    alloc = gm_cl.allocator(mm)
    q = alloc.queue
    rng = np.random.default_rng(12)
    sizes = rng.integers(1, 300_000, size=3000)
    start = mm.pool.counters()
    kept = []
    for i, n in enumerate(sizes):
        a = cla.empty(q, int(n), np.uint8, allocator=alloc)
        if i % 7 == 0:
            a.fill(i % 256)
            kept.append((a, i % 256))          # some live a while, the rest die at once
        if len(kept) > 50:
            old, v = kept.pop(0)
            assert (old.get() == v).all()
    del a, old, kept
    gc.collect()
    end = mm.pool.counters()
    assert end["num_allocs"] - start["num_allocs"] == len(sizes)
    assert end["num_frees"] - start["num_frees"] == len(sizes)
    assert end["in_use_bytes"] == 0 and end["active_blocks"] == 0
    assert end["pool_hits"] - start["pool_hits"] >= len(sizes) - end["segments_created"]
    check(mm)


def test_each_allocation_is_its_own_buffer_on_the_cached_sub_buffer(mm, gm_cl):
    """The allocator (a Cython call, issue 21) hands each allocation a new pyopencl.Buffer on
    the block's cached sub-buffer (same cl_mem, not the shared object), carrying the gpumem
    buffer; dropping it, not the sub-buffer, returns the block, and the next allocation of the
    size reuses the block with a new Buffer. Level: real (PoCL)."""
    import pyopencl as cl
    alloc = gm_cl.allocator(mm)
    first = alloc(4096)
    gbuf = first._gpumem_buffer
    assert isinstance(first, cl.Buffer) and first is not gbuf.native
    assert first.int_ptr == gbuf.native.int_ptr and first.size == 4096
    block, ident = gbuf.ptr, gbuf.id
    assert mm.stats().in_use_bytes == 4096
    del first, gbuf
    assert mm.stats().in_use_bytes == 0                 # prompt: no gc pass needed
    second = alloc(4096)
    assert second._gpumem_buffer.ptr == block and second._gpumem_buffer.id != ident
    for bad in (0, -1, 1.5, True):
        with pytest.raises((InvalidInputError, TypeError)):
            alloc(bad)
    assert mm.stats().in_use_bytes == 4096
    check(mm)


def test_array_dropped_after_the_manager_closed(gm_cl):
    _require_opencl()
    import pyopencl.array as cla
    m = MemoryManager("opencl:0")
    alloc = gm_cl.allocator(m)
    a = cla.zeros(alloc.queue, 1000, np.float32, allocator=alloc)
    m.close()
    del a                               # nothing to return any more: no error, no crash
    gc.collect()
    with pytest.raises(InvalidInputError, match="closed"):
        alloc(4096)


def test_manager_on_an_existing_context_and_queue(gm_cl):
    _require_opencl()
    import pyopencl as cl
    import pyopencl.array as cla
    from gpumem.backends.opencl import BACKEND
    device = BACKEND.open(0).device
    ctx = cl.Context([device])
    queue = cl.CommandQueue(ctx)
    m = gm_cl.open_manager(ctx, queue)
    try:
        assert m.device.context is ctx and m.device.queue(0) is queue
        assert m.device_string == "opencl:0"
        alloc = gm_cl.allocator(m)
        a = cla.to_device(queue, np.arange(100, dtype=np.int32), allocator=alloc)
        # pyopencl's own array (no gpumem) in the same context works with gpumem's arrays.
        b = cla.to_device(queue, np.ones(100, dtype=np.int32))
        assert ((a + b).get() == np.arange(1, 101)).all()
        s = m.device.create_stream()            # extra streams are queues in that context
        assert m.device.queue(s).context == ctx
    finally:
        m.close()
    # The program's context and queue outlive the manager.
    c = cla.to_device(queue, np.arange(5, dtype=np.int32))
    assert (c.get() == np.arange(5)).all()
    # Without a queue gpumem makes its own in that context.
    m2 = gm_cl.open_manager(ctx)
    try:
        assert m2.device.queue(0).context == ctx and m2.device.queue(0) is not queue
    finally:
        m2.close()


def test_open_manager_refuses_bad_input(gm_cl):
    _require_opencl()
    import pyopencl as cl
    from gpumem.backends.opencl import BACKEND
    device = BACKEND.open(0).device
    ctx, other = cl.Context([device]), cl.Context([device])
    with pytest.raises(InvalidInputError, match="context must be a pyopencl.Context"):
        gm_cl.open_manager("opencl:0")
    with pytest.raises(InvalidInputError, match="queue must be"):
        gm_cl.open_manager(ctx, queue=42)
    with pytest.raises(InvalidInputError, match="another context"):
        gm_cl.open_manager(ctx, cl.CommandQueue(other))
    ooo = cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
    try:
        q_ooo = cl.CommandQueue(ctx, properties=ooo)
    except cl.Error:
        q_ooo = None                 # a driver without out-of-order queues: nothing to refuse
    if q_ooo is not None:
        with pytest.raises(InvalidInputError, match="out-of-order"):
            gm_cl.open_manager(ctx, q_ooo)


def test_allocator_refuses_bad_input(mm, gm_cl, sim_device):
    sim_device("1GiB")
    sim = MemoryManager("sim:0")
    try:
        with pytest.raises(InvalidInputError, match="OpenCL device"):
            gm_cl.allocator(sim)
    finally:
        sim.close()
    with pytest.raises(InvalidInputError, match="MemoryManager or None"):
        gm_cl.allocator("opencl:0")
    with pytest.raises(InvalidInputError, match="stream"):
        gm_cl.allocator(mm, stream=99)
    with pytest.raises(InvalidInputError, match="stream must be an int"):
        gm_cl.allocator(mm, stream="0")
    alloc = gm_cl.allocator(mm)
    before = mm.pool.counters()
    with pytest.raises(InvalidInputError, match="nbytes must be > 0"):
        alloc(0)
    with pytest.raises(InvalidInputError, match="nbytes must be >= 0"):
        alloc(-1)
    after = mm.pool.counters()
    assert after["in_use_bytes"] == before["in_use_bytes"] == 0


def test_host_fallback_is_refused_not_handed_to_pyopencl(gm_cl):
    """A manager that would fall back to host memory raises OutOfMemoryError instead: a
    pyopencl array cannot live in host memory."""
    _require_opencl()
    from conftest import permissive_config
    m = MemoryManager("opencl:0", permissive_config(cpu_fallback_enabled=True,
                                                    gpu_memory_fraction=0.01))
    try:
        alloc = gm_cl.allocator(m)
        with pytest.raises(OutOfMemoryError, match="host memory"):
            alloc(m.usable_memory + (1 << 20))
        assert m.stats().in_use_bytes == 0
    finally:
        m.close()


def test_manager_none_is_the_shared_opencl_manager(gm_cl, monkeypatch):
    """allocator() with no manager uses gpumem.get_manager's shared manager of the default
    device when that is OpenCL, else of opencl:0 (here: no CUDA, PoCL is no GPU)."""
    import gpumem
    import pyopencl.array as cla
    monkeypatch.delenv("GPUMEM_DEVICE", raising=False)
    try:
        alloc = gm_cl.allocator()
        assert alloc.manager is gpumem.get_manager("opencl:0")
        a = cla.zeros(alloc.queue, 10, np.float32, allocator=alloc)
        assert alloc.manager.stats().in_use_bytes > 0
        del a
        gc.collect()
        assert alloc.manager.stats().in_use_bytes == 0
        monkeypatch.setenv("GPUMEM_DEVICE", "opencl:0")
        assert gm_cl.allocator().manager is alloc.manager
    finally:
        gpumem.get_manager("opencl:0").close()
