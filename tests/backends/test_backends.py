"""Conformance tests of the real backends (cpu, opencl, cuda) against the backend protocol.

``GPUMEM_TEST_BACKENDS`` (comma list) picks the backends; names other than cpu/opencl/cuda
(e.g. ``sim``, tested by its own files) are ignored here. By default every one of the three is
tried and an unavailable one is skipped with its reason.

Besides the real backends, the same suite always runs on ``cuda-fake``: the CUDA backend code
driving an in-test fake of the cuda-python driver module (host memory, a per-thread context
stack that rejects calls without a current context, real CUresult codes). It checks this
module's own logic (return-code mapping, context push/pop, streams, bookkeeping) where no GPU
is present; it proves nothing about the real driver.
"""
from __future__ import annotations

import ctypes
import enum
import os
import random
import sys
import threading
import time
from typing import Any

import pytest

from gpumem.backends import open_device
from gpumem.backends import cuda as cuda_mod
from gpumem.backends import cuda_host
from gpumem.backends import host as host_mod
from gpumem.backends import opencl as opencl_mod
from gpumem.backends.base import DeviceProperties
from gpumem.errors import (BackendUnavailableError, DriverError, DriverOutOfMemory,
                           InvalidDeviceError, InvalidInputError)
from invariants import check, run_threads, selected_backends

REAL = ("cpu", "opencl", "cuda")
MODULES = {"cpu": host_mod, "opencl": opencl_mod, "cuda": cuda_mod}
MiB = 1 << 20


def _selected() -> list[str]:
    """The real backends among GPUMEM_TEST_BACKENDS (unset: all three)."""
    return [n for n in selected_backends() if n in REAL]


# --------------------------------------------------------------------------------------------
# A fake cuda-python driver module (for "cuda-fake")
# --------------------------------------------------------------------------------------------
class FakeCUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_LAUNCH_FAILED = 719


class FakeAttr(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class FakeStreamFlags(enum.IntEnum):
    CU_STREAM_NON_BLOCKING = 1


class _Handle:
    """Stands for CUdevice / CUcontext / CUstream / CUdeviceptr: an int-convertible handle."""

    def __init__(self, value: int = 0) -> None:
        self.value = int(value)

    def __int__(self) -> int:
        return self.value


class FakeDriver:
    CUresult = FakeCUresult
    CUdevice_attribute = FakeAttr
    CUstream_flags = FakeStreamFlags
    CU_MEMHOSTALLOC_PORTABLE = 1
    CUstream = _Handle

    def __init__(self, devices: int = 2, capacity: int = 512 * MiB, init_error: Any = None,
                 ) -> None:
        self.devices = devices
        self.capacity = capacity
        self.init_error = init_error
        self.used = [0] * devices
        self.allocs: dict[int, tuple[int, int, object]] = {}   # ptr -> (device, size, backing)
        self.host_allocs: dict[int, object] = {}
        self.refcount = [0] * devices
        self.streams: dict[int, int] = {}        # stream id -> device
        self.not_ready: dict[int, int] = {}      # stream id -> queries left answering NOT_READY
        self._next_stream = 0x5000
        self._tls = threading.local()
        self.lock = threading.Lock()
        self.fail_next: FakeCUresult | None = None

    # context stack, per thread like the real driver
    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def _cur(self) -> int | None:
        st = self._stack()
        return st[-1] - 1 if st and st[-1] else None     # context value = device + 1

    def _needs_ctx(self) -> tuple[FakeCUresult, int] | None:
        dev = self._cur()
        if dev is None:
            return None
        return FakeCUresult.CUDA_SUCCESS, dev

    def _find(self, ptr: int, n: int) -> bool:
        for base, (_d, size, _b) in self.allocs.items():
            if base <= ptr and ptr + n <= base + size:
                return True
        for base, buf in self.host_allocs.items():
            if base <= ptr and ptr + n <= base + ctypes.sizeof(buf):
                return True
        return False

    def cuInit(self, flags):
        if self.init_error is not None:
            if isinstance(self.init_error, BaseException):
                raise self.init_error
            return (self.init_error,)
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuDeviceGetCount(self):
        return FakeCUresult.CUDA_SUCCESS, self.devices

    def cuDeviceGet(self, i):
        if not 0 <= i < self.devices:
            return FakeCUresult.CUDA_ERROR_INVALID_DEVICE, None
        return FakeCUresult.CUDA_SUCCESS, _Handle(i)

    def cuDevicePrimaryCtxRetain(self, dev):
        self.refcount[int(dev)] += 1
        return FakeCUresult.CUDA_SUCCESS, _Handle(int(dev) + 1)

    def cuDevicePrimaryCtxRelease(self, dev):
        self.refcount[int(dev)] -= 1
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuCtxGetCurrent(self):
        st = self._stack()
        return FakeCUresult.CUDA_SUCCESS, _Handle(st[-1] if st else 0)

    def cuCtxPushCurrent(self, ctx):
        self._stack().append(int(ctx))
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        st = self._stack()
        if not st:
            return FakeCUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return FakeCUresult.CUDA_SUCCESS, _Handle(st.pop())

    def cuGetErrorName(self, code):
        return FakeCUresult.CUDA_SUCCESS, FakeCUresult(int(code)).name.encode()

    def cuGetErrorString(self, code):
        return FakeCUresult.CUDA_SUCCESS, b"fake driver message"

    def cuDeviceGetName(self, length, dev):
        return FakeCUresult.CUDA_SUCCESS, b"Fake GPU " + str(int(dev)).encode() + b"\0\0\0"

    def cuDeviceTotalMem(self, dev):
        return FakeCUresult.CUDA_SUCCESS, self.capacity

    def cuDeviceGetAttribute(self, attr, dev):
        values = {FakeAttr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
                  FakeAttr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                  FakeAttr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
                  FakeAttr.CU_DEVICE_ATTRIBUTE_CLOCK_RATE: 1_980_000,
                  FakeAttr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: 5120}
        return FakeCUresult.CUDA_SUCCESS, values[attr]

    def cuDeviceGetPCIBusId(self, length, dev):
        return FakeCUresult.CUDA_SUCCESS, b"0000:0%d:00.0\0" % int(dev)

    def cuDriverGetVersion(self):
        return FakeCUresult.CUDA_SUCCESS, 13000

    def cuMemGetInfo(self):
        ok = self._needs_ctx()
        if ok is None:
            return FakeCUresult.CUDA_ERROR_INVALID_CONTEXT, None, None
        dev = ok[1]
        return FakeCUresult.CUDA_SUCCESS, self.capacity - self.used[dev], self.capacity

    def cuMemAlloc(self, n):
        ok = self._needs_ctx()
        if ok is None:
            return FakeCUresult.CUDA_ERROR_INVALID_CONTEXT, None
        dev = ok[1]
        if self.fail_next is not None:
            code, self.fail_next = self.fail_next, None
            return code, None
        with self.lock:
            if self.used[dev] + n > self.capacity:
                return FakeCUresult.CUDA_ERROR_OUT_OF_MEMORY, None
            self.used[dev] += n
        backing = (ctypes.c_ubyte * (n + 256))()
        ptr = -(-ctypes.addressof(backing) // 256) * 256      # 256-aligned like cuMemAlloc
        with self.lock:
            self.allocs[ptr] = (dev, n, backing)
        return FakeCUresult.CUDA_SUCCESS, _Handle(ptr)

    def cuMemFree(self, ptr):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if self.fail_next is not None:
            code, self.fail_next = self.fail_next, None
            return (code,)
        with self.lock:
            entry = self.allocs.pop(int(ptr), None)
            if entry is None:
                return (FakeCUresult.CUDA_ERROR_INVALID_VALUE,)
            self.used[entry[0]] -= entry[1]
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuMemHostAlloc(self, n, flags):
        if self._needs_ctx() is None:
            return FakeCUresult.CUDA_ERROR_INVALID_CONTEXT, None
        if self.fail_next is not None:
            code, self.fail_next = self.fail_next, None
            return code, None
        buf = (ctypes.c_ubyte * n)()
        self.host_allocs[ctypes.addressof(buf)] = buf
        return FakeCUresult.CUDA_SUCCESS, ctypes.addressof(buf)

    def cuMemFreeHost(self, p):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if self.host_allocs.pop(int(p), None) is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_VALUE,)
        return (FakeCUresult.CUDA_SUCCESS,)

    def _stream_ok(self, s) -> bool:
        return int(s) == 0 or int(s) in self.streams

    def _copy(self, dst, src, n, stream):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if not self._stream_ok(stream):
            return (FakeCUresult.CUDA_ERROR_INVALID_HANDLE,)
        ctypes.memmove(int(dst), int(src), n)
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        if not self._find(int(dst), n):
            return (FakeCUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._copy(dst, src, n, stream)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        if not self._find(int(src), n):
            return (FakeCUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._copy(dst, src, n, stream)

    def cuMemsetD8Async(self, dst, value, n, stream):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if not self._find(int(dst), n) or not self._stream_ok(stream):
            return (FakeCUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memset(int(dst), value, n)
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuStreamCreate(self, flags):
        if self._needs_ctx() is None:
            return FakeCUresult.CUDA_ERROR_INVALID_CONTEXT, None
        with self.lock:
            self._next_stream += 0x40
            sid = self._next_stream
            self.streams[sid] = self._cur()
        return FakeCUresult.CUDA_SUCCESS, _Handle(sid)

    def cuStreamDestroy(self, s):
        if self.streams.pop(int(s), None) is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuStreamQuery(self, s):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if not self._stream_ok(s):
            return (FakeCUresult.CUDA_ERROR_INVALID_HANDLE,)
        left = self.not_ready.get(int(s), 0)
        if left:
            self.not_ready[int(s)] = left - 1
            return (FakeCUresult.CUDA_ERROR_NOT_READY,)
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuStreamSynchronize(self, s):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if not self._stream_ok(s):
            return (FakeCUresult.CUDA_ERROR_INVALID_HANDLE,)
        self.not_ready.pop(int(s), None)
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuCtxSynchronize(self):
        if self._needs_ctx() is None:
            return (FakeCUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.not_ready.clear()
        return (FakeCUresult.CUDA_SUCCESS,)


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------
def _backend(name: str) -> Any:
    if name == "cuda-fake":
        return cuda_mod.CudaBackend(driver=FakeDriver())
    return MODULES[name].BACKEND


@pytest.fixture(params=_selected() + ["cuda-fake"])
def backend(request):
    be = _backend(request.param)
    ok, reason = be.availability()
    if not ok:
        pytest.skip(f"backend {request.param!r} unavailable: {reason}")
    return be


@pytest.fixture
def device(backend):
    dev = backend.open(0)
    yield dev
    dev.close()


def _read(dev, handle, offset, n, stream=0) -> bytes:
    out = bytearray(n)
    dev.copy_to_host(handle, offset, memoryview(out), stream)
    return bytes(out)


def _wait_idle(dev, stream, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dev.stream_idle(stream):
            return True
        time.sleep(0.001)
    return False


# --------------------------------------------------------------------------------------------
# Protocol conformance, on every selected backend
# --------------------------------------------------------------------------------------------
def test_properties_sane(backend, device):
    props = device.properties()
    assert isinstance(props, DeviceProperties)
    assert isinstance(props.name, str) and props.name.strip()
    assert props.total_memory > 0
    assert props.alignment >= 1 and props.alignment & (props.alignment - 1) == 0
    assert isinstance(props.extra, dict)
    assert device.device_string == ("cpu" if backend.name == "cpu" else f"{backend.name}:0")
    if backend.name == "cpu":
        assert isinstance(props.extra["pinned"], bool)
    if backend.name == "opencl":
        for key in ("platform", "vendor", "opencl_version", "driver_version", "max_alloc",
                    "compute_units", "clock_mhz"):
            assert key in props.extra, key
        assert props.alignment >= props.extra["sub_buffer_alignment"]
    if backend.name == "cuda":
        major, minor = props.extra["compute_capability"]
        assert major >= 1 and minor >= 0
        assert props.extra["multiprocessor_count"] > 0
        assert props.extra["driver_reserve"] == device.recommended_reserve(props.total_memory)
        assert 0 <= props.extra["driver_reserve"] <= props.total_memory


def test_mem_get_info(device):
    free, total = device.mem_get_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert total > 0
    assert 0 <= free <= total


def test_mem_get_info_follows_allocations(backend, device):
    if backend.name == "cpu":
        # Host free memory moves with every other process; the device's own count must not.
        before = device.properties().extra["bytes_held"]
        h, _ = device.alloc_segment(8 * MiB)
        assert device.properties().extra["bytes_held"] == before + 8 * MiB
        device.free_segment(h)
        assert device.properties().extra["bytes_held"] == before
        return
    free0, total = device.mem_get_info()
    size = 64 * MiB
    if backend.name == "opencl":
        size = min(size, device.max_alloc // 2)
    size = min(size, free0 // 4)
    h, _ = device.alloc_segment(size)
    free1, _ = device.mem_get_info()
    device.free_segment(h)
    free2, _ = device.mem_get_info()
    # Allow for other processes; the allocation must show up by at least half its size.
    assert free0 - free1 >= size // 2
    assert free2 - free1 >= size // 2


def test_alloc_free_segment(device):
    align = device.properties().alignment
    handle, base = device.alloc_segment(4096)
    assert isinstance(handle, int) and isinstance(base, int)
    assert base > 0 and base % align == 0
    device.free_segment(handle)


def test_pattern_roundtrip_at_offsets(device):
    size = 1 * MiB
    h, _ = device.alloc_segment(size)
    try:
        device.memset(h, 0, 0, size)
        expected = bytearray(size)
        rng = random.Random(1234)
        for offset in (0, 1, 255, 256, 4096, 65536 + 3, size - 1000):
            n = min(777, size - offset)
            data = bytes(rng.getrandbits(8) for _ in range(n))
            device.copy_from_host(h, offset, memoryview(data))
            expected[offset:offset + n] = data
            assert _read(device, h, offset, n) == data
        assert _read(device, h, 0, size) == bytes(expected)
        # Non-byte formats are copied by their bytes.
        words = (ctypes.c_uint32 * 4)(1, 2, 3, 0xDEADBEEF)
        device.copy_from_host(h, 512, memoryview(words))
        assert _read(device, h, 512, 16) == bytes(words)
    finally:
        device.free_segment(h)


def test_memset(device):
    h, _ = device.alloc_segment(8192)
    try:
        device.memset(h, 0, 0x11, 8192)
        device.memset(h, 1000, 0xAB, 3000)
        data = _read(device, h, 0, 8192)
        assert data[:1000] == b"\x11" * 1000
        assert data[1000:4000] == b"\xab" * 3000
        assert data[4000:] == b"\x11" * 4192
        with pytest.raises(InvalidInputError):
            device.memset(h, 0, 256, 1)
    finally:
        device.free_segment(h)


def test_segments_do_not_alias(device):
    size = 256 * 1024
    (h1, b1), (h2, b2) = device.alloc_segment(size), device.alloc_segment(size)
    try:
        assert h1 != h2
        assert b1 + size <= b2 or b2 + size <= b1        # disjoint address ranges
        device.memset(h1, 0, 0xAA, size)
        device.memset(h2, 0, 0x55, size)
        assert _read(device, h1, 0, size) == b"\xaa" * size
        assert _read(device, h2, 0, size) == b"\x55" * size
    finally:
        device.free_segment(h1)
        device.free_segment(h2)


def test_out_of_range_access_is_rejected(device):
    h, _ = device.alloc_segment(4096)
    try:
        with pytest.raises(InvalidInputError):
            device.copy_from_host(h, 4000, memoryview(bytes(200)))
        with pytest.raises(InvalidInputError):
            device.copy_to_host(h, 4096, memoryview(bytearray(1)))
        with pytest.raises(InvalidInputError):
            device.memset(h, 0, 0, 4097)
        with pytest.raises(InvalidInputError):
            device.resolve(h, 4096 - 256, 512)
    finally:
        device.free_segment(h)


def test_resolve(backend, device):
    h, base = device.alloc_segment(1 * MiB)
    try:
        if backend.name != "opencl":
            assert device.resolve(h, 0, 100) == base
            assert device.resolve(h, 4096, 100) == base + 4096
            return
        import pyopencl as cl
        align = device.sub_buffer_alignment
        off = 4 * align
        sub = device.resolve(h, off, 1000)
        assert isinstance(sub, cl.Buffer) and sub.size == 1000
        # Writing through the sub-buffer lands at the block's offset in the segment.
        cl.enqueue_copy(device.queue(0), sub, b"sub-buffer!", is_blocking=True)
        assert _read(device, h, off, 11) == b"sub-buffer!"
        assert device.resolve(h, 0, 1 * MiB) is device.segment_buffer(h)
        assert device.resolve(h, off, 0) is None
    finally:
        device.free_segment(h)


def test_streams(device):
    s1, s2 = device.create_stream(), device.create_stream()
    assert s1 != 0 and s2 != 0 and s1 != s2
    h, _ = device.alloc_segment(65536)
    try:
        device.copy_from_host(h, 0, memoryview(b"x" * 65536), stream=s1)
        device.memset(h, 100, 7, 10, stream=s2)
        assert _read(device, h, 98, 14, stream=s1) == b"xx" + b"\x07" * 10 + b"xx"
        assert _wait_idle(device, s1) and _wait_idle(device, s2) and _wait_idle(device, 0)
        device.synchronize()
    finally:
        device.free_segment(h)
    device.destroy_stream(s1)
    device.destroy_stream(s2)
    with pytest.raises(InvalidInputError):
        device.destroy_stream(s1)


def test_absurd_allocation_is_driver_oom(device):
    with pytest.raises(DriverOutOfMemory) as info:
        device.alloc_segment(1 << 60)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, DriverError)
    assert err.code_name and isinstance(err.code_name, str)
    # The device is still usable.
    h, _ = device.alloc_segment(4096)
    device.free_segment(h)


def test_invalid_sizes(device):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidInputError):
            device.alloc_segment(bad)


def test_free_unknown_or_twice(device):
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        device.free_segment(0x7FFF_FFFF_0000)
    h, _ = device.alloc_segment(4096)
    device.free_segment(h)
    with pytest.raises(InvalidInputError):
        device.free_segment(h)
    with pytest.raises(InvalidInputError):
        device.copy_to_host(h, 0, memoryview(bytearray(4)))


def test_bad_index_lists_devices(backend):
    with pytest.raises(InvalidDeviceError) as info:
        backend.open(99)
    msg = str(info.value)
    assert "99" in msg
    assert ("cpu" if backend.name == "cpu" else f"{backend.name}:0") in msg
    with pytest.raises(InvalidDeviceError):
        backend.open(-1)


def test_describe_rows(backend):
    rows = backend.describe()
    assert rows and all(r.available for r in rows)
    assert len(rows) == backend.device_count()
    for r in rows:
        assert r.backend == backend.name and r.total_memory > 0
        assert 0 <= r.free_memory <= r.total_memory


def test_threads_share_a_device(device):

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            n = rng.randrange(1, 64) * 256
            h, _ = device.alloc_segment(n)
            data = bytes([seed]) * n
            device.copy_from_host(h, 0, memoryview(data))
            assert _read(device, h, 0, n) == data
            device.free_segment(h)

    errors = run_threads(work, range(8))
    assert not errors, errors


def test_close_is_idempotent(backend):
    dev = backend.open(0)
    dev.alloc_segment(4096)
    dev.close()
    dev.close()


# --------------------------------------------------------------------------------------------
# OpenCL specifics
# --------------------------------------------------------------------------------------------
@pytest.fixture
def cl_device():
    if "opencl" not in _selected():
        pytest.skip("opencl not selected by GPUMEM_TEST_BACKENDS")
    ok, reason = opencl_mod.BACKEND.availability()
    if not ok:
        pytest.skip(f"opencl unavailable: {reason}")
    dev = opencl_mod.BACKEND.open(0)
    yield dev
    dev.close()


def test_opencl_misaligned_subbuffer(cl_device):
    h, _ = cl_device.alloc_segment(64 * 1024)
    try:
        align = cl_device.sub_buffer_alignment
        for off in (1, align + 8):
            with pytest.raises(InvalidInputError, match=f"alignment of {align} bytes"):
                cl_device.resolve(h, off, 16)
        assert cl_device.resolve(h, align, 16).size == 16
    finally:
        cl_device.free_segment(h)


def test_opencl_bases_are_synthetic_and_unique(cl_device):
    align = cl_device.properties().alignment
    segs = [cl_device.alloc_segment(1000 + i) for i in range(5)]
    bases = [b for _, b in segs]
    assert all(b % align == 0 for b in bases)
    assert all(b >= (cl_device.index + 1) * opencl_mod.ADDRESS_STRIDE for b in bases)
    for (_, b1), (_, b2) in zip(segs[:-1], segs[1:], strict=True):
        assert b2 >= b1 + 1000
    for h, _ in segs:
        cl_device.free_segment(h)
    h, b = cl_device.alloc_segment(100)      # never reused
    assert b not in bases
    cl_device.free_segment(h)


def test_opencl_above_max_alloc_is_oom(cl_device):
    with pytest.raises(DriverOutOfMemory, match="MAX_MEM_ALLOC_SIZE"):
        cl_device.alloc_segment(cl_device.max_alloc + 1)


def test_opencl_error_mapping(cl_device):
    import pyopencl as cl
    record = getattr(cl._cl, "_ErrorRecord", None)
    if record is None:
        pytest.skip("this pyopencl has no _ErrorRecord to build errors with")

    def err(cls, code):
        return cls(record("clTest", code, "test"))

    oom = opencl_mod.map_cl_error(cl, err(cl.MemoryError, -4), "x")
    assert isinstance(oom, DriverOutOfMemory)
    assert oom.code == -4 and oom.code_name == "CL_MEM_OBJECT_ALLOCATION_FAILURE"
    assert isinstance(opencl_mod.map_cl_error(cl, err(cl.RuntimeError, -5), "x"),
                      DriverOutOfMemory)
    other = opencl_mod.map_cl_error(cl, err(cl.RuntimeError, -13), "x")
    assert type(other) is DriverError and other.code == -13
    assert other.code_name == "CL_MISALIGNED_SUB_BUFFER_OFFSET"
    # A real driver error surfaces mapped too: the sub-buffer rule, bypassing our own check.
    h, _ = cl_device.alloc_segment(4096)
    try:
        with pytest.raises(cl.Error) as info:
            cl_device.segment_buffer(h).get_sub_region(1, 16)
        mapped = opencl_mod.map_cl_error(cl, info.value, "sub-buffer")
        assert mapped.code == -13 and mapped.code_name == "CL_MISALIGNED_SUB_BUFFER_OFFSET"
    finally:
        cl_device.free_segment(h)


# --------------------------------------------------------------------------------------------
# Unavailable backends: clean import, a reason, BackendUnavailableError on use
# --------------------------------------------------------------------------------------------
def test_cuda_availability_is_consistent():
    ok, reason = cuda_mod.BACKEND.availability()
    assert isinstance(ok, bool) and isinstance(reason, str)
    if ok:
        assert reason == ""
        assert cuda_mod.BACKEND.device_count() >= 1
        return
    assert len(reason) > 15
    assert any(w in reason for w in ("cuda-python", "libcuda", "driver", "device")), reason
    with pytest.raises(BackendUnavailableError, match="cuda"):
        cuda_mod.BACKEND.device_count()
    with pytest.raises(BackendUnavailableError):
        cuda_mod.BACKEND.open(0)
    with pytest.raises(BackendUnavailableError) as info:
        open_device("cuda:0")
    assert reason in str(info.value)
    [row] = cuda_mod.BACKEND.describe()
    assert not row.available and row.reason == reason


@pytest.mark.parametrize("blocked", ["cuda", "cuda.bindings"])
def test_cuda_without_package(monkeypatch, blocked):
    for mod in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, mod, None)     # makes the import raise ImportError
    be = cuda_mod.CudaBackend()
    ok, reason = be.availability()
    assert not ok and "pip install gpumem-pool[cuda]" in reason
    with pytest.raises(BackendUnavailableError, match="cuda-python is not installed"):
        be.open(0)
    with pytest.raises(BackendUnavailableError):
        be.device_count()


def test_opencl_without_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyopencl", None)
    be = opencl_mod.OpenCLBackend()
    ok, reason = be.availability()
    assert not ok and "pip install gpumem-pool[opencl]" in reason
    with pytest.raises(BackendUnavailableError, match="pyopencl is not installed"):
        be.open(0)
    with pytest.raises(BackendUnavailableError):
        be.device_count()
    assert be.describe()[0].reason == reason


def test_cuda_driver_library_missing():
    class Missing(RuntimeError):
        pass
    drv = FakeDriver(init_error=Missing('"cuda" is an NVIDIA driver library ...'))
    ok, reason = cuda_mod.CudaBackend(driver=drv).availability()
    assert not ok and "libcuda" in reason and "Missing" in reason


def test_cuda_no_device():
    drv = FakeDriver(init_error=FakeCUresult.CUDA_ERROR_NO_DEVICE)
    ok, reason = cuda_mod.CudaBackend(driver=drv).availability()
    assert not ok and "CUDA_ERROR_NO_DEVICE" in reason
    ok, reason = cuda_mod.CudaBackend(driver=FakeDriver(devices=0)).availability()
    assert not ok and "no device" in reason


def test_modules_import_in_a_fresh_interpreter_without_drivers():
    import subprocess
    code = ("import sys; sys.modules['pyopencl'] = None; sys.modules['cuda'] = None\n"
            "import gpumem.backends.cuda, gpumem.backends.opencl, gpumem.backends.host\n"
            "from gpumem.backends import devices\n"
            "rows = {r.device: r for r in devices()}\n"
            "assert not rows['cuda'].available and 'cuda-python' in rows['cuda'].reason\n"
            "assert not rows['opencl'].available and 'pyopencl' in rows['opencl'].reason\n"
            "assert rows['cpu'].available\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --------------------------------------------------------------------------------------------
# CUDA backend logic on the fake driver
# --------------------------------------------------------------------------------------------
def test_cuda_fake_return_codes_and_context():
    drv = FakeDriver(capacity=64 * MiB)
    be = cuda_mod.CudaBackend(driver=drv)
    dev = be.open(1)
    assert drv.refcount[1] == 1
    assert dev.properties().name == "Fake GPU 1"
    assert dev.properties().extra["compute_capability"] == (9, 0)
    assert dev.properties().extra["pci_bus_id"] == "0000:01:00.0"
    # Each call leaves the thread's context stack as it found it.
    assert drv._stack() == []
    dev.mem_get_info()
    assert drv._stack() == []
    # With our context already current, nothing is pushed.
    drv.cuCtxPushCurrent(_Handle(2))
    dev.mem_get_info()
    assert drv._stack() == [2]
    drv.cuCtxPopCurrent()
    with pytest.raises(DriverOutOfMemory) as info:
        dev.alloc_segment(65 * MiB)
    assert info.value.code == 2 and info.value.code_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)
    drv.fail_next = FakeCUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(DriverError) as info:
        dev.alloc_segment(4096)
    assert type(info.value) is DriverError
    assert info.value.code == 719 and info.value.code_name == "CUDA_ERROR_LAUNCH_FAILED"
    dev.close()
    assert drv.refcount[1] == 0
    assert drv._stack() == []


def test_cuda_fake_stream_not_ready():
    drv = FakeDriver()
    dev = cuda_mod.CudaBackend(driver=drv).open(0)
    s = dev.create_stream()
    assert dev.native_stream(s) == s
    drv.not_ready[s] = 2
    assert dev.stream_idle(s) is False
    assert dev.stream_idle(s) is False
    assert dev.stream_idle(s) is True
    drv.not_ready[s] = 5
    dev.synchronize()
    assert dev.stream_idle(s) is True
    # A stream made elsewhere (CuPy, PyTorch) is queried by value but cannot be destroyed here.
    drv.cuCtxPushCurrent(_Handle(1))
    _, other = drv.cuStreamCreate(1)
    drv.cuCtxPopCurrent()
    assert dev.stream_idle(int(other)) is True
    with pytest.raises(InvalidInputError):
        dev.destroy_stream(int(other))
    dev.destroy_stream(s)
    dev.close()


class _StaleStreamDriver(FakeDriver):
    """A driver on which a destroyed CUstream is undefined behaviour, as on a real one (the GPU
    run of 2026-11-27 crashed a worker on cuStreamQuery of one): any use fails the test."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.destroyed: set[int] = set()

    def cuStreamDestroy(self, s):
        self.destroyed.add(int(s))
        return super().cuStreamDestroy(s)

    def cuStreamCreate(self, flags):
        res = super().cuStreamCreate(flags)
        self.destroyed.discard(int(res[1]))
        return res

    def _stream_ok(self, s):
        assert int(s) not in self.destroyed, f"destroyed stream {int(s):#x} reached the driver"
        return super()._stream_ok(s)


def test_cuda_destroyed_stream_never_reaches_the_driver(make_manager):
    """Level: fake driver. After destroy_stream, every use of the handle (query, event, copy,
    and a manager's malloc on it) is refused with InvalidInputError by the device itself; when
    the driver hands the same handle to a new stream of this device, it is usable again."""
    drv = _StaleStreamDriver()
    dev = cuda_mod.CudaBackend(driver=drv).open(0)
    mm = make_manager(dev, reserve_bytes=0)
    s = dev.create_stream()
    mm.malloc(MiB, stream=s).free()
    dev.destroy_stream(s)
    for use in (lambda: dev.stream_idle(s), lambda: dev.record_event(s),
                lambda: dev.memset(mm.pool.segments()[0]["handle"], 0, 0, 16, stream=s),
                lambda: mm.malloc(1024, stream=s)):
        with pytest.raises(InvalidInputError, match="destroyed"):
            use()
    mm.malloc(3 * MiB).free()                      # the dead stream's cache goes to stream 0
    check(mm, [])
    drv._next_stream = s - 0x40                    # the driver reuses the handle
    assert dev.create_stream() == s
    assert dev.stream_idle(s) is True
    mm.malloc(1024, stream=s).free()
    check(mm, [])
    dev.destroy_stream(s)
    mm.close()
    dev.close()


def test_cuda_refused_free_keeps_the_segment(make_manager):
    """A cuMemFree the driver refuses (a destroyed context, a sticky error) raises a DriverError
    naming the code; the device still knows the segment, the manager keeps it cached, and a
    later release succeeds."""
    drv = FakeDriver(capacity=256 * MiB)
    dev = cuda_mod.CudaBackend(driver=drv).open(0)
    mm = make_manager(dev, reserve_bytes=0)
    mm.malloc(3 * MiB).free()
    [seg] = mm.pool.segments()
    drv.fail_next = FakeCUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED
    with pytest.warns(RuntimeWarning, match="refused to free a segment"):
        assert mm.empty_cache() == 0
    assert dev.segment_size(seg["handle"]) == seg["size"]
    assert [s["handle"] for s in mm.pool.segments()] == [seg["handle"]]
    check(mm, [])
    assert mm.empty_cache() == seg["size"]
    assert drv.allocs == {}
    check(mm, [])


def test_cuda_fake_closed_device_refuses_work():
    dev = cuda_mod.CudaBackend(driver=FakeDriver()).open(0)
    h, _ = dev.alloc_segment(4096)
    dev.close()
    with pytest.raises(InvalidInputError, match="closed"):
        dev.mem_get_info()


def test_check_helper():
    drv = FakeDriver()
    assert cuda_mod.check(drv, (FakeCUresult.CUDA_SUCCESS,), "f") is None
    assert cuda_mod.check(drv, (FakeCUresult.CUDA_SUCCESS, 5), "f") == 5
    assert cuda_mod.check(drv, (FakeCUresult.CUDA_SUCCESS, 5, 6), "f") == (5, 6)
    with pytest.raises(DriverError, match="cuFoo failed: CUDA_ERROR_INVALID_VALUE"):
        cuda_mod.check(drv, (FakeCUresult.CUDA_ERROR_INVALID_VALUE, None), "cuFoo")


def test_check_helper_with_real_cuda_python_enums():
    driver = pytest.importorskip("cuda.bindings.driver")
    # No driver needed: cuGetErrorName may fail without libcuda and the enum name is used.
    with pytest.raises(DriverOutOfMemory) as info:
        cuda_mod.check(driver, (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    assert info.value.code_name == "CUDA_ERROR_OUT_OF_MEMORY" and info.value.code == 2
    with pytest.raises(DriverError) as info:
        cuda_mod.check(driver, (driver.CUresult.CUDA_ERROR_NOT_READY,), "cuStreamQuery")
    assert info.value.code_name == "CUDA_ERROR_NOT_READY"
    assert cuda_mod.check(driver, (driver.CUresult.CUDA_SUCCESS, 7), "x") == 7


# --------------------------------------------------------------------------------------------
# Host backend specifics
# --------------------------------------------------------------------------------------------
def test_host_pinned_through_cuda(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(cuda_mod, "BACKEND", cuda_mod.CudaBackend(driver=drv))
    monkeypatch.setattr(cuda_host, "_pinned_ctx", None)
    dev = host_mod.HostBackend(pinned=True).open(0)
    assert dev.properties().extra["pinned"] is True
    h, base = dev.alloc_segment(10000)
    assert base in drv.host_allocs                     # cuMemHostAlloc served it
    dev.copy_from_host(h, 5, memoryview(b"pinned"))
    assert _read(dev, h, 5, 6) == b"pinned"
    dev.free_segment(h)
    assert base not in drv.host_allocs                 # and cuMemFreeHost released it
    drv.fail_next = FakeCUresult.CUDA_ERROR_OUT_OF_MEMORY
    h, base = dev.alloc_segment(10000)                 # falls back to pageable memory
    assert base not in drv.host_allocs
    assert dev.properties().extra["pinned_fallbacks"] == 1
    dev.free_segment(h)
    assert drv._stack() == []
    dev.close()


def test_host_pinned_mode_follows_cuda_availability(monkeypatch):
    monkeypatch.delenv("GPUMEM_HOST_PINNED", raising=False)
    dev = host_mod.HostBackend().open(0)
    assert dev.properties().extra["pinned"] is cuda_mod.BACKEND.availability()[0]
    monkeypatch.setenv("GPUMEM_HOST_PINNED", "0")
    assert host_mod.HostBackend().open(0).properties().extra["pinned"] is False


def test_host_memory_info_from_os():
    free, total = host_mod.host_memory_info()
    assert 0 < free <= total
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert total <= phys * 1.01


def test_host_array_interface():
    np = pytest.importorskip("numpy")
    dev = host_mod.BACKEND.open(0)
    h, base = dev.alloc_segment(4096)
    try:
        assert base % 4096 == 0                        # page aligned
        iface = host_mod.array_interface(base + 16, 32)
        assert iface == {"shape": (32,), "typestr": "|u1", "data": (base + 16, False),
                         "strides": None, "version": 3}
        arr = host_mod.host_array(dev.resolve(h, 16, 32), 32, owner=dev)
        arr[:] = np.arange(32, dtype=np.uint8)
        assert _read(dev, h, 16, 32) == bytes(range(32))
        assert bytes(host_mod.host_memoryview(base + 16, 4)) == bytes(range(4))
    finally:
        dev.free_segment(h)


def test_host_refuses_more_than_available():
    dev = host_mod.BACKEND.open(0)
    free, _ = dev.mem_get_info()
    with pytest.raises(DriverOutOfMemory, match="available"):
        dev.alloc_segment(free + (1 << 30))


# --------------------------------------------------------------------------------------------
# The usable-memory reserve
# --------------------------------------------------------------------------------------------
def test_usable_memory_reserve():
    GiB = 1 << 30
    r = cuda_mod.usable_memory_reserve
    assert r(4 * GiB) == 500 * MiB + 100 * MiB + int(0.1 * 4 * GiB)
    assert r(80 * GiB) == 2 * GiB                      # capped
    assert r(100 * MiB) == 100 * MiB                   # never more than the device
    assert r(0) == 0
    assert r(16 * GiB, driver_overhead=0, context_overhead=0, fraction=0.05,
             cap=10 * GiB) == int(0.05 * 16 * GiB)
    assert cuda_mod.usable_memory(80 * GiB) == 78 * GiB
    with pytest.raises(InvalidInputError):
        r(GiB, fraction=1.5)


# --------------------------------------------------------------------------------------------
# NVML process usage
# --------------------------------------------------------------------------------------------
def test_process_memory_usage_without_nvml_is_none():
    if cuda_mod.BACKEND.availability()[0]:
        pytest.skip("a CUDA driver is present; NVML may answer")
    assert cuda_mod.process_memory_usage(0) is None


@pytest.mark.parametrize("rows", [[(111, 5 * MiB)],
                                  [(7, MiB), (111, 3 * MiB), (111, 2 * MiB)],
                                  [(7, MiB)]])
def test_process_memory_usage_sums_this_pid(monkeypatch, rows):
    pytest.importorskip("cuda.bindings")
    import types

    import cuda.bindings

    class Procs:
        def __init__(self, rows):
            self.rows = rows
            # cuda.bindings.nvml.ProcessInfo: scalar fields for one struct, arrays for several
            pick = (lambda i: rows[0][i]) if len(rows) == 1 else (lambda i: [r[i] for r in rows])
            self.pid, self.used_gpu_memory = pick(0), pick(1)

        def __len__(self):
            return len(self.rows)

    calls = []
    fake = types.SimpleNamespace(
        init_v2=lambda: calls.append("init"), shutdown=lambda: calls.append("shutdown"),
        device_get_handle_by_index_v2=lambda i: ("idx", i),
        device_get_handle_by_pci_bus_id_v2=lambda b: ("bus", b),
        device_get_compute_running_processes_v3=lambda h: (calls.append(h), Procs(rows))[1])
    monkeypatch.setattr(cuda.bindings, "nvml", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvml", fake)
    expected = sum(u for p, u in rows if p == 111) or None
    assert cuda_mod.process_memory_usage(0, pid=111) == expected
    assert cuda_mod.process_memory_usage(0, pid=111, pci_bus_id="0000:01:00.0") == expected
    assert ("bus", "0000:01:00.0") in calls and calls.count("shutdown") == 2
