"""OpenCL backend through pyopencl: any OpenCL 1.2+ device (AMD ROCm, Intel, NVIDIA, Apple, PoCL).

Importing this module does not import pyopencl; that happens in
:meth:`OpenCLBackend.availability`. Device indices run over every platform's devices, in the
order ``pyopencl.get_platforms()`` and ``Platform.get_devices()`` list them.

OpenCL memory has no addresses, so each segment gets a *synthetic* base: a unique, aligned
integer range per device, never reused, so the pool's offset arithmetic works unchanged. A block
resolves to a sub-buffer of its segment (``Buffer.get_sub_region``); its offset must be a
multiple of the device's ``CL_DEVICE_MEM_BASE_ADDR_ALIGN`` (given in bits by OpenCL).

Sub-buffers are cached: ``native_cache`` (a :class:`gpumem._core.native_cache.NativeCache`, a
mapping with a C index) maps a block's synthetic address to ``(nbytes, sub-buffer, segment
handle)``. Addresses are never reused, so an entry names one exact byte range of one live
segment and stays right however the pool splits, merges or reuses the block around it; a
request of another size at the same address replaces the entry. ``Buffer.native`` looks it up
in C by address and size (no lock and no Python object: readers hold the GIL, which no writer
gives up midway) and calls :meth:`OpenCLDevice.resolve` only on a miss. It holds at most
``native_cache_limit`` entries (oldest dropped first); ``free_segment`` and ``close`` drop a
segment's entries before the segment's buffer is released. Entries are only dropped, never
``release()``-d, so a sub-buffer a caller still holds stays valid (OpenCL keeps its parent
alive meanwhile).

Thread safety: each ``OpenCLDevice`` has one lock, ``_lock``, that owns its segments, queues,
events and every write to ``native_cache``. ``_held`` (bytes held per device index, for the
free-memory estimate) has its own module lock.

A program that already has a ``pyopencl.Context`` (and queue) opens a device on it with
:meth:`OpenCLBackend.open_context`; gpumem then uses that context and that queue as stream 0.

Free memory: OpenCL has no standard query. With ``cl_amd_device_attribute_query`` the driver's
``CL_DEVICE_GLOBAL_FREE_MEMORY_AMD`` is used; otherwise ``free`` is an *estimate*,
``global_mem_size`` minus the bytes this process holds in segments on that device (other
processes and the driver's own use are invisible). ``properties().extra["free_memory_source"]``
says which.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

from gpumem._core.native_cache import NativeCache
from gpumem.backends.base import Backend, Device, DeviceKind, DeviceProperties, check_block_range
from gpumem.backends.host import byte_view
from gpumem.errors import (BackendUnavailableError, DriverError, DriverOutOfMemory,
                           InvalidDeviceError, InvalidInputError)
from gpumem.units import format_bytes

__all__ = ["OpenCLBackend", "OpenCLDevice", "BACKEND", "map_cl_error", "ADDRESS_STRIDE"]

_INSTALL_HINT = "pyopencl is not installed (pip install gpumem-pool[opencl])"

# Each device's synthetic addresses start at (index + 1) * ADDRESS_STRIDE: 256 TiB apart, so
# ranges of different devices never meet and never collide with 0 (NULL).
ADDRESS_STRIDE = 1 << 48
_MIN_ALIGNMENT = 256

# Cached sub-buffers per device: host-side objects only (no device memory of their own), a few
# hundred bytes each in the driver and pyopencl.
NATIVE_CACHE_LIMIT = 8192

# OpenCL status codes that mean "no memory" (cl.h).
_CL_MEM_OBJECT_ALLOCATION_FAILURE = -4
_CL_OUT_OF_RESOURCES = -5
_CL_OUT_OF_HOST_MEMORY = -6
_CL_INVALID_BUFFER_SIZE = -61
_OOM_CODES = (_CL_MEM_OBJECT_ALLOCATION_FAILURE, _CL_OUT_OF_RESOURCES, _CL_OUT_OF_HOST_MEMORY)

# Bytes each device's segments hold in this process, for the free-memory estimate; shared by
# every OpenCLDevice opened on the same device index.
_held_lock = threading.Lock()
_held: dict[int, int] = {}


def _status_name(cl: Any, code: int | None) -> str:
    if code is None:
        return "UNKNOWN"
    try:
        return "CL_" + cl.status_code.to_string(code)
    except Exception:
        return f"CL_ERROR_{code}"


def map_cl_error(cl: Any, exc: BaseException, what: str) -> DriverError:
    """Turn a pyopencl exception into DriverOutOfMemory (allocation failures) or DriverError."""
    code = getattr(exc, "code", None)
    try:
        code = int(code) if code is not None else None
    except (TypeError, ValueError):
        code = None
    name = _status_name(cl, code)
    msg = f"{what} failed: {name}: {exc}"
    oom = isinstance(exc, getattr(cl, "MemoryError", ())) or code in _OOM_CODES
    return (DriverOutOfMemory if oom else DriverError)(msg, code=code, code_name=name)


class OpenCLBackend(Backend):
    """Every OpenCL device of every platform pyopencl finds."""

    name = "opencl"
    kind = DeviceKind.DEVICE

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probed: tuple[bool, str] | None = None
        self._cl: Any = None
        self._devices: list[tuple[Any, Any]] = []     # (platform, device)

    def availability(self) -> tuple[bool, str]:
        with self._lock:
            if self._probed is None:
                self._probed = self._probe()
            return self._probed

    def _probe(self) -> tuple[bool, str]:
        try:
            import pyopencl as cl
        except ImportError as exc:
            return False, f"{_INSTALL_HINT}: {exc}"
        except Exception as exc:
            return False, f"pyopencl failed to import: {type(exc).__name__}: {exc}"
        try:
            platforms = cl.get_platforms()
        except Exception as exc:
            # No ICD loader entries: pyopencl raises LogicError PLATFORM_NOT_FOUND_KHR.
            return False, (f"no OpenCL platform found (install a vendor driver/ICD, or "
                           f"pocl-binary-distribution for CPUs): {exc}")
        devices: list[tuple[Any, Any]] = []
        for platform in platforms:
            try:
                devices.extend((platform, d) for d in platform.get_devices())
            except Exception:
                continue        # a platform with no devices raises DEVICE_NOT_FOUND
        if not devices:
            names = ", ".join(p.name for p in platforms) or "none"
            return False, f"OpenCL platforms found ({names}) but no device"
        self._cl = cl
        self._devices = devices
        return True, ""

    def _require(self) -> Any:
        ok, reason = self.availability()
        if not ok:
            raise BackendUnavailableError(f"backend 'opencl' is unavailable: {reason}")
        return self._cl

    def device_count(self) -> int:
        self._require()
        return len(self._devices)

    def device_names(self) -> list[str]:
        self._require()
        return [f"opencl:{i} ({d.name.strip()} on {p.name.strip()})"
                for i, (p, d) in enumerate(self._devices)]

    def open(self, index: int) -> OpenCLDevice:
        cl = self._require()
        if isinstance(index, bool) or not isinstance(index, int) or \
                not 0 <= index < len(self._devices):
            raise InvalidDeviceError(
                f"no OpenCL device with index {index!r}; {len(self._devices)} device(s) here: "
                f"{', '.join(self.device_names())}")
        platform, device = self._devices[index]
        return OpenCLDevice(cl, index, platform, device)

    def open_context(self, context: Any, queue: Any = None, device: Any = None) -> OpenCLDevice:
        """A device that uses an existing ``pyopencl.Context`` and, when given, its in-order
        ``CommandQueue`` as stream 0 (else a new queue in that context). ``device`` picks one
        of the context's devices (default: the queue's, else the context's only one)."""
        cl = self._require()
        if not isinstance(context, cl.Context):
            raise InvalidInputError(f"context must be a pyopencl.Context, got "
                                    f"{type(context).__name__}")
        if queue is not None:
            if not isinstance(queue, cl.CommandQueue):
                raise InvalidInputError(f"queue must be a pyopencl.CommandQueue or None, got "
                                        f"{type(queue).__name__}")
            if queue.context != context:
                raise InvalidInputError("queue belongs to another context than `context`")
            if queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
                raise InvalidInputError(
                    "queue is out-of-order: gpumem reuses a freed block for work enqueued "
                    "later on the same queue, which only an in-order queue makes safe")
            if device is not None and queue.device != device:
                raise InvalidInputError("queue is on another device than `device`")
            device = queue.device
        ctx_devices = context.devices
        if device is None:
            if len(ctx_devices) != 1:
                raise InvalidInputError(
                    f"the context has {len(ctx_devices)} devices: pass `device` (or a queue)")
            device = ctx_devices[0]
        elif device not in ctx_devices:
            raise InvalidInputError(f"device {device.name.strip()!r} is not in the context")
        for index, (platform, known) in enumerate(self._devices):
            if known == device:
                return OpenCLDevice(cl, index, platform, device, context=context, queue=queue)
        raise InvalidInputError(
            f"device {device.name.strip()!r} is not one of the OpenCL devices listed here "
            f"(sub-devices are not supported): {', '.join(self.device_names())}")


class _Segment:
    __slots__ = ("buffer", "nbytes", "base", "cached")

    def __init__(self, buffer: Any, nbytes: int, base: int) -> None:
        self.buffer = buffer
        self.nbytes = nbytes
        self.base = base
        self.cached: set[int] = set()      # addresses of this segment's native_cache entries


class OpenCLDevice(Device):
    """One OpenCL device with its own context. Streams are command queues; stream 0 is the
    default (in-order) queue. All copies and fills are waited for before returning."""

    backend = "opencl"
    kind = DeviceKind.DEVICE

    def __init__(self, cl: Any, index: int, platform: Any, device: Any, *,
                 context: Any = None, queue: Any = None) -> None:
        self._cl = cl
        self.index = index
        self.platform = platform
        self.device = device
        self._lock = threading.RLock()
        self._ctx: Any = context                      # made on first need: describe() is cheap
        self._queues: dict[int, Any] = {}
        if context is not None:
            self._queues[0] = queue if queue is not None else cl.CommandQueue(context, device)
        #: synthetic address -> (nbytes, sub-buffer, segment handle); see the module docstring.
        #: Only ever mutated in place: ManagerCore keeps a reference to this very dict.
        self.native_cache = NativeCache()
        self.native_cache_limit = NATIVE_CACHE_LIMIT
        self._segments: dict[int, _Segment] = {}
        self._handles = itertools.count(1)
        self._stream_ids = itertools.count(1)
        self._events: dict[int, Any] = {}            # event handle -> pyopencl marker Event
        self._event_ids = itertools.count(1)
        # Required sub-buffer origin alignment (the spec gives MEM_BASE_ADDR_ALIGN in bits).
        self.sub_buffer_alignment = max(1, int(device.mem_base_addr_align) // 8)
        self.alignment = max(self.sub_buffer_alignment, _MIN_ALIGNMENT)
        self.max_alloc = int(device.max_mem_alloc_size)
        self._next_base = (index + 1) * ADDRESS_STRIDE
        self._has_fill = _cl_version(device) >= (1, 2)   # clEnqueueFillBuffer is OpenCL 1.2
        try:
            self._amd_free = "cl_amd_device_attribute_query" in device.extensions
        except Exception:
            self._amd_free = False
        self._closed = False

    # --- context and queues --------------------------------------------------------------------
    @property
    def context(self) -> Any:
        """The pyopencl Context (created on first use)."""
        with self._lock:
            if self._closed:
                raise InvalidInputError(f"{self.device_string} has been closed")
            if self._ctx is None:
                try:
                    self._ctx = self._cl.Context([self.device])
                    self._queues[0] = self._cl.CommandQueue(self._ctx, self.device)
                except self._cl.Error as exc:
                    raise map_cl_error(self._cl, exc, "creating the OpenCL context") from None
            return self._ctx

    def queue(self, stream: int = 0) -> Any:
        """The pyopencl CommandQueue behind ``stream`` (0: the default queue)."""
        _ = self.context        # creates the context and the default queue on first use
        with self._lock:
            q = self._queues.get(stream)
        if q is None:
            raise InvalidInputError(f"{self.device_string}: unknown stream {stream!r}")
        return q

    # --- queries -------------------------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        d, p, cl = self.device, self.platform, self._cl
        extra: dict[str, Any] = {
            "platform": p.name.strip(),
            "vendor": d.vendor.strip(),
            "opencl_version": d.version.strip(),
            "driver_version": d.driver_version.strip(),
            "device_type": cl.device_type.to_string(d.type),
            "max_alloc": self.max_alloc,
            "compute_units": int(d.max_compute_units),
            "clock_mhz": int(d.max_clock_frequency),
            "mem_base_addr_align_bits": int(d.mem_base_addr_align),
            "sub_buffer_alignment": self.sub_buffer_alignment,
            "free_memory_source": "cl_amd_device_attribute_query" if self._amd_free
                                  else "estimate (total - bytes held by this process)",
        }
        return DeviceProperties(name=d.name.strip(), total_memory=int(d.global_mem_size),
                                alignment=self.alignment, extra=extra)

    def mem_get_info(self) -> tuple[int, int]:
        total = int(self.device.global_mem_size)
        if self._amd_free:
            try:
                # CL_DEVICE_GLOBAL_FREE_MEMORY_AMD: [total free, largest free block] in KiB.
                free_kib = self.device.get_info(self._cl.device_info.GLOBAL_FREE_MEMORY_AMD)
                free = int(free_kib[0] if isinstance(free_kib, (list, tuple)) else free_kib)
                return min(free * 1024, total), total
            except Exception:
                pass
        with _held_lock:
            held = _held.get(self.index, 0)
        return max(0, total - held), total

    # --- raw segments ----------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int) -> tuple[int, int]:
        cl = self._cl
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidInputError(f"segment size must be a positive int, got {nbytes!r}")
        if nbytes > self.max_alloc:
            raise DriverOutOfMemory(
                f"{self.device_string}: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes) in "
                f"one buffer: the device's CL_DEVICE_MAX_MEM_ALLOC_SIZE is "
                f"{format_bytes(self.max_alloc)}", code=_CL_INVALID_BUFFER_SIZE,
                code_name="CL_INVALID_BUFFER_SIZE")
        ctx = self.context
        queue = self.queue(0)
        try:
            buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
            # Drivers allocate lazily; touching one byte makes the buffer resident now, so a
            # shortage surfaces here (as pyopencl's ImmediateAllocator does).
            if self._has_fill:
                cl.enqueue_fill_buffer(queue, buf, b"\0", 0, 1).wait()
            else:
                cl.enqueue_copy(queue, buf, b"\0", is_blocking=True)
        except cl.Error as exc:
            raise map_cl_error(cl, exc, f"{self.device_string}: allocating "
                                        f"{format_bytes(nbytes)} ({nbytes} bytes)") from None
        with self._lock:
            handle = next(self._handles)
            base = self._next_base
            # Keep a gap of one alignment unit so that one-past-the-end never equals the next base.
            span = -(-nbytes // self.alignment) * self.alignment + self.alignment
            self._next_base += span
            self._segments[handle] = _Segment(buf, nbytes, base)
        with _held_lock:
            _held[self.index] = _held.get(self.index, 0) + nbytes
        return handle, base

    def free_segment(self, handle: int) -> None:
        with self._lock:
            seg = self._segments.pop(handle, None)
            if seg is not None:
                self._drop_cached(seg)
        if seg is None:
            raise InvalidInputError(
                f"{self.device_string}: unknown segment handle {handle!r} "
                f"(not allocated by this device, or already freed)")
        try:
            # OpenCL keeps the memory until enqueued commands using it finish, so this is safe.
            seg.buffer.release()
        except self._cl.Error as exc:
            with self._lock:                  # not released: the handle stays valid
                self._segments[handle] = seg
            raise map_cl_error(self._cl, exc, "releasing a buffer") from None
        with _held_lock:
            _held[self.index] = _held.get(self.index, 0) - seg.nbytes

    def _segment(self, handle: int, offset: int, nbytes: int) -> _Segment:
        with self._lock:
            seg = self._segments.get(handle)
        check_block_range(self.device_string, handle, None if seg is None else seg.nbytes,
                          offset, nbytes)
        return seg

    def segment_size(self, handle: int) -> int:
        return self._segment(handle, 0, 0).nbytes

    @property
    def holds_host_memory(self) -> bool:
        """A CPU-type OpenCL device (PoCL) holds the host's memory."""
        try:
            kind = str(self.properties().extra.get("device_type", "")).upper()
        except Exception:
            return False
        return "CPU" in kind and "GPU" not in kind

    def segment_buffer(self, handle: int) -> Any:
        """The whole segment's ``pyopencl.Buffer``."""
        return self._segment(handle, 0, 0).buffer

    def _drop_cached(self, seg: _Segment) -> None:
        """Forget seg's native_cache entries (under _lock)."""
        cache = self.native_cache
        for ptr in seg.cached:
            cache.pop(ptr, None)
        seg.cached.clear()

    def resolve(self, handle: int, offset: int, nbytes: int) -> Any:
        """A ``pyopencl.Buffer`` sub-buffer for ``[offset, offset + nbytes)`` of the segment,
        cached (see the module docstring): the same range resolves to the same object.

        ``offset`` must be a multiple of ``sub_buffer_alignment`` (OpenCL's rule for sub-buffer
        origins). ``nbytes == 0`` returns None: OpenCL has no empty buffers. The whole segment
        resolves to the segment's own buffer. Do not ``release()`` the result: it is shared.
        """
        seg = self._segment(handle, offset, nbytes)
        if offset % self.sub_buffer_alignment:
            raise InvalidInputError(
                f"{self.device_string}: sub-buffer offset {offset} is not a multiple of the "
                f"device's base address alignment of {self.sub_buffer_alignment} bytes "
                f"(CL_DEVICE_MEM_BASE_ADDR_ALIGN = {self.sub_buffer_alignment * 8} bits)")
        if nbytes == 0:
            return None
        ptr = seg.base + offset
        entry = self.native_cache.get(ptr)
        if entry is not None and entry[0] == nbytes and entry[2] == handle:
            return entry[1]
        if offset == 0 and nbytes == seg.nbytes:
            sub = seg.buffer
        else:
            try:
                sub = seg.buffer.get_sub_region(offset, nbytes)
            except self._cl.Error as exc:
                raise map_cl_error(self._cl, exc, "creating a sub-buffer") from None
        with self._lock:
            if self._segments.get(handle) is not seg:
                return sub                     # freed meanwhile: not cached
            cache = self.native_cache
            old = cache.pop(ptr, None)          # another size at this address: replaced
            while len(cache) >= self.native_cache_limit > 0:
                oldest = next(iter(cache))
                _, _, owner = cache.pop(oldest)
                owner_seg = self._segments.get(owner)
                if owner_seg is not None:
                    owner_seg.cached.discard(oldest)
            if self.native_cache_limit > 0:
                cache[ptr] = (nbytes, sub, handle)
                seg.cached.add(ptr)
            elif old is not None:
                seg.cached.discard(ptr)
        return sub

    # --- data movement ---------------------------------------------------------------------------
    def copy_from_host(self, handle: int, offset: int, src: memoryview, stream: int = 0) -> None:
        mv = byte_view(src)
        seg = self._segment(handle, offset, mv.nbytes)
        if not mv.nbytes:
            return
        try:
            self._cl.enqueue_copy(self.queue(stream), seg.buffer, mv, dst_offset=offset,
                                  is_blocking=True)
        except self._cl.Error as exc:
            raise map_cl_error(self._cl, exc, "copy to device") from None

    def copy_to_host(self, handle: int, offset: int, dst: memoryview, stream: int = 0) -> None:
        mv = byte_view(dst)
        if mv.readonly:
            raise InvalidInputError("copy_to_host: the destination buffer is read-only")
        seg = self._segment(handle, offset, mv.nbytes)
        if not mv.nbytes:
            return
        try:
            self._cl.enqueue_copy(self.queue(stream), mv, seg.buffer, src_offset=offset,
                                  is_blocking=True)
        except self._cl.Error as exc:
            raise map_cl_error(self._cl, exc, "copy from device") from None

    def memset(self, handle: int, offset: int, value: int, nbytes: int, stream: int = 0) -> None:
        if not 0 <= value <= 255:
            raise InvalidInputError(f"memset value must be a byte 0..255, got {value}")
        seg = self._segment(handle, offset, nbytes)
        if not nbytes:
            return
        queue = self.queue(stream)
        try:
            if self._has_fill:
                self._cl.enqueue_fill_buffer(queue, seg.buffer, bytes([value]), offset,
                                             nbytes).wait()
                return
            chunk = bytes([value]) * min(nbytes, 16 * 1024 * 1024)
            for start in range(0, nbytes, len(chunk)):
                n = min(len(chunk), nbytes - start)
                self._cl.enqueue_copy(queue, seg.buffer, memoryview(chunk)[:n],
                                      dst_offset=offset + start, is_blocking=True)
        except self._cl.Error as exc:
            raise map_cl_error(self._cl, exc, "fill buffer") from None

    # --- streams ---------------------------------------------------------------------------------
    def create_stream(self) -> int:
        ctx = self.context
        try:
            q = self._cl.CommandQueue(ctx, self.device)
        except self._cl.Error as exc:
            raise map_cl_error(self._cl, exc, "creating a command queue") from None
        with self._lock:
            sid = next(self._stream_ids)
            self._queues[sid] = q
        return sid

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            q = self._queues.pop(stream, None) if stream != 0 else None
        if q is None:
            raise InvalidInputError(
                f"{self.device_string}: stream {stream!r} was not created by this device")
        try:
            q.finish()      # the queue itself is released when its last reference goes
        except self._cl.Error as exc:
            raise map_cl_error(self._cl, exc, "clFinish") from None
        finally:
            self._stream_destroyed(stream)    # gone from this device either way

    def _marker(self, stream: int) -> Any:
        """A marker enqueued on ``stream``'s in-order queue, flushed so it is submitted: it
        completes only after every earlier command on that queue."""
        cl = self._cl
        q = self.queue(stream)
        try:
            marker = cl.enqueue_marker(q)
            q.flush()
        except cl.Error as exc:
            raise map_cl_error(cl, exc, "enqueueing a marker") from None
        return marker

    def _complete(self, marker: Any) -> bool:
        cl = self._cl
        try:
            return marker.command_execution_status == cl.command_execution_status.COMPLETE
        except cl.Error as exc:
            raise map_cl_error(cl, exc, "querying an event") from None

    def stream_idle(self, stream: int) -> bool:
        return self._complete(self._marker(stream))

    # Events are markers too.
    def record_event(self, stream: int = 0) -> int:
        marker = self._marker(stream)
        with self._lock:
            event = next(self._event_ids)
            self._events[event] = marker
        return event

    def event_done(self, event: int) -> bool:
        with self._lock:
            marker = self._events.get(event)
        if marker is None:
            raise InvalidInputError(f"{self.device_string}: unknown event {event!r}")
        return self._complete(marker)

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if self._events.pop(event, None) is None:
                raise InvalidInputError(f"{self.device_string}: unknown event {event!r}")

    def synchronize(self) -> None:
        with self._lock:
            if self._ctx is None:
                return
            queues = list(self._queues.values())
        for q in queues:
            try:
                q.finish()
            except self._cl.Error as exc:
                raise map_cl_error(self._cl, exc, "clFinish") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            segments = list(self._segments.values())
            queues = list(self._queues.values())
            self.native_cache.clear()           # before the segments' buffers are released
            self._segments.clear()
            self._queues.clear()
            self._events.clear()
            self._closed = True
            ctx, self._ctx = self._ctx, None
        for q in queues:
            try:
                q.finish()
            except Exception:
                pass
        held = 0
        for seg in segments:
            held += seg.nbytes
            try:
                seg.buffer.release()
            except Exception:
                pass
        with _held_lock:
            _held[self.index] = _held.get(self.index, 0) - held
        del ctx

    def __repr__(self) -> str:
        return f"<OpenCLDevice {self.device_string} {self.device.name.strip()!r}>"


def _cl_version(device: Any) -> tuple[int, int]:
    """``(major, minor)`` from a version string such as ``"OpenCL 3.0 PoCL ..."``."""
    try:
        major, minor = device.version.split()[1].split(".")[:2]
        return int(major), int(minor)
    except Exception:
        return (1, 2)


BACKEND = OpenCLBackend()
