"""CuPy allocates through gpumem (gpumem/integrations/cupy.py).

CuPy's CUDA runtime cannot start without a GPU (and cannot run on tests/fake_cuda: libcudart
needs driver internals the fake does not have), so no CuPy array is made here. What runs:
- **real** (CuPy's own classes, no device): pinned host memory from gpumem's "cpu" manager as
  ``cupy.cuda.PinnedMemoryPointer``, read and written through numpy; ``cupy.cuda.alloc_pinned_memory``
  reaching gpumem after ``use_gpumem()``; ``set_allocator``/``get_allocator`` switched and
  restored; bad managers refused.
- **fake driver** (GPUMEM_TEST_BACKENDS=cuda on tests/fake_cuda): the device allocator (its
  request runs in C, gpumem/integrations/_cupy_alloc.pyx) gives CuPy's real
  ``MemoryPointer(UnownedMemory(...))`` over a CUDA segment of the fake, on CuPy's current
  stream, with no Python frame on a hit; the block goes back to the pool under that stream when
  CuPy drops it; an out-of-memory is CuPy's OutOfMemoryError (and gpumem's) with the pool
  unchanged. CuPy's two device queries (``runtime.getDevice``, ``get_current_stream``) are
  replaced by the test before the allocator is made, since CuPy's runtime cannot start here.
CuPy arrays on a GPU are in ci/gpu.sh. Every test skips where CuPy is not installed (it is not
in CI's extras: the wheel is about 200 MB).
"""
from __future__ import annotations

import gc
import itertools
import pickle
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.integrations import cupy as gm_cupy
from invariants import EXACT, check, require_backend, selected_backends, sim_manager

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x)")
MiB = 1 << 20


@pytest.fixture
def cuda_manager():
    if "cuda" not in selected_backends(()):
        pytest.skip("GPUMEM_TEST_BACKENDS does not name cuda (the fake-driver run does)")
    require_backend("cuda")
    mm = MemoryManager("cuda:0", MemoryConfig(**EXACT))
    yield mm
    mm.close()


@pytest.fixture
def cupy_device(monkeypatch, cuda_manager):
    """CuPy's current device 0 and a current stream made by gpumem's backend; returns the
    stream handle."""
    stream = cuda_manager.device.create_stream()
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream",
                        lambda device_id=-1: SimpleNamespace(ptr=stream))
    yield stream
    cuda_manager.device.destroy_stream(stream)


def test_device_memory_is_a_gpumem_buffer_on_cupys_stream(cuda_manager, cupy_device):
    """A request becomes a Buffer (tag "cupy") on CuPy's current stream inside CuPy's own
    MemoryPointer; dropping the pointer returns the block to the pool (fake driver)."""
    mm = cuda_manager
    alloc = gm_cupy.allocator(mm)
    p = alloc(1000)
    assert isinstance(p, cupy.cuda.MemoryPointer) and isinstance(p.mem, cupy.cuda.UnownedMemory)
    buf = p.mem._owner
    assert p.ptr == buf.ptr and p.device_id == 0 and p.mem.size == 1000
    assert buf.stream == cupy_device and buf.tag == "cupy"
    assert mm.stats().in_use_bytes >= 1000
    buf.copy_from_host(b"x" * 1000)                   # the fake's memory behind the pointer
    assert bytes(buf.copy_to_host()[:3]) == b"xxx"
    del p, buf
    gc.collect()
    assert mm.stats().in_use_bytes == 0
    check(mm)


def test_another_current_device_is_refused(cuda_manager, cupy_device, monkeypatch):
    """An allocator bound to cuda:0 asked for memory while CuPy's current device is 1 says so
    instead of handing out memory of the wrong device."""
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    with pytest.raises(InvalidInputError, match="current device is 1 but this allocator "
                                                "serves cuda:0"):
        gm_cupy.allocator(cuda_manager)(MiB)
    assert cuda_manager.stats().num_allocs == 0


def test_cpu_fallback_memory_is_not_handed_to_cupy(cupy_device, cuda_manager):
    """Host memory cannot back a CuPy array: with CPU fallback on, a request the device cannot
    serve raises OutOfMemoryError without taking host memory first (no fallback made), and
    leaves no buffer behind."""
    total = cuda_manager.total_memory
    mm = MemoryManager("cuda:0", MemoryConfig(**{**EXACT, "cpu_fallback_enabled": True,
                                                 "gpu_memory_fraction": 16 * MiB / total}))
    try:
        with pytest.raises(OutOfMemoryError):
            gm_cupy.allocator(mm)(32 * MiB)
        stats = mm.stats()
        assert stats.cpu_fallbacks == 0 and stats.active_buffers == 0 and stats.num_ooms == 1
    finally:
        mm.close()


def test_cupy_drops_the_pointer_and_the_block_returns_under_cupys_stream(cuda_manager,
                                                                          cupy_device):
    """Through ``cupy.cuda.alloc`` (the allocator installed by use_gpumem): the block is filed
    under CuPy's current stream while CuPy holds it and after CuPy drops the pointer (then
    free in the pool, under that stream, and the next request on that stream gets it back);
    nothing else keeps it alive (fake driver)."""
    mm = cuda_manager
    with gm_cupy.use_gpumem(mm, pinned=False):
        p = cupy.cuda.alloc(4096)
        ptr = p.ptr

        def block_at(address):
            return [(b["state"], b["stream"]) for seg in mm.pool.segments()
                    for b in seg["blocks"] if seg["base"] + b["offset"] == address]

        assert block_at(ptr) == [("allocated", cupy_device)]
        assert mm.stats().in_use_bytes >= 4096
        del p                                     # CuPy's last reference: no gc needed
        assert mm.stats().in_use_bytes == 0
        assert block_at(ptr) == [("free", cupy_device)]
        q = cupy.cuda.alloc(4096)
        assert q.ptr == ptr and q.mem._owner.stream == cupy_device
        del q
    check(mm)


def test_a_hit_runs_no_python_frame(cuda_manager, monkeypatch):
    """A cached request and its drop run no Python code at all once CuPy's queries are C
    callables (as CuPy's are): no frame of gpumem's or anyone's is entered (fake driver)."""
    mm = cuda_manager
    stream = mm.device.create_stream()
    try:
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", itertools.repeat(0).__next__)
        monkeypatch.setattr(cupy.cuda, "get_current_stream",
                            [SimpleNamespace(ptr=stream)].__getitem__)
        alloc = gm_cupy.allocator(mm)
        alloc(1000)                               # the miss (a segment, through Python), dropped
        frames = []

        def profiler(frame, event, arg):
            if event == "call":
                frames.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

        gc.disable()                              # a collection could run others' callbacks
        sys.setprofile(profiler)
        try:
            p = alloc(1000)
            del p
        finally:
            sys.setprofile(None)
            gc.enable()
        assert frames == []
        assert mm.stats().num_allocs == 2 and mm.stats().in_use_bytes == 0
    finally:
        mm.device.destroy_stream(stream)


def test_out_of_memory_is_cupys_error_and_leaves_the_pool_unchanged(cuda_manager,
                                                                     cupy_device):
    """A request beyond the device raises an error CuPy's code catches
    (``cupy.cuda.memory.OutOfMemoryError``, e.g. CuPy's CUB histogram falls back on it) that is
    also gpumem's OutOfMemoryError with its fields; the pool, its cache and its live blocks
    are as before; the error pickles (Dask sends it) with its fields (fake driver)."""
    mm = cuda_manager
    alloc = gm_cupy.allocator(mm)
    held = alloc(MiB)
    alloc(2 * MiB)                                # dropped at once: cached
    before, segments = mm.stats(), mm.pool.segments()
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        alloc(mm.total_memory + MiB)
    err = info.value
    assert isinstance(err, OutOfMemoryError) and isinstance(err, MemoryError)
    assert type(err) is gm_cupy.CupyOutOfMemoryError
    assert err.requested == mm.total_memory + MiB and err.device == "cuda:0"
    assert err._size == err.requested and err._total == err.in_use >= MiB
    assert "out of memory on cuda:0" in str(err)
    after = mm.stats()
    assert mm.pool.segments() == segments
    assert (after.in_use_bytes, after.reserved_bytes, after.active_buffers, after.num_allocs) == \
        (before.in_use_bytes, before.reserved_bytes, before.active_buffers, before.num_allocs)
    assert after.num_ooms == before.num_ooms + 1
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is gm_cupy.CupyOutOfMemoryError and again.requested == err.requested
    assert held.mem._owner.alive
    del held
    check(mm)


def test_sizes_that_are_not_plain_ints_take_the_managers_checks(cuda_manager, cupy_device):
    """A numpy integer is served like an int; a negative size or a bool is refused with
    gpumem's own errors, and no block is taken (fake driver)."""
    alloc = gm_cupy.allocator(cuda_manager)
    p = alloc(np.int64(3000))
    assert p.mem.size == 3000 and p.mem._owner.stream == cupy_device
    with pytest.raises(InvalidInputError, match="nbytes must be >= 0"):
        alloc(-1)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        alloc(True)
    del p
    assert cuda_manager.stats().in_use_bytes == 0


def test_the_shared_manager_of_cupys_device_and_its_replacement(cupy_device):
    """manager=None: requests go to gpumem.get_manager("cuda:0"); once gpumem replaces that
    manager (configure closes the old one), the next request goes to the new one (fake
    driver)."""
    import gpumem
    from gpumem.placement.shared import close_shared_managers
    alloc = gm_cupy.allocator()
    try:
        first = gpumem.get_manager("cuda:0")
        p = alloc(1000)
        assert p.mem._owner.manager is first and alloc.manager is None
        del p
        second = gpumem.configure("cuda:0")
        assert first.closed
        q = alloc(1000)
        assert q.mem._owner.manager is second and second.stats().in_use_bytes >= 1000
        del q
    finally:
        close_shared_managers()


def test_pinned_memory_from_the_cpu_manager():
    """CuPy's PinnedMemoryPointer over a gpumem host Buffer: numpy reads and writes it through
    the pointer's buffer protocol; dropping it returns the block (real)."""
    mm = MemoryManager("cpu", MemoryConfig(**EXACT))
    try:
        p = gm_cupy.pinned_allocator(mm)(4096)
        assert isinstance(p, cupy.cuda.PinnedMemoryPointer)
        assert p.size() == 4096 and p.ptr == p.mem.buffer.ptr
        view = np.frombuffer(p, dtype=np.uint8, count=4096)
        view[:] = 7
        assert p.mem.buffer.copy_to_host().sum() == 7 * 4096
        assert mm.stats().in_use_bytes >= 4096
        del p, view
        gc.collect()
        assert mm.stats().in_use_bytes == 0
        check(mm)
    finally:
        mm.close()


def test_use_gpumem_switches_and_restores_cupys_allocators():
    """As a context manager, CuPy's allocator is gpumem's inside and the previous one after;
    cupy.cuda.alloc_pinned_memory reaches gpumem's "cpu" manager inside the block (real)."""
    host = MemoryManager("cpu", MemoryConfig(**EXACT))
    before = cupy.cuda.get_allocator()
    try:
        with gm_cupy.use_gpumem(pinned_manager=host) as installed:
            assert cupy.cuda.get_allocator() is installed.allocator
            p = cupy.cuda.alloc_pinned_memory(10_000)
            assert isinstance(p.mem, gm_cupy._PinnedBlock)
            assert host.stats().in_use_bytes >= 10_000
            del p
        assert cupy.cuda.get_allocator() is before
        q = cupy.cuda.alloc_pinned_memory(0)          # CuPy's own pool again (no device needed
        assert not isinstance(q.mem, gm_cupy._PinnedBlock)   # for a zero-byte request)
    finally:
        cupy.cuda.set_allocator(before)
        host.close()


def test_managers_of_the_wrong_kind_are_refused(sim_device):
    """A device allocator needs a cuda manager, a pinned one the "cpu" manager (real)."""
    _, mm = sim_manager("64MiB")
    try:
        with pytest.raises(InvalidInputError, match="needs a 'cuda' manager"):
            gm_cupy.allocator(mm)
        with pytest.raises(InvalidInputError, match="needs a 'cpu' manager"):
            gm_cupy.pinned_allocator(mm)
    finally:
        mm.close()
