"""Numba's own CUDA driver layer (numba-cuda, over cuda.core and cuda.bindings) on the fake
libcuda.so.1, allocating through gpumem's EMM plugin. Run by tests/integrations/test_numba_plugin.py in a
child process whose LD_LIBRARY_PATH points at the fake; prints ``PASS <name>`` per check and
exits non-zero at the first failure (with the traceback).

What it proves: Numba's context creation, memory-manager plumbing, array allocation, host<->
device copies and finalizers run unchanged with the plugin, and gpumem's pool, stats and
tracking see every byte. It cannot run a kernel (the fake does not model cuModuleLoadData /
cuLaunchKernel) and it does not prove anything about a GPU.
"""
from __future__ import annotations

import gc
import os
import sys
import traceback

import numpy as np

import gpumem
from gpumem import MemoryConfig, MemoryManager
from gpumem.integrations import numba as gm_numba

MiB = 1 << 20


def main() -> int:
    mm = MemoryManager("cuda:0", MemoryConfig(track_allocations=True, cpu_fallback_enabled=False,
                                              min_free_bytes=0))
    plugin = gm_numba.use_gpumem(mm)
    from numba import cuda

    checks = []

    def check(fn):
        checks.append(fn)
        return fn

    @check
    def plugin_is_numbas_memory_manager():
        mgr = cuda.current_context().memory_manager
        assert type(mgr) is plugin and mgr.interface_version == 1
        assert mgr.manager is mm

    @check
    def to_device_and_back():
        host = np.arange(250_000, dtype=np.float32)
        before = mm.stats().in_use_bytes
        d = cuda.to_device(host)
        assert mm.stats().in_use_bytes >= before + host.nbytes
        assert mm.tracker.by_tag()["numba"][1] >= host.nbytes
        assert np.array_equal(d.copy_to_host(), host)
        del d
        gc.collect()
        assert mm.stats().in_use_bytes == before

    @check
    def device_array_is_pooled():
        a = cuda.device_array((512, 512), dtype=np.float64)       # 2 MiB
        ptr = a.device_ctypes_pointer.value
        assert any(m.nbytes == a.nbytes for m in mm.tracker.live())
        del a
        gc.collect()
        hits = mm.stats().pool_hits
        b = cuda.device_array((512, 512), dtype=np.float64)
        assert b.device_ctypes_pointer.value == ptr and mm.stats().pool_hits == hits + 1
        b.copy_to_device(np.ones((512, 512)))
        assert b.copy_to_host().sum() == 512 * 512

    @check
    def defer_cleanup_holds_frees_back():
        before = mm.stats().in_use_bytes
        with cuda.defer_cleanup():
            a = cuda.device_array(MiB, dtype=np.uint8)
            del a
            gc.collect()
            assert mm.stats().in_use_bytes > before          # not yet returned
        assert mm.stats().in_use_bytes == before

    @check
    def memory_info_comes_from_the_manager():
        info = cuda.current_context().get_memory_info()
        assert info.total == mm.total_memory
        assert 0 < info.free <= mm.hold_limit - mm.stats().in_use_bytes

    @check
    def out_of_memory_is_gpumems_error():
        try:
            cuda.device_array(mm.total_memory + MiB, dtype=np.uint8)
        except gpumem.OutOfMemoryError as exc:
            assert "exceeds the device's total memory" in str(exc)
        else:
            raise AssertionError("no OutOfMemoryError")

    @check
    def reset_returns_everything_and_empties_the_cache():
        keep = cuda.device_array(3 * MiB, dtype=np.uint8)
        assert mm.stats().in_use_bytes >= 3 * MiB
        cuda.current_context().memory_manager.reset()
        stats = mm.stats()
        assert stats.in_use_bytes == 0 and stats.reserved_bytes == 0, stats
        del keep
        gc.collect()                                   # its finalizer finds nothing to free
        assert mm.stats().num_frees == stats.num_frees

    for fn in checks:
        try:
            fn()
        except Exception:
            traceback.print_exc()
            print(f"FAIL {fn.__name__}", flush=True)
            return 1
        print(f"PASS {fn.__name__}", flush=True)
    mm.close()
    return 0


def env_var_main() -> int:
    """NUMBA_CUDA_MEMORY_MANAGER=gpumem.integrations.numba: Numba imports the module itself and
    its contexts allocate from gpumem.get_manager("cuda:N")."""
    from numba import cuda
    d = cuda.to_device(np.arange(10, dtype=np.int64))
    mgr = cuda.current_context().memory_manager
    assert type(mgr).__name__ == "GpumemNumbaManager", type(mgr)
    assert mgr.manager is gpumem.get_manager("cuda:0")
    assert mgr.manager.stats().in_use_bytes > 0
    assert d.copy_to_host().tolist() == list(range(10))
    print("PASS env_var", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(env_var_main() if os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") else main())
