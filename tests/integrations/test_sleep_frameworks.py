"""Sleep and wake through the framework bridges (docs/sleep_and_wake.md, issue 40).

Level: **real** for the torch bridge's C entry points on a simulated device (driven through
ctypes as ``CUDAPluggableAllocator`` calls them: torch itself is not needed), and **GPU** for a
real torch process (2 GiB of tensors and a CUDA graph across sleep and wake) and CuPy arrays:
those run only where torch or CuPy and a CUDA device are present, and skip elsewhere.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.integrations import torch as gm_torch
from invariants import EXACT

MiB = 1 << 20
DEV = 0


@pytest.fixture
def bound():
    """A manager on a host-backed sim device, bound to torch device 0; unbound and closed
    afterwards."""
    dev = gpumem_sim.SimDevice("1GiB", back_memory=True)
    gpumem_sim.install(dev)
    mm = MemoryManager("sim:0", MemoryConfig(**EXACT))
    gm_torch.bind(mm, DEV)
    so = ctypes.CDLL(gm_torch.library_path())
    so.gpumem_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    so.gpumem_torch_alloc.restype = ctypes.c_void_p
    so.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                     ctypes.c_void_p]
    so.gpumem_torch_free.restype = None
    yield dev, mm, so
    native = gm_torch._native()
    assert native.live_blocks(DEV) == 0
    native.unbind(DEV)
    mm.close()
    gpumem_sim.uninstall()


def test_torch_entry_points_inside_region_sleep_and_wake(bound):
    """Real: what torch allocates in a region's thread carries the region's tag (the bridge's
    "torch" label gives way), sleeps and wakes at the same pointer, and torch's free returns it;
    outside the region torch's requests stay in the manager's own pool."""
    dev, mm, so = bound
    with gm_torch.region("weights", device=DEV):
        ptr = so.gpumem_torch_alloc(64 * MiB, DEV, None)
    plain = so.gpumem_torch_alloc(8 * MiB, DEV, None)
    assert ptr and plain
    (state,) = mm.sleeping_tags()
    assert state["tag"] == "weights" and state["in_use_bytes"] >= 64 * MiB
    data = bytes(range(256)) * 1024
    tag_pool = mm._tag_pools._pools["weights"]
    (seg,) = [s for s in tag_pool.pool.segments() if s["base"] <= ptr < s["base"] + s["size"]]
    dev.copy_from_host(seg["handle"], ptr - seg["base"], memoryview(data))
    free_before = dev.mem_get_info()[0]
    assert gm_torch.sleep("weights", device=DEV) >= 64 * MiB
    assert dev.mem_get_info()[0] - free_before >= 64 * MiB
    assert gm_torch.wake(device=DEV) >= 64 * MiB
    back = bytearray(len(data))
    dev.copy_to_host(seg["handle"], ptr - seg["base"], memoryview(back))
    assert bytes(back) == data                      # restored at the same pointer
    so.gpumem_torch_free(ptr, 64 * MiB, DEV, None)
    so.gpumem_torch_free(plain, 8 * MiB, DEV, None)
    assert mm.stats().in_use_bytes == 0


def _cuda_present() -> bool:
    try:
        from gpumem.backends import cuda
        ok, _ = cuda.BACKEND.availability()
    except Exception:
        return False
    from invariants import libcuda_is_fake
    return ok and libcuda_is_fake() is False


TORCH_SCRIPT = textwrap.dedent("""
    import torch
    import gpumem.integrations.torch as gm_torch
    GiB = 1 << 30
    gm_torch.use_gpumem()
    with gm_torch.region("weights"):
        w = torch.arange(GiB // 4, dtype=torch.float32, device="cuda")     # 1 GiB
        lin = torch.nn.Linear(1024, 1024).cuda()
    with gm_torch.region("kv"):
        kv = torch.ones(GiB // 4, dtype=torch.float32, device="cuda")      # 1 GiB
    x = torch.randn(16, 1024, device="cuda")
    static_out = torch.empty(16, 1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out.copy_(lin(x))
    torch.cuda.synchronize()
    expect = lin(x).clone()
    ptrs = (w.data_ptr(), kv.data_ptr(), lin.weight.data_ptr())
    wsum = float(w[::4096].sum())
    free0, _ = torch.cuda.mem_get_info()
    released = gm_torch.sleep(["weights", "kv"], backup=["weights"])
    free1, _ = torch.cuda.mem_get_info()
    assert free1 - free0 >= 1.9 * GiB, (free0, free1, released)
    gm_torch.wake()
    assert (w.data_ptr(), kv.data_ptr(), lin.weight.data_ptr()) == ptrs
    assert float(w[::4096].sum()) == wsum
    kv.fill_(2.0)
    assert float(kv[-1]) == 2.0
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(static_out, expect), "the graph replayed wrong after wake"
    print("OK", released)
""")


def test_torch_tensors_and_graph_across_sleep_and_wake_on_a_gpu(tmp_path):
    """GPU: 2 GiB of torch tensors keep data_ptr() and content across sleep and wake,
    torch.cuda.mem_get_info() shows the memory free while asleep, and a CUDA graph captured
    before sleep replays correctly after wake (a fresh process: torch's allocator is set once)."""
    pytest.importorskip("torch", reason="torch is not installed")
    if not _cuda_present():
        pytest.skip("needs a CUDA GPU with the real driver")
    script = tmp_path / "torch_sleep.py"
    script.write_text(TORCH_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, env={**os.environ})
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_cupy_arrays_across_sleep_and_wake_on_a_gpu():
    """GPU: CuPy arrays made in a region keep their pointer and content across sleep and
    wake."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    if not _cuda_present():
        pytest.skip("needs a CUDA GPU with the real driver")
    from gpumem.integrations import cupy as gm_cupy
    mm = MemoryManager("cuda:0", MemoryConfig(**EXACT))
    try:
        with gm_cupy.use_gpumem(mm):
            with mm.region("weights"):
                a = cupy.arange(64 << 20, dtype=cupy.float32)
            ptr, total = a.data.ptr, float(a[::1024].sum())
            assert mm.sleep("weights") >= a.nbytes
            mm.wake()
            assert a.data.ptr == ptr and float(a[::1024].sum()) == total
            del a
    finally:
        mm.close()
