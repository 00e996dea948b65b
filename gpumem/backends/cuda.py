"""CUDA backend through cuda-python: ``cuda.bindings.driver``, with the calls made per segment,
copy, event and context switch done from Cython through ``cuda.bindings.cydriver`` (GIL
released) when ``gpumem.backends._cuda_native`` was built (see setup.py).

Importing this module never touches the driver: ``cuda.bindings`` is imported, and ``cuInit``
called, only inside :meth:`CudaBackend.availability` / :meth:`CudaBackend.open`. A missing
package or driver library makes the backend report itself unavailable with the reason.

Conventions of cuda-python relied on here: every driver function returns a tuple whose first
item is a ``CUresult`` and whose other items are the outputs; pointers (``CUdeviceptr``,
``CUstream``, ``CUcontext``) convert with ``int()`` and plain ints are accepted where a pointer
or handle is expected.

Streams are the driver's own ``CUstream`` handle values, so a stream made by another library
(CuPy ``Stream.ptr``, ``torch.cuda.Stream.cuda_stream``) can be handed to the pool as is;
``0`` is the legacy default stream.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

from gpumem.backends.base import (DLPACK_CUDA, Backend, Device, DeviceKind, DeviceProperties,
                                  check_block_range)
from gpumem.backends.cuda_driver import (_with_native_calls, check, load_driver, usable_memory,
                                         usable_memory_reserve)
from gpumem.backends.cuda_host import pinned_alloc, pinned_free, process_memory_usage
from gpumem.backends.cuda_vmm import CudaVirtualMemory
from gpumem.backends.host import buffer_address, byte_view
from gpumem.errors import (BackendUnavailableError, DriverError, DriverOutOfMemory,
                           InvalidDeviceError, InvalidInputError)
from gpumem.units import format_bytes

__all__ = ["CudaBackend", "CudaDevice", "BACKEND", "check", "usable_memory_reserve",
           "usable_memory", "process_memory_usage", "pinned_alloc", "pinned_free",
           "load_driver"]

# cuMemAlloc returns pointers aligned to at least 256 bytes (CUDA programming guide,
# "Device Memory Accesses"), so blocks carved at multiples of this stay aligned for any type.
CUDA_ALIGNMENT = 256

_INSTALL_HINT = "cuda-python is not installed (pip install gpumem-pool[cuda])"

#: device index -> bytes the driver, contexts and other processes held when this process first
#: opened the device (CudaDevice.recommended_reserve); written once per index, under the GIL
_DRIVER_TAKES: dict[int, int] = {}


# --------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------
class CudaBackend(Backend):
    """NVIDIA GPUs through the CUDA driver API.

    ``driver`` may be given to use another object with the cuda-python driver interface (the
    tests pass a fake driver to exercise this code without a GPU); by default
    ``cuda.bindings.driver`` is imported on first use.
    """

    name = "cuda"
    kind = DeviceKind.DEVICE

    def __init__(self, driver: Any = None) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._probed: tuple[bool, str] | None = None
        self._count = 0

    # Probe once: whether a driver is present does not change within a process.
    def availability(self) -> tuple[bool, str]:
        with self._lock:
            if self._probed is None:
                self._probed = self._probe()
            return self._probed

    def _probe(self) -> tuple[bool, str]:
        drv = self._driver
        if drv is None:
            try:
                drv = load_driver()
            except ImportError as exc:
                return False, f"{_INSTALL_HINT}: {exc}"
            except Exception as exc:  # a broken install must not crash gpumem.devices()
                return False, f"cuda-python failed to import: {type(exc).__name__}: {exc}"
        try:
            res = drv.cuInit(0)
        except Exception as exc:
            # cuda.pathfinder raises DynamicLibNotFoundError (a RuntimeError) at the first
            # driver call when libcuda.so cannot be loaded.
            return False, (f"NVIDIA driver library libcuda.so not found or not loadable: "
                           f"{type(exc).__name__}: {exc}")
        try:
            check(drv, res, "cuInit")
            count = check(drv, drv.cuDeviceGetCount(), "cuDeviceGetCount")
        except DriverError as exc:
            if exc.code_name == "CUDA_ERROR_NO_DEVICE":
                return False, f"no CUDA device found ({exc})"
            return False, f"the CUDA driver failed to initialise: {exc}"
        except Exception as exc:
            return False, f"the CUDA driver failed to initialise: {type(exc).__name__}: {exc}"
        if int(count) <= 0:
            return False, "the CUDA driver is loaded but reports no device"
        self._driver = drv if self._driver is not None else _with_native_calls(drv)
        self._count = int(count)
        return True, ""

    @property
    def native(self) -> bool:
        """True when segment, copy, event and context calls go through gpumem's Cython module
        (cuda.bindings.cydriver, GIL released) rather than cuda.bindings.driver."""
        return type(self._require()).__name__ == "NativeDriver"

    def _require(self) -> Any:
        ok, reason = self.availability()
        if not ok:
            raise BackendUnavailableError(f"backend 'cuda' is unavailable: {reason}")
        return self._driver

    @property
    def driver(self) -> Any:
        """The driver module in use (raises BackendUnavailableError when unavailable)."""
        return self._require()

    def device_count(self) -> int:
        self._require()
        return self._count

    def device_names(self) -> list[str]:
        drv = self._require()
        names = []
        for i in range(self._count):
            try:
                dev = check(drv, drv.cuDeviceGet(i), "cuDeviceGet")
                names.append(f"cuda:{i} ({_device_name(drv, dev)})")
            except DriverError:
                names.append(f"cuda:{i}")
        return names

    def open(self, index: int) -> CudaDevice:
        drv = self._require()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._count:
            raise InvalidDeviceError(
                f"no CUDA device with index {index!r}; {self._count} device(s) here: "
                f"{', '.join(self.device_names()) or 'none'}")
        return CudaDevice(drv, index)


def _device_name(drv: Any, dev: Any) -> str:
    raw = check(drv, drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    if isinstance(raw, bytes):
        raw = raw.split(b"\0", 1)[0].decode(errors="replace")
    return str(raw).strip()


def _release_primary(drv: Any, dev: Any, released: list[bool]) -> None:
    # Runs from close() or a weakref finalizer, which at interpreter exit may come before the
    # managers' own close(): the flag makes the device refuse work from then on instead of
    # pushing a context that no longer exists. Never raises (the driver may be gone at exit).
    released[0] = True
    try:
        drv.cuDevicePrimaryCtxRelease(dev)
    except Exception:
        pass


# Extra attributes reported in DeviceProperties.extra: (key, attribute enum name).
_EXTRA_ATTRIBUTES = (
    ("multiprocessor_count", "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
    ("clock_khz", "CU_DEVICE_ATTRIBUTE_CLOCK_RATE"),
    ("memory_clock_khz", "CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE"),
    ("memory_bus_width", "CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH"),
    ("l2_cache_size", "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
    ("integrated", "CU_DEVICE_ATTRIBUTE_INTEGRATED"),
    ("unified_addressing", "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"),
    ("managed_memory", "CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY"),
    ("memory_pools_supported", "CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED"),
    ("ecc_enabled", "CU_DEVICE_ATTRIBUTE_ECC_ENABLED"),
    ("tcc_driver", "CU_DEVICE_ATTRIBUTE_TCC_DRIVER"),
)


class CudaDevice(CudaVirtualMemory, Device):
    """One CUDA device through its primary context (the one the runtime, CuPy and PyTorch use).

    The primary context is retained on open and released on :meth:`close`. Each call makes
    it current on the calling thread only for the duration of the call (push/pop), so a
    caller's own current context is left as it was. Segments are ``cuMemAlloc`` allocations;
    a segment's handle is its device pointer. Virtual memory: see
    :mod:`gpumem.backends.cuda_vmm` (a reservation's address is a segment handle too).
    """

    backend = "cuda"
    kind = DeviceKind.DEVICE
    dlpack_device_type = DLPACK_CUDA

    def __init__(self, driver: Any, index: int) -> None:
        self._drv = driver
        self.index = index
        self._lock = threading.Lock()
        self._dev = check(driver, driver.cuDeviceGet(index), "cuDeviceGet")
        self._ctx = check(driver, driver.cuDevicePrimaryCtxRetain(self._dev),
                          "cuDevicePrimaryCtxRetain")
        self._ctx_int = int(self._ctx)
        self._segments: dict[int, int] = {}      # device pointer -> nbytes
        self._streams: dict[int, Any] = {}       # CUstream value -> CUstream
        # handles destroyed through destroy_stream and not handed out again by create_stream:
        # never passed to the driver, for which a destroyed CUstream is undefined behaviour
        # (a real driver can crash on cuStreamQuery of one; GPU run of 2026-11-27)
        self._destroyed_streams: set[int] = set()
        self._events: dict[int, Any] = {}        # CUevent value -> CUevent
        self._closed = False
        self._released = [False]                 # set when the primary context is released
        self._props: DeviceProperties | None = None
        self._finalizer = weakref.finalize(self, _release_primary, driver, self._dev,
                                           self._released)
        self._vm_init()
        self._measure_driver_take()

    # --- context handling --------------------------------------------------------------------
    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """Make the primary context current on this thread for the duration of a call."""
        if self.closed:
            raise InvalidInputError(f"{self.device_string} has been closed")
        drv = self._drv
        cur = check(drv, drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur is not None and int(cur) == self._ctx_int:
            yield
            return
        check(drv, drv.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            drv.cuCtxPopCurrent()

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        with self._current():
            return check(self._drv, fn(*args), what)

    # --- queries -------------------------------------------------------------------------------
    def recommended_reserve(self, total: int) -> int:
        """What the driver does not leave to this process's allocators: ``total - free`` as
        ``cuMemGetInfo`` said when this process first opened the device, its primary context
        made (the driver, the context, and what other processes held then). PyTorch's caching
        allocator has exactly what this leaves; so has a gpumem manager (a soft limit: it
        refuses nothing). The estimate ``usable_memory_reserve(total, fraction=0)`` when the
        driver could not say."""
        taken = _DRIVER_TAKES.get(self.index)
        return usable_memory_reserve(total, fraction=0.0) if taken is None else min(taken, total)

    def _measure_driver_take(self) -> None:
        """Once per device per process, after the primary context exists: what the driver
        and contexts hold before any allocator of this process asked for memory."""
        if self.index in _DRIVER_TAKES:
            return
        try:
            free, total = self.mem_get_info()
        except DriverError:
            return                                # recommended_reserve estimates instead
        _DRIVER_TAKES.setdefault(self.index, max(0, total - free))

    def properties(self) -> DeviceProperties:
        if self._props is not None:
            return self._props
        drv = self._drv
        name = _device_name(drv, self._dev)
        total = int(check(drv, drv.cuDeviceTotalMem(self._dev), "cuDeviceTotalMem"))
        extra: dict[str, Any] = {}
        attr = drv.CUdevice_attribute
        major = check(drv, drv.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev), "cuDeviceGetAttribute")
        minor = check(drv, drv.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev), "cuDeviceGetAttribute")
        extra["compute_capability"] = (int(major), int(minor))
        for key, attr_name in _EXTRA_ATTRIBUTES:
            # Best effort: some attributes are deprecated or absent in a given driver/toolkit.
            enum = getattr(attr, attr_name, None)
            if enum is None:
                continue
            try:
                extra[key] = int(check(drv, drv.cuDeviceGetAttribute(enum, self._dev),
                                       "cuDeviceGetAttribute"))
            except DriverError:
                pass
        try:
            bus = check(drv, drv.cuDeviceGetPCIBusId(64, self._dev), "cuDeviceGetPCIBusId")
            if isinstance(bus, bytes):
                bus = bus.split(b"\0", 1)[0].decode()
            extra["pci_bus_id"] = str(bus)
        except Exception:
            pass
        try:
            version = int(check(drv, drv.cuDriverGetVersion(), "cuDriverGetVersion"))
            extra["driver_version"] = f"{version // 1000}.{(version % 1000) // 10}"
        except Exception:
            pass
        extra["driver_reserve"] = self.recommended_reserve(total)
        extra["native_calls"] = type(drv).__name__ == "NativeDriver"
        self._props = DeviceProperties(name=name, total_memory=total, alignment=CUDA_ALIGNMENT,
                                       extra=extra)
        return self._props

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo", self._drv.cuMemGetInfo)
        return int(free), int(total)

    def process_memory_usage(self) -> int | None:
        """Bytes this process holds on the device according to NVML, or None if unknown."""
        bus = self.properties().extra.get("pci_bus_id")
        return process_memory_usage(self.index, pci_bus_id=bus)

    # --- raw segments ----------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int) -> tuple[int, int]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidInputError(f"segment size must be a positive int, got {nbytes!r}")
        try:
            ptr = int(self._call("cuMemAlloc", self._drv.cuMemAlloc, nbytes))
        except DriverOutOfMemory as exc:
            raise DriverOutOfMemory(
                f"{self.device_string}: cuMemAlloc of {format_bytes(nbytes)} ({nbytes} bytes) "
                f"failed: {exc.code_name}", code=exc.code, code_name=exc.code_name) from None
        with self._lock:
            self._segments[ptr] = nbytes
        return ptr, ptr

    def free_segment(self, handle: int) -> None:
        with self._lock:
            if handle not in self._segments:
                raise InvalidInputError(
                    f"{self.device_string}: unknown segment handle {handle!r} "
                    f"(not allocated by this device, or already freed)")
            nbytes = self._segments.pop(handle)
        try:
            self._call("cuMemFree", self._drv.cuMemFree, handle)
        except BaseException:
            # the driver kept it (a dead context, a sticky error): the handle stays valid, so
            # the manager can put the segment back in its pool and free it later
            with self._lock:
                self._segments[handle] = nbytes
            raise

    def _span(self, handle: int, offset: int, nbytes: int) -> int:
        with self._lock:
            size = self._segments.get(handle)
        if size is None:
            size = self._reservation_size(handle)
        check_block_range(self.device_string, handle, size, offset, nbytes)
        return handle + offset

    def resolve(self, handle: int, offset: int, nbytes: int) -> int:
        return self._span(handle, offset, nbytes)

    def segment_size(self, handle: int) -> int:
        with self._lock:
            size = self._segments.get(handle)        # alloc_segment's, not reservations
        check_block_range(self.device_string, handle, size, 0, 0)
        return size

    # --- data movement ---------------------------------------------------------------------------
    def _stream_obj(self, stream: int) -> Any:
        with self._lock:
            s = self._streams.get(stream)
            if s is None and stream in self._destroyed_streams:
                raise InvalidInputError(
                    f"{self.device_string}: stream {stream} was destroyed (destroy_stream); "
                    f"its handle is not passed to the driver again")
        # Foreign streams (CuPy, PyTorch) are accepted by value; 0 is the legacy default stream.
        return s if s is not None else self._drv.CUstream(stream)

    def copy_from_host(self, handle: int, offset: int, src: memoryview, stream: int = 0) -> None:
        self._copy(handle, offset, byte_view(src), stream, to_device=True)

    def copy_to_host(self, handle: int, offset: int, dst: memoryview, stream: int = 0) -> None:
        mv = byte_view(dst)
        if mv.readonly:
            raise InvalidInputError("copy_to_host: the destination buffer is read-only")
        self._copy(handle, offset, mv, stream, to_device=False)

    def _copy(self, handle: int, offset: int, mv: memoryview, stream: int,
              to_device: bool) -> None:
        """One synchronous copy between host bytes ``mv`` and the segment at ``offset``."""
        n = mv.nbytes
        dev_ptr = self._span(handle, offset, n)
        if n == 0:
            return
        host_ptr, keep = buffer_address(mv)
        drv = self._drv
        s = self._stream_obj(stream)
        with self._current():
            if to_device:
                check(drv, drv.cuMemcpyHtoDAsync(dev_ptr, host_ptr, n, s), "cuMemcpyHtoDAsync")
            else:
                check(drv, drv.cuMemcpyDtoHAsync(host_ptr, dev_ptr, n, s), "cuMemcpyDtoHAsync")
            check(drv, drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        del keep

    def memset(self, handle: int, offset: int, value: int, nbytes: int, stream: int = 0) -> None:
        if not 0 <= value <= 255:
            raise InvalidInputError(f"memset value must be a byte 0..255, got {value}")
        dst = self._span(handle, offset, nbytes)
        if nbytes == 0:
            return
        drv = self._drv
        s = self._stream_obj(stream)
        with self._current():
            check(drv, drv.cuMemsetD8Async(dst, value, nbytes, s), "cuMemsetD8Async")
            check(drv, drv.cuStreamSynchronize(s), "cuStreamSynchronize")

    # --- streams ---------------------------------------------------------------------------------
    def create_stream(self) -> int:
        drv = self._drv
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        s = self._call("cuStreamCreate", drv.cuStreamCreate, flags)
        sid = int(s)
        with self._lock:
            self._streams[sid] = s
            self._destroyed_streams.discard(sid)    # the driver reused the handle
        return sid

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            s = self._streams.pop(stream, None)
            if s is not None:
                self._destroyed_streams.add(stream)
        if s is None:
            raise InvalidInputError(
                f"{self.device_string}: stream {stream!r} was not created by this device")
        try:
            self._call("cuStreamDestroy", self._drv.cuStreamDestroy, s)
        finally:
            self._stream_destroyed(stream)    # gone from this device either way

    def _finished(self, what: str, query: Any, handle: Any) -> bool:
        """A non-blocking query (cuStreamQuery, cuEventQuery): CUDA_ERROR_NOT_READY means
        work is still pending; any other error raises."""
        drv = self._drv
        with self._current():
            res = query(handle)
        code = res[0] if isinstance(res, tuple) else res
        if int(code) == int(drv.CUresult.CUDA_ERROR_NOT_READY):
            return False
        check(drv, res, what)
        return True

    def stream_idle(self, stream: int) -> bool:
        return self._finished("cuStreamQuery", self._drv.cuStreamQuery, self._stream_obj(stream))

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize", self._drv.cuCtxSynchronize)

    # --- events ----------------------------------------------------------------------------------
    def record_event(self, stream: int = 0) -> int:
        """A ``CUevent`` (timing disabled: cheaper to record and query) recorded on ``stream``;
        the handle is the event's value."""
        drv = self._drv
        s = self._stream_obj(stream)
        with self._current():
            ev = check(drv, drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                       "cuEventCreate")
            try:
                check(drv, drv.cuEventRecord(ev, s), "cuEventRecord")
            except DriverError:
                drv.cuEventDestroy(ev)
                raise
        eid = int(ev)
        with self._lock:
            self._events[eid] = ev
        return eid

    def event_done(self, event: int) -> bool:
        with self._lock:
            ev = self._events.get(event)
        if ev is None:
            raise InvalidInputError(f"{self.device_string}: unknown event {event!r}")
        return self._finished("cuEventQuery", self._drv.cuEventQuery, ev)

    def destroy_event(self, event: int) -> None:
        with self._lock:
            ev = self._events.pop(event, None)
        if ev is None:
            raise InvalidInputError(f"{self.device_string}: unknown event {event!r}")
        self._call("cuEventDestroy", self._drv.cuEventDestroy, ev)

    def wait_event(self, stream: int, event: int) -> None:
        """``cuStreamWaitEvent``: later work on ``stream`` waits for ``event``; no host wait."""
        with self._lock:
            ev = self._events.get(event)
        if ev is None:
            raise InvalidInputError(f"{self.device_string}: unknown event {event!r}")
        self._call("cuStreamWaitEvent", self._drv.cuStreamWaitEvent, self._stream_obj(stream),
                   ev, 0)

    def native_stream(self, stream: int) -> int:
        """The ``CUstream`` value for ``stream`` (the same int: streams are driver handles)."""
        return int(self._stream_obj(stream))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            segments = list(self._segments)
            streams = list(self._streams.values())
            events = list(self._events.values())
        vm_calls = self._vm_close()
        # Free what is left, then drop the primary-context reference; failures are ignored
        # because close() runs on teardown paths.
        try:
            with self._current():
                self._drv.cuCtxSynchronize()
                for ptr in segments:
                    self._drv.cuMemFree(ptr)
                for s in streams:
                    self._drv.cuStreamDestroy(s)
                for ev in events:
                    self._drv.cuEventDestroy(ev)
                for name, args in vm_calls:
                    getattr(self._drv, name)(*args)
        except Exception:
            pass
        with self._lock:
            self._segments.clear()
            self._streams.clear()
            self._events.clear()
            self._closed = True
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True after close(), or once the primary context was released at interpreter exit."""
        return self._closed or self._released[0]

    def __repr__(self) -> str:
        return f"<CudaDevice {self.device_string}{' closed' if self.closed else ''}>"


BACKEND = CudaBackend()
