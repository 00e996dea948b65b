"""CuPy allocates through gpumem (gpumem/integrations/cupy.py).

CuPy's CUDA runtime cannot start without a GPU (and cannot run on tests/fake_cuda: libcudart
needs driver internals the fake does not have), so no CuPy array is made here. What runs:
- **real** (CuPy's own classes, no device): pinned host memory from gpumem's "cpu" manager as
  ``cupy.cuda.PinnedMemoryPointer``, read and written through numpy; ``cupy.cuda.alloc_pinned_memory``
  reaching gpumem after ``use_gpumem()``; ``set_allocator``/``get_allocator`` switched and
  restored; bad managers refused.
- **fake driver** (GPUMEM_TEST_BACKENDS=cuda on tests/fake_cuda): the device allocator gives
  CuPy's real ``MemoryPointer(UnownedMemory(...))`` over a CUDA segment of the fake, on CuPy's
  current stream, freed when CuPy drops it. CuPy's two device queries (``runtime.getDevice``,
  ``get_current_stream``) are replaced by the test, since CuPy's runtime cannot start here.
CuPy arrays on a GPU are in ci/gpu.sh. Every test skips where CuPy is not installed (it is not
in CI's extras: the wheel is about 200 MB).
"""
from __future__ import annotations

import gc
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
    """Host memory cannot back a CuPy array: a request the device cannot serve raises gpumem's
    OutOfMemoryError and leaves no fallback buffer behind."""
    total = cuda_manager.total_memory
    mm = MemoryManager("cuda:0", MemoryConfig(**{**EXACT, "cpu_fallback_enabled": True,
                                                 "gpu_memory_fraction": 16 * MiB / total}))
    try:
        with pytest.raises(OutOfMemoryError):
            gm_cupy.allocator(mm)(32 * MiB)
        stats = mm.stats()
        assert stats.cpu_fallbacks == 1 and stats.active_buffers == 0
    finally:
        mm.close()


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
