"""A backend registered from outside the package works end to end: one module (this file's
``NumpyHostBackend``, host memory held by numpy arrays) plus one registry row
(``gpumem.backends.register_backend``), and every layer above reads what it needs from the
Device's declarations, not from its name. Level: real (numpy host memory; no gpumem backend
module is involved).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import gpumem
from gpumem import InvalidDeviceError, InvalidInputError, MemoryConfig, MemoryManager
from gpumem.backends import (Backend, Device, DeviceKind, DeviceProperties, backend_names,
                             open_device, register_backend, unregister_backend)
from gpumem.backends.base import DLPACK_CPU, check_block_range
from gpumem.errors import DriverOutOfMemory

MiB = 1 << 20
CAPACITY = 256 * MiB
CONFIG = dict(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False,
              track_allocations=False, expandable_segments=False)


class NumpyHostDevice(Device):
    """Host memory as a device: each segment is a numpy uint8 array, its address the base."""

    backend = "numpyhost"
    kind = DeviceKind.HOST
    dlpack_device_type = DLPACK_CPU

    def __init__(self, index: int) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._segments: dict[int, np.ndarray] = {}
        self._streams = {0}
        self._next_stream = 1

    def properties(self) -> DeviceProperties:
        return DeviceProperties(name="numpy host memory", total_memory=CAPACITY, alignment=256)

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            held = sum(a.nbytes for a in self._segments.values())
        return CAPACITY - held, CAPACITY

    def alloc_segment(self, nbytes: int) -> tuple[int, int]:
        if nbytes > self.mem_get_info()[0]:
            raise DriverOutOfMemory(f"{self.device_string}: {nbytes} bytes do not fit")
        arr = np.zeros(nbytes + 256, dtype=np.uint8)
        base = -(-arr.ctypes.data // 256) * 256            # aligned start inside the array
        with self._lock:
            self._segments[base] = arr[base - arr.ctypes.data:][:nbytes]
        return base, base

    def _array(self, handle: int, offset: int, nbytes: int) -> np.ndarray:
        with self._lock:
            arr = self._segments.get(handle)
        check_block_range(self.device_string, handle, None if arr is None else arr.nbytes,
                          offset, nbytes)
        return arr[offset:offset + nbytes]

    def free_segment(self, handle: int) -> None:
        with self._lock:
            del self._segments[handle]

    def segment_size(self, handle: int) -> int:
        self._array(handle, 0, 0)                         # InvalidInputError when unknown
        return self._segments[handle].nbytes

    def resolve(self, handle: int, offset: int, nbytes: int) -> int:
        self._array(handle, offset, nbytes)
        return handle + offset

    def copy_from_host(self, handle: int, offset: int, src: memoryview, stream: int = 0) -> None:
        self._array(handle, offset, len(src))[:] = np.frombuffer(src, dtype=np.uint8)

    def copy_to_host(self, handle: int, offset: int, dst: memoryview, stream: int = 0) -> None:
        np.frombuffer(dst, dtype=np.uint8)[:] = self._array(handle, offset, len(dst))

    def memset(self, handle: int, offset: int, value: int, nbytes: int, stream: int = 0) -> None:
        self._array(handle, offset, nbytes)[:] = value

    def create_stream(self) -> int:
        with self._lock:
            s, self._next_stream = self._next_stream, self._next_stream + 1
            self._streams.add(s)
        return s

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            self._streams.discard(stream)
        self._stream_destroyed(stream)

    def stream_idle(self, stream: int) -> bool:
        if stream not in self._streams:
            raise InvalidInputError(f"unknown stream {stream}")
        return True

    def synchronize(self) -> None:
        pass


class NumpyHostBackend(Backend):
    name = "numpyhost"
    kind = DeviceKind.HOST

    def __init__(self) -> None:
        self._devices = [NumpyHostDevice(0)]

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def device_count(self) -> int:
        return len(self._devices)

    def open(self, index: int) -> Device:
        if not 0 <= index < len(self._devices):
            raise InvalidDeviceError(f"no device numpyhost:{index}")
        return self._devices[index]


class OpaqueDevice(NumpyHostDevice):
    """The same memory declared as an accelerator's that DLPack cannot address."""

    backend = "opaque"
    kind = DeviceKind.DEVICE
    dlpack_device_type = None


class OpaqueBackend(NumpyHostBackend):
    name = "opaque"
    kind = DeviceKind.DEVICE

    def __init__(self) -> None:
        self._devices = [OpaqueDevice(0)]


@pytest.fixture
def numpyhost():
    backend = NumpyHostBackend()
    register_backend("numpyhost", backend)
    try:
        yield backend
    finally:
        unregister_backend("numpyhost")


def test_registered_backend_is_listed_and_opened_by_its_string(numpyhost):
    """The registry row makes the device a device like any other: listed by devices() with
    its kind, opened by "numpyhost:0", and gone again once unregistered."""
    assert backend_names()[-1] == "numpyhost"
    rows = [d for d in gpumem.devices() if d.backend == "numpyhost"]
    assert [(r.device, r.available, r.kind, r.total_memory) for r in rows] == [
        ("numpyhost:0", True, DeviceKind.HOST, CAPACITY)]
    assert open_device(" NumpyHost : 0 ") is numpyhost.open(0)
    with pytest.raises(InvalidDeviceError, match="backend 'numpyhost' has 1 device"):
        open_device("numpyhost:1")
    unregister_backend("numpyhost")
    try:
        with pytest.raises(InvalidDeviceError, match="unknown device"):
            open_device("numpyhost:0")
        assert "numpyhost" not in backend_names()
    finally:
        register_backend("numpyhost", numpyhost)       # the fixture unregisters it


def test_memory_manager_allocates_copies_and_caches_on_it(numpyhost):
    """malloc/free through the Cython pool on the new device: bytes round-trip, a freed block
    is a cache hit, close() gives every segment back."""
    mm = MemoryManager("numpyhost:0", MemoryConfig(**CONFIG))
    dev = mm.device
    data = np.arange(3 * MiB, dtype=np.uint8)
    buf = mm.malloc(data.size, tag="weights")
    buf.copy_from_host(data)
    assert np.array_equal(buf.copy_to_host(), data)
    assert buf.location == "cpu" and buf.device == "numpyhost:0"
    handle, _ = buf.segment_location()
    assert dev.segment_size(handle) == mm.pool.segments()[0]["size"]
    hits = mm.stats().pool_hits
    buf.free()
    mm.free(mm.malloc(3 * MiB))
    assert mm.stats().pool_hits == hits + 1
    mm.close()
    assert dev.mem_get_info()[0] == CAPACITY
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        dev.segment_size(handle)


def test_views_offer_host_protocols_from_the_declared_dlpack_type(numpyhost):
    """A host-kind device declaring kDLCPU gets numpy's __array_interface__ and DLPack: the
    arrays share the buffer's bytes (writes show through copy_to_host)."""
    mm = MemoryManager("numpyhost:0", MemoryConfig(**CONFIG))
    try:
        buf = mm.malloc(4096)
        arr = np.asarray(buf.view("float32", (1024,)))
        arr[:] = 1.5
        assert np.array_equal(buf.copy_to_host().view(np.float32), np.full(1024, 1.5, "f4"))
        assert buf.__dlpack_device__() == (DLPACK_CPU, 0)
        back = np.from_dlpack(buf.view("float32"))
        assert back[7] == 1.5
        del arr, back
    finally:
        mm.close()


def test_an_accelerator_without_dlpack_gets_no_host_protocols():
    """The same memory declared as a DEVICE with no DLPack type: the views refuse numpy's and
    CUDA's interfaces and DLPack, and automatic placement counts it as an accelerator."""
    register_backend("opaque", OpaqueBackend())
    try:
        mm = MemoryManager("opaque:0", MemoryConfig(**CONFIG))
        buf = mm.malloc(4096)
        assert buf.location == "device"
        with pytest.raises(AttributeError):
            buf.__array_interface__
        with pytest.raises(AttributeError):
            buf.__cuda_array_interface__
        with pytest.raises(BufferError):
            buf.__dlpack_device__()
        from gpumem.placement.selection import device_room
        assert not device_room("opaque:0").host_memory
        assert device_room(open_device("cpu")).host_memory
        mm.close()
    finally:
        unregister_backend("opaque")


def test_bad_registrations_are_refused_and_change_nothing():
    """A bundled name, a malformed name, a non-Backend or a backend named otherwise: a clear
    InvalidInputError, and the registry is as before."""
    before = backend_names()
    with pytest.raises(InvalidInputError, match="bundled"):
        register_backend("cpu", NumpyHostBackend())
    with pytest.raises(InvalidInputError, match="lower-case"):
        register_backend("Numpy Host", NumpyHostBackend())
    with pytest.raises(InvalidInputError, match="Backend or a module name"):
        register_backend("numpyhost", object())
    with pytest.raises(InvalidInputError, match="named 'numpyhost', not 'other'"):
        register_backend("other", NumpyHostBackend())
    with pytest.raises(InvalidInputError, match="bundled"):
        unregister_backend("sim")
    with pytest.raises(InvalidInputError, match="no registered backend"):
        unregister_backend("numpyhost")
    assert backend_names() == before
