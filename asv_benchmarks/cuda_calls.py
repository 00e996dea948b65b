"""Cost of the CUDA calls gpumem makes on a miss, a copy or an event: gpumem's Cython module
(cuda.bindings.cydriver, GIL released) against cuda-python's Python-level cuda.bindings.driver,
in one process, on whatever libcuda.so.1 is loaded.

    python asv_benchmarks/cuda_calls.py            # on a GPU: binding + real driver cost
    LD_LIBRARY_PATH=build/fake_cuda python asv_benchmarks/cuda_calls.py
                                                   # on tests/fake_cuda: the binding cost alone

Each figure is the median over 15 repeats of (time of k calls) / k, in ns; ratio = Python-level /
Cython (above 1: the Cython module is faster).
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gpumem
REPEATS = 15


def per_call_ns(fn: Callable[[int], None], k: int) -> float:
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter_ns()
        fn(k)
        samples.append((time.perf_counter_ns() - t0) / k)
    return statistics.median(samples)


def workloads(drv: Any, stream: Any) -> dict[str, Callable[[int], None]]:
    flags = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    host_buf = (ctypes.c_char * 4096)()
    host = ctypes.addressof(host_buf)            # gpumem passes host addresses as ints

    def alloc_free(k: int) -> None:
        for _ in range(k):
            drv.cuMemFree(drv.cuMemAlloc(4096)[1])

    def event_cycle(k: int) -> None:
        for _ in range(k):
            ev = drv.cuEventCreate(flags)[1]
            drv.cuEventRecord(ev, stream)
            drv.cuEventQuery(ev)
            drv.cuEventDestroy(ev)

    def ctx_current(k: int) -> None:
        for _ in range(k):
            drv.cuCtxGetCurrent()

    ptr = drv.cuMemAlloc(4096)[1]

    def copy_4k(k: int) -> None:
        for _ in range(k):
            drv.cuMemcpyHtoDAsync(ptr, host, 4096, stream)
            drv.cuStreamSynchronize(stream)

    return {"cuMemAlloc+cuMemFree (4 KiB)": alloc_free,
            "event create+record+query+destroy": event_cycle,
            "cuCtxGetCurrent": ctx_current,
            "cuMemcpyHtoDAsync+cuStreamSynchronize (4 KiB)": copy_4k}


def main() -> int:
    try:
        from cuda.bindings import driver
        from gpumem.backends._cuda_native import NativeDriver
    except ImportError as exc:
        print(f"skipped: {exc}")
        return 0
    from gpumem.backends.cuda import check
    if int(driver.cuInit(0)[0]) != 0:
        print("skipped: no CUDA driver (cuInit failed)")
        return 0
    dev = check(driver, driver.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(driver, driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    name = check(driver, driver.cuDeviceGetName(128, dev), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode()
    print(f"device: {name}; python {sys.version.split()[0]}")
    stream = check(driver, driver.cuStreamCreate(1), "cuStreamCreate")
    native = NativeDriver(driver)
    py_runs = workloads(driver, stream)
    cy_runs = workloads(native, stream)
    print(f"{'call':48} {'python-level ns':>16} {'cython ns':>10} {'ratio':>6}")
    for what in py_runs:
        k = 2000
        py_runs[what](200)                      # warm both
        cy_runs[what](200)
        py = per_call_ns(py_runs[what], k)
        cy = per_call_ns(cy_runs[what], k)
        print(f"{what:48} {py:16.0f} {cy:10.0f} {py / cy:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
