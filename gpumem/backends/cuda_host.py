"""CUDA beside the device memory: page-locked host memory (the "cpu" backend's pinned buffers
when a driver is present) and NVML's per-process device memory usage. Both reach the driver
only when called."""
from __future__ import annotations

import os
import threading
from typing import Any

from gpumem.backends.cuda_driver import check
from gpumem.errors import InvalidInputError

__all__ = ["pinned_alloc", "pinned_free", "process_memory_usage"]

# --------------------------------------------------------------------------------------------
# Pinned host memory (used by the "cpu" backend when CUDA is present)
# --------------------------------------------------------------------------------------------
_pinned_lock = threading.Lock()
_pinned_ctx: tuple[Any, Any] | None = None      # (driver, primary context of device 0)


def _pinned_context() -> tuple[Any, Any]:
    global _pinned_ctx
    with _pinned_lock:
        if _pinned_ctx is None:
            from gpumem.backends import cuda       # its BACKEND: one driver per process
            drv = cuda.BACKEND._require()
            dev = check(drv, drv.cuDeviceGet(0), "cuDeviceGet")
            ctx = check(drv, drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _pinned_ctx = (drv, ctx)
        return _pinned_ctx


def _with_ctx(drv: Any, ctx: Any, what: str, fn: Any, *args: Any) -> Any:
    check(drv, drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return check(drv, fn(*args), what)
    finally:
        drv.cuCtxPopCurrent()


def pinned_alloc(nbytes: int) -> int:
    """Page-locked host memory from ``cuMemHostAlloc`` (portable across contexts).

    Returns the host address. Raises BackendUnavailableError without CUDA and
    DriverOutOfMemory when the driver cannot lock that much memory.
    """
    if nbytes <= 0:
        raise InvalidInputError(f"pinned allocation size must be positive, got {nbytes}")
    drv, ctx = _pinned_context()
    return int(_with_ctx(drv, ctx, "cuMemHostAlloc", drv.cuMemHostAlloc, nbytes,
                         drv.CU_MEMHOSTALLOC_PORTABLE))


def pinned_free(ptr: int) -> None:
    """Free memory from :func:`pinned_alloc`."""
    drv, ctx = _pinned_context()
    _with_ctx(drv, ctx, "cuMemFreeHost", drv.cuMemFreeHost, ptr)

# --------------------------------------------------------------------------------------------
# NVML: memory used by this process
# --------------------------------------------------------------------------------------------
_NVML_NOT_AVAILABLE = (1 << 64) - 1   # NVML_VALUE_NOT_AVAILABLE for unsigned long long


def process_memory_usage(index: int = 0, *, pid: int | None = None,
                         pci_bus_id: str | None = None) -> int | None:
    """Bytes of device memory NVML attributes to process ``pid`` (default: this one).

    Uses ``cuda.bindings.nvml`` or else ``pynvml``; returns None when neither is importable,
    NVML cannot be loaded, the process is not listed, or the platform does not report per
    process usage (e.g. WDDM on Windows). ``pci_bus_id`` picks the device robustly when
    ``CUDA_VISIBLE_DEVICES`` makes CUDA and NVML indices differ.
    """
    pid = os.getpid() if pid is None else pid
    try:
        return _nvml_bindings_usage(index, pid, pci_bus_id)
    except ImportError:
        pass
    except Exception:
        return None
    try:
        return _pynvml_usage(index, pid, pci_bus_id)
    except Exception:
        return None


def _nvml_bindings_usage(index: int, pid: int, pci_bus_id: str | None) -> int | None:
    from cuda.bindings import nvml
    nvml.init_v2()
    try:
        if pci_bus_id:
            handle = nvml.device_get_handle_by_pci_bus_id_v2(pci_bus_id)
        else:
            handle = nvml.device_get_handle_by_index_v2(index)
        procs = nvml.device_get_compute_running_processes_v3(handle)
        if len(procs) == 0:
            return None
        pids = procs.pid if len(procs) > 1 else [procs.pid]
        used = procs.used_gpu_memory if len(procs) > 1 else [procs.used_gpu_memory]
        return _sum_for_pid(pid, zip(pids, used, strict=True))
    finally:
        nvml.shutdown()


def _pynvml_usage(index: int, pid: int, pci_bus_id: str | None) -> int | None:
    import pynvml  # type: ignore[import-not-found]
    pynvml.nvmlInit()
    try:
        if pci_bus_id:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return _sum_for_pid(pid, ((p.pid, p.usedGpuMemory) for p in procs))
    finally:
        pynvml.nvmlShutdown()


def _sum_for_pid(pid: int, rows: Any) -> int | None:
    total, seen = 0, False
    for p, used in rows:
        if int(p) == pid and used is not None and int(used) != _NVML_NOT_AVAILABLE:
            total += int(used)
            seen = True
    return total if seen else None

