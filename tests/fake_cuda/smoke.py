"""Smoke test: the fake libcuda under the real cuda-python, then under gpumem's CUDA backend.

    python tests/fake_cuda/smoke.py [--python PYTHON]

Builds the fake twice into a temporary folder (with cuGetProcAddress_v2, and without it to
exercise the dlsym() fallback of cuda-bindings 13.0.x), then runs this file as a child process
(``--child MODE``) with the environment from ``fake_cuda.env`` and the repository root as the
working directory and first sys.path entry, so the checkout's gpumem is the one imported.
``--python`` picks the interpreter of the children (another venv, another cuda-bindings).
Prints one OK/FAIL line per check; the exit status is 0 only when every check passed.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NO_GPA_ERROR = "Failed to get cuGetProcAddress_v2"


# ------------------------------------------------------------------------------------------
# Child side
# ------------------------------------------------------------------------------------------
class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, what: str, cond: bool, detail: Any = "") -> bool:
        if cond:
            print(f"OK   {what}", flush=True)
        else:
            self.failed += 1
            print(f"FAIL {what}" + (f": {detail}" if detail != "" else ""), flush=True)
        return cond

    def code(self, what: str, res: Any, expected: str) -> Any:
        """Check a cuda-python result's CUresult by name; return the outputs."""
        code = res[0] if isinstance(res, tuple) else res
        self.check(f"{what} -> {expected}", getattr(code, "name", str(code)) == expected,
                   f"got {code!r}")
        if not isinstance(res, tuple) or len(res) == 1:
            return None
        return res[1] if len(res) == 2 else res[1:]


def cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode()


def fake_helpers() -> ctypes.CDLL:
    sys.path.insert(0, str(REPO / "tests"))
    import fake_cuda
    return fake_cuda.helpers()


def driver_checks(c: Checks, d: Any, total: int) -> None:
    import cuda.bindings
    print(f"INFO cuda-bindings {cuda.bindings.__version__}", flush=True)
    c.code("cuDeviceGetCount before cuInit", d.cuDeviceGetCount(), "CUDA_ERROR_NOT_INITIALIZED")
    c.code("cuInit(0)", d.cuInit(0), "CUDA_SUCCESS")
    fake = fake_helpers()   # after the first driver call: cuda-python has loaded the library
    version = c.code("cuDriverGetVersion", d.cuDriverGetVersion(), "CUDA_SUCCESS")
    c.check("driver version is 13000", version == 13000, version)
    count = c.code("cuDeviceGetCount", d.cuDeviceGetCount(), "CUDA_SUCCESS")
    c.check("one device", count == 1, count)
    dev = c.code("cuDeviceGet(0)", d.cuDeviceGet(0), "CUDA_SUCCESS")
    c.code("cuDeviceGet(1)", d.cuDeviceGet(1), "CUDA_ERROR_INVALID_DEVICE")
    name = cstr(c.code("cuDeviceGetName", d.cuDeviceGetName(64, dev), "CUDA_SUCCESS"))
    c.check(f"device name {name!r}", "fake" in name, name)
    c.check("cuDeviceTotalMem", c.code("cuDeviceTotalMem", d.cuDeviceTotalMem(dev),
                                        "CUDA_SUCCESS") == total)
    A = d.CUdevice_attribute
    for attr, want in ((A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9),
                       (A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
                       (A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 132),
                       (A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, 5120),
                       (A.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1),
                       (A.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1)):
        got = c.code(f"cuDeviceGetAttribute({attr.name})", d.cuDeviceGetAttribute(attr, dev),
                     "CUDA_SUCCESS")
        c.check(f"{attr.name} == {want}", got == want, got)
    c.code("cuDeviceGetAttribute(unknown attribute)",
           d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, dev),
           "CUDA_ERROR_INVALID_VALUE")
    bus = cstr(c.code("cuDeviceGetPCIBusId", d.cuDeviceGetPCIBusId(64, dev), "CUDA_SUCCESS"))
    c.check(f"PCI bus id {bus!r}", bus == "0000:18:00.0", bus)

    # Contexts
    c.code("cuMemAlloc without a context", d.cuMemAlloc(256), "CUDA_ERROR_INVALID_CONTEXT")
    ctx = c.code("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(dev), "CUDA_SUCCESS")
    ctx2 = c.code("cuDevicePrimaryCtxRetain again", d.cuDevicePrimaryCtxRetain(dev),
                  "CUDA_SUCCESS")
    c.check("the primary context is one handle", int(ctx) == int(ctx2) != 0)
    c.check("primary refcount 2", fake.fake_cuda_primary_ctx_refcount(0) == 2)
    c.code("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(dev), "CUDA_SUCCESS")
    cur = c.code("cuCtxGetCurrent (none)", d.cuCtxGetCurrent(), "CUDA_SUCCESS")
    c.check("no current context", cur is None or int(cur) == 0, cur)
    c.code("cuCtxPushCurrent", d.cuCtxPushCurrent(ctx), "CUDA_SUCCESS")
    cur = c.code("cuCtxGetCurrent", d.cuCtxGetCurrent(), "CUDA_SUCCESS")
    c.check("pushed context is current", int(cur) == int(ctx))

    # Memory
    free, tot = c.code("cuMemGetInfo", d.cuMemGetInfo(), "CUDA_SUCCESS")
    c.check("cuMemGetInfo before alloc: free == total", (free, tot) == (total, total), (free, tot))
    n = (1 << 20) + 3
    p = c.code("cuMemAlloc(1 MiB + 3)", d.cuMemAlloc(n), "CUDA_SUCCESS")
    c.check("pointer is 256-byte aligned", int(p) % 256 == 0, hex(int(p)))
    free, tot = d.cuMemGetInfo()[1:]
    c.check("cuMemGetInfo: free = total - allocated", free == total - n, (free, tot))
    pattern = bytes((i * 7 + 3) & 255 for i in range(n))
    c.code("cuMemcpyHtoD", d.cuMemcpyHtoD(p, pattern, n), "CUDA_SUCCESS")
    out = bytearray(n)
    c.code("cuMemcpyDtoH", d.cuMemcpyDtoH(out, p, n), "CUDA_SUCCESS")
    c.check("HtoD/DtoH round trip", bytes(out) == pattern)
    c.code("cuMemcpyHtoD past the end", d.cuMemcpyHtoD(int(p) + n - 10, pattern, 20),
           "CUDA_ERROR_INVALID_VALUE")
    c.code("cuMemcpyDtoH from a non-device address", d.cuMemcpyDtoH(out, 4096, 16),
           "CUDA_ERROR_INVALID_VALUE")
    c.code("cuMemsetD8", d.cuMemsetD8(int(p) + 100, 0xAB, 1000), "CUDA_SUCCESS")
    d.cuMemcpyDtoH(out, p, n)
    c.check("memset wrote exactly its range",
            out[100:1100] == b"\xab" * 1000 and out[:100] == pattern[:100]
            and out[1100:] == pattern[1100:])
    q = c.code("cuMemAlloc(second)", d.cuMemAlloc(4096), "CUDA_SUCCESS")
    c.code("cuMemcpyDtoD", d.cuMemcpyDtoD(q, p, 4096), "CUDA_SUCCESS")
    out2 = bytearray(4096)
    d.cuMemcpyDtoH(out2, q, 4096)
    c.check("DtoD copied", bytes(out2) == bytes(out[:4096]))
    c.check("two live allocations", fake.fake_cuda_live_allocations() == 2)

    # Streams and events
    s = c.code("cuStreamCreate", d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING),
               "CUDA_SUCCESS")
    c.code("cuStreamQuery (idle)", d.cuStreamQuery(s), "CUDA_SUCCESS")
    c.check("fake_cuda_set_stream_busy", fake.fake_cuda_set_stream_busy(int(s), 2) == 0)
    c.code("cuStreamQuery (busy 1/2)", d.cuStreamQuery(s), "CUDA_ERROR_NOT_READY")
    ev = c.code("cuEventCreate", d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                "CUDA_SUCCESS")
    c.code("cuEventRecord on a busy stream", d.cuEventRecord(ev, s), "CUDA_SUCCESS")
    c.code("cuEventQuery (pending)", d.cuEventQuery(ev), "CUDA_ERROR_NOT_READY")
    c.code("cuEventQuery (done)", d.cuEventQuery(ev), "CUDA_SUCCESS")
    c.code("cuStreamQuery (busy 2/2)", d.cuStreamQuery(s), "CUDA_ERROR_NOT_READY")
    c.code("cuStreamQuery (idle again)", d.cuStreamQuery(s), "CUDA_SUCCESS")
    c.code("cuMemcpyHtoDAsync", d.cuMemcpyHtoDAsync(q, pattern, 4096, s), "CUDA_SUCCESS")
    c.code("cuMemsetD8Async", d.cuMemsetD8Async(q, 0, 16, s), "CUDA_SUCCESS")
    c.code("cuMemcpyDtoHAsync", d.cuMemcpyDtoHAsync(out2, q, 4096, s), "CUDA_SUCCESS")
    c.check("async copies ran", bytes(out2) == b"\0" * 16 + pattern[16:4096])
    c.code("cuStreamWaitEvent", d.cuStreamWaitEvent(s, ev, 0), "CUDA_SUCCESS")
    fake.fake_cuda_set_stream_busy(int(s), 5)
    c.code("cuStreamSynchronize", d.cuStreamSynchronize(s), "CUDA_SUCCESS")
    c.code("cuStreamQuery after synchronize", d.cuStreamQuery(s), "CUDA_SUCCESS")
    c.code("cuStreamQuery(default stream)", d.cuStreamQuery(0), "CUDA_SUCCESS")
    c.code("cuEventSynchronize", d.cuEventSynchronize(ev), "CUDA_SUCCESS")
    c.code("cuCtxSynchronize", d.cuCtxSynchronize(), "CUDA_SUCCESS")
    c.code("cuEventDestroy", d.cuEventDestroy(ev), "CUDA_SUCCESS")
    c.code("cuStreamDestroy", d.cuStreamDestroy(s), "CUDA_SUCCESS")
    c.code("cuStreamQuery(destroyed stream)", d.cuStreamQuery(s), "CUDA_ERROR_INVALID_HANDLE")
    c.code("cuEventQuery(destroyed event)", d.cuEventQuery(ev), "CUDA_ERROR_INVALID_HANDLE")

    # Pinned host memory
    h = c.code("cuMemHostAlloc", d.cuMemHostAlloc(8192, d.CU_MEMHOSTALLOC_PORTABLE),
               "CUDA_SUCCESS")
    ctypes.memset(int(h), 0x11, 8192)   # it is real, writable memory
    c.code("cuMemFreeHost", d.cuMemFreeHost(h), "CUDA_SUCCESS")
    c.code("cuMemFreeHost twice", d.cuMemFreeHost(h), "CUDA_ERROR_INVALID_VALUE")

    # Frees, OOM, error names
    c.code("cuMemFree(interior pointer)", d.cuMemFree(int(p) + 256), "CUDA_ERROR_INVALID_VALUE")
    c.code("cuMemFree", d.cuMemFree(p), "CUDA_SUCCESS")
    c.code("cuMemFree(second)", d.cuMemFree(q), "CUDA_SUCCESS")
    c.code("cuMemFree twice (invalid free)", d.cuMemFree(p), "CUDA_ERROR_INVALID_VALUE")
    oom = d.cuMemAlloc(total + 1)
    c.code("cuMemAlloc(total + 1)", oom, "CUDA_ERROR_OUT_OF_MEMORY")
    name = c.code("cuGetErrorName(OOM)", d.cuGetErrorName(oom[0]), "CUDA_SUCCESS")
    c.check("error name", name == b"CUDA_ERROR_OUT_OF_MEMORY", name)
    text = c.code("cuGetErrorString(OOM)", d.cuGetErrorString(oom[0]), "CUDA_SUCCESS")
    c.check("error string", text == b"out of memory", text)
    c.code("cuGetErrorName(an unlisted code)",
           d.cuGetErrorName(d.CUresult.CUDA_ERROR_LAUNCH_FAILED), "CUDA_ERROR_INVALID_VALUE")

    # Threads: the context stack is per thread, the state is shared and locked
    errors: list[str] = []

    def worker() -> None:
        r = d.cuMemAlloc(256)
        if r[0] != d.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            errors.append(f"new thread has a context: {r}")
        d.cuCtxPushCurrent(ctx)
        buf = bytearray(512)
        for i in range(200):
            r, ptr = d.cuMemAlloc(512)
            data = bytes([i & 255]) * 512
            if r != d.CUresult.CUDA_SUCCESS or d.cuMemcpyHtoD(ptr, data, 512)[0] != 0 \
                    or d.cuMemcpyDtoH(buf, ptr, 512)[0] != 0 or bytes(buf) != data \
                    or d.cuMemFree(ptr)[0] != 0:
                errors.append(f"iteration {i} failed")
                break
        d.cuCtxPopCurrent()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.check("8 threads x 200 alloc/copy/free", not errors, errors[:3])
    popped = c.code("cuCtxPopCurrent", d.cuCtxPopCurrent(), "CUDA_SUCCESS")
    c.check("popped the pushed context", int(popped) == int(ctx))
    c.code("cuCtxPopCurrent on an empty stack", d.cuCtxPopCurrent(), "CUDA_ERROR_INVALID_CONTEXT")
    c.code("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(dev), "CUDA_SUCCESS")
    c.code("cuDevicePrimaryCtxRelease (over-release)", d.cuDevicePrimaryCtxRelease(dev),
           "CUDA_ERROR_INVALID_CONTEXT")
    c.code("cuCtxSetCurrent(released primary)", d.cuCtxSetCurrent(ctx), "CUDA_SUCCESS")
    c.code("cuMemAlloc in a released context", d.cuMemAlloc(256),
           "CUDA_ERROR_CONTEXT_IS_DESTROYED")
    d.cuCtxSetCurrent(None)
    leaks = (fake.fake_cuda_live_allocations(), fake.fake_cuda_live_host_allocations(),
             fake.fake_cuda_live_streams(), fake.fake_cuda_live_events())
    c.check("no leaks (allocations, host allocations, streams, events)", leaks == (0, 0, 0, 0),
            leaks)


def gpumem_checks(c: Checks, total: int) -> None:
    from gpumem import MemoryConfig, MemoryManager
    from gpumem.backends.cuda import CudaBackend, pinned_alloc, pinned_free
    from gpumem.errors import DriverOutOfMemory, InvalidInputError

    fake = fake_helpers()
    b = CudaBackend()
    ok, reason = b.availability()
    if not c.check("CudaBackend.availability()", ok, reason):
        return
    c.check("device_count() == 1", b.device_count() == 1, b.device_count())
    print(f"INFO gpumem drives it through {type(b.driver).__module__}.{type(b.driver).__name__}"
          f" (GPUMEM_CUDA_NATIVE={os.environ.get('GPUMEM_CUDA_NATIVE', 'unset')})", flush=True)
    print(f"INFO device_names() = {b.device_names()}", flush=True)
    dev = b.open(0)
    props = dev.properties()
    extra = props.extra
    c.check("properties: total_memory", props.total_memory == total, props.total_memory)
    c.check("properties: compute capability (9, 0)", extra.get("compute_capability") == (9, 0),
            extra.get("compute_capability"))
    c.check("properties: 132 SMs", extra.get("multiprocessor_count") == 132, extra)
    c.check("properties: pci bus id", extra.get("pci_bus_id") == "0000:18:00.0", extra)
    c.check("properties: driver 13.0", extra.get("driver_version") == "13.0", extra)
    free, tot = dev.mem_get_info()
    c.check("mem_get_info", (free, tot) == (total, total), (free, tot))

    h, _ = dev.alloc_segment(1 << 20)
    c.check("alloc_segment(1 MiB) aligned", h % 256 == 0, hex(h))
    c.check("mem_get_info after alloc", dev.mem_get_info()[0] == total - (1 << 20))
    pattern = bytes((i * 13 + 1) & 255 for i in range(4096))
    dev.copy_from_host(h, 512, memoryview(pattern))
    out = bytearray(4096)
    dev.copy_to_host(h, 512, memoryview(out))
    c.check("copy_from_host / copy_to_host round trip", bytes(out) == pattern)
    dev.memset(h, 512, 0x5A, 100)
    dev.copy_to_host(h, 512, memoryview(out))
    c.check("memset", out[:100] == b"\x5a" * 100 and out[100:] == pattern[100:])
    try:
        dev.copy_from_host(h, (1 << 20) - 10, memoryview(pattern))
        c.check("copy past the segment end is refused", False, "no exception")
    except Exception as exc:
        c.check(f"copy past the segment end is refused ({type(exc).__name__})", True)

    stream = dev.create_stream()
    c.check("create_stream / stream_idle", dev.stream_idle(stream))
    fake.fake_cuda_set_stream_busy(stream, 2)
    seen = [dev.stream_idle(stream) for _ in range(3)]
    c.check("stream_idle sees a busy stream", seen == [False, False, True], seen)
    fake.fake_cuda_set_stream_busy(stream, 1)
    ev = dev.record_event(stream)
    seen = [dev.event_done(ev) for _ in range(2)]
    c.check("event_done sees a pending event", seen == [False, True], seen)
    dev.destroy_event(ev)
    dev.copy_from_host(h, 0, memoryview(pattern), stream=stream)
    dev.copy_to_host(h, 0, memoryview(out), stream=stream)
    c.check("copies on a created stream", bytes(out) == pattern)
    ev0 = dev.record_event(0)
    c.check("record_event on the default stream", dev.event_done(ev0))
    dev.destroy_event(ev0)
    dev.synchronize()
    dev.destroy_stream(stream)
    c.check("native_stream(0) == 0", dev.native_stream(0) == 0)

    try:
        dev.alloc_segment(total + 1)
        c.check("alloc_segment(total + 1) raises DriverOutOfMemory", False, "no exception")
    except DriverOutOfMemory as exc:
        c.check("alloc_segment(total + 1) raises DriverOutOfMemory",
                exc.code_name == "CUDA_ERROR_OUT_OF_MEMORY", exc.code_name)
        print(f"INFO {exc}", flush=True)
    dev.free_segment(h)
    try:
        dev.free_segment(h)
        c.check("double free_segment is refused", False, "no exception")
    except InvalidInputError:
        c.check("double free_segment is refused", True)
    h2, _ = dev.alloc_segment(4096)   # left for close() to free
    dev.close()
    leaks = (fake.fake_cuda_live_allocations(), fake.fake_cuda_live_streams(),
             fake.fake_cuda_live_events())
    c.check("close() freed everything", leaks == (0, 0, 0), leaks)
    c.check("close() released the primary context", fake.fake_cuda_primary_ctx_refcount(0) == 0,
            fake.fake_cuda_primary_ctx_refcount(0))

    cfg = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False,
                       track_allocations=False)
    mm = MemoryManager("cuda:0", cfg)
    buf = mm.malloc(100_000)
    buf.copy_from_host(pattern)
    back = bytes(buf.copy_to_host())
    c.check("MemoryManager('cuda:0') malloc/copy round trip", back[:4096] == pattern, len(back))
    buf.free()
    mm.close()
    c.check("MemoryManager.close() left no allocation", fake.fake_cuda_live_allocations() == 0,
            fake.fake_cuda_live_allocations())

    ptr = pinned_alloc(1 << 16)
    ctypes.memset(ptr, 0x22, 1 << 16)
    pinned_free(ptr)
    c.check("pinned_alloc / pinned_free", fake.fake_cuda_live_host_allocations() == 0)


def child(mode: str) -> int:
    c = Checks()
    total = int(os.environ.get("SMOKE_TOTAL_MEM", "0"))
    if mode == "nodevice":
        from cuda.bindings import driver as d
        c.code("cuInit with FAKE_CUDA_NO_DEVICE=1", d.cuInit(0), "CUDA_ERROR_NO_DEVICE")
        c.code("cuDeviceGetCount", d.cuDeviceGetCount(), "CUDA_ERROR_NOT_INITIALIZED")
        from gpumem.backends.cuda import CudaBackend
        ok, reason = CudaBackend().availability()
        c.check(f"CudaBackend unavailable ({reason})", not ok and "no CUDA device" in reason)
    elif mode == "multi":
        from cuda.bindings import driver as d
        d.cuInit(0)
        c.check("FAKE_CUDA_DEVICE_COUNT=2", d.cuDeviceGetCount()[1] == 2)
        from gpumem.backends.cuda import CudaBackend
        b = CudaBackend()
        dev0, dev1 = b.open(0), b.open(1)
        h, _ = dev1.alloc_segment(1 << 20)
        c.check("allocation counted on its own device",
                dev0.mem_get_info()[0] == total and dev1.mem_get_info()[0] == total - (1 << 20))
        c.check("distinct PCI bus ids", dev0.properties().extra["pci_bus_id"]
                != dev1.properties().extra["pci_bus_id"])
        dev0.close()
        dev1.close()
        c.check("no leaks", fake_helpers().fake_cuda_live_allocations() == 0)
    elif mode == "gpumem":
        gpumem_checks(c, total)
    else:
        from cuda.bindings import driver as d
        driver_checks(c, d, total)
        if mode == "main":
            gpumem_checks(c, total)
    print(f"{'PASSED' if not c.failed else 'FAILED'} ({c.failed} failed)", flush=True)
    return 1 if c.failed else 0


# ------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------
def run_child(python: str, mode: str, environ: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", mode], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))   # the checkout's gpumem, not an installed copy
        return child(args.child)

    sys.path.insert(0, str(REPO / "tests"))
    import fake_cuda
    total = 1 << 30
    failed = False
    with tempfile.TemporaryDirectory(prefix="fake_cuda_") as tmp:
        gpa = fake_cuda.build(Path(tmp) / "gpa")
        dls = fake_cuda.build(Path(tmp) / "dlsym", get_proc_address=False)
        print(f"built {gpa} and {dls} (without cuGetProcAddress_v2)")
        runs = [
            ("main", gpa, dict(FAKE_CUDA_TOTAL_MEM="1G")),
            ("gpumem", gpa, dict(FAKE_CUDA_TOTAL_MEM="1G", GPUMEM_CUDA_NATIVE="0")),
            ("driver", dls, dict(FAKE_CUDA_TOTAL_MEM="1G")),
            ("nodevice", gpa, dict(FAKE_CUDA_NO_DEVICE="1")),
            ("multi", gpa, dict(FAKE_CUDA_DEVICE_COUNT="2", FAKE_CUDA_TOTAL_MEM="1G")),
        ]
        for mode, lib, extra in runs:
            label = f"{mode} ({'dlsym path' if lib == dls else 'cuGetProcAddress_v2 path'})"
            print(f"=== {label}")
            rc, out = run_child(args.python, mode,
                                fake_cuda.env(lib.parent, SMOKE_TOTAL_MEM=str(total), **extra))
            if lib == dls and rc != 0 and NO_GPA_ERROR in out:
                print(f"INFO this cuda-bindings requires cuGetProcAddress_v2 ({NO_GPA_ERROR!r});"
                      f" the dlsym path is not available to it")
                continue
            print(out.rstrip())
            if rc != 0:
                failed = True
                print(f"=== {label}: exit status {rc}")
    print("ALL CHECKS PASSED" if not failed else "SOME CHECKS FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
