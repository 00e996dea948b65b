"""The "cpu" backend: host memory as a device, and the host-buffer helpers other modules share.

Segments are page-aligned anonymous memory maps, populated at allocation so that a shortage is
reported by :meth:`HostDevice.alloc_segment` rather than by the kernel's OOM killer at first
touch. When CUDA is available the segments are *pinned* (``cuMemHostAlloc``), which makes
copies to and from a GPU fast and asynchronous-capable; otherwise, or if pinning fails, they are
ordinary pageable memory. ``DeviceProperties.extra["pinned"]`` says which mode is on.

Host work is synchronous: streams are bookkeeping only and are always idle.

Helpers for the manager: :func:`array_interface` builds a NumPy ``__array_interface__`` (v3)
dict for a uint8 range, :func:`host_array` and :func:`host_memoryview` view a host address
range, :func:`host_memory_info` is the ``(free, total)`` the OS reports.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

from gpumem.backends.base import (DLPACK_CPU, Backend, Device, DeviceKind, DeviceProperties,
                                  check_block_range)
from gpumem.errors import (DriverError, DriverOutOfMemory, InvalidDeviceError,
                           InvalidInputError)
from gpumem.units import format_bytes

__all__ = ["HostBackend", "HostDevice", "BACKEND", "array_interface", "HostBufferView",
           "host_array", "host_memoryview", "host_memory_info", "byte_view", "buffer_address",
           "HOST_ALIGNMENT"]

# Segments start on a page boundary; blocks the pool carves at multiples of 256 bytes are
# therefore aligned like CUDA allocations, which is what array libraries expect.
HOST_ALIGNMENT = 256
PAGE_SIZE = mmap.PAGESIZE


# --------------------------------------------------------------------------------------------
# Buffer helpers (shared with the CUDA backend and the manager)
# --------------------------------------------------------------------------------------------
def byte_view(buf: Any) -> memoryview:
    """A flat ``'B'`` memoryview of a C-contiguous buffer (bytes, bytearray, numpy array...)."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise InvalidInputError("host buffer must be C-contiguous")
    return mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


def buffer_address(mv: memoryview) -> tuple[int, Any]:
    """Address of a contiguous host buffer and an object to keep alive while the address is used.

    Read-only buffers (``bytes``) cannot be exported writable to ctypes; NumPy gives their
    address, and without NumPy they are copied once.
    """
    mv = byte_view(mv)
    if not mv.readonly:
        holder = (ctypes.c_char * mv.nbytes).from_buffer(mv)
        return ctypes.addressof(holder), holder
    try:
        import numpy as np
    except ImportError:
        copy = (ctypes.c_char * mv.nbytes).from_buffer_copy(mv)
        return ctypes.addressof(copy), copy
    arr = np.frombuffer(mv, dtype=np.uint8)
    return int(arr.ctypes.data), arr


def array_interface(ptr: int, nbytes: int, readonly: bool = False) -> dict[str, Any]:
    """The NumPy ``__array_interface__`` (version 3) of ``nbytes`` uint8 at host address ``ptr``."""
    return {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, readonly), "strides": None,
            "version": 3}


class HostBufferView:
    """An object exposing ``__array_interface__`` for a host range; keeps ``owner`` alive."""

    __slots__ = ("ptr", "nbytes", "readonly", "owner")

    def __init__(self, ptr: int, nbytes: int, owner: Any = None, readonly: bool = False) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner
        self.readonly = readonly

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return array_interface(self.ptr, self.nbytes, self.readonly)


def host_array(ptr: int, nbytes: int, owner: Any = None, readonly: bool = False) -> Any:
    """A ``numpy.ndarray`` (uint8) viewing host memory; ``owner`` is kept alive by its base."""
    import numpy as np
    return np.asarray(HostBufferView(ptr, nbytes, owner, readonly))


def host_memoryview(ptr: int, nbytes: int) -> memoryview:
    """A writable ``'B'`` memoryview of host memory (no NumPy needed). The caller keeps the
    memory alive for as long as the view is used."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


# --------------------------------------------------------------------------------------------
# What the OS says about memory
# --------------------------------------------------------------------------------------------
def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_limit() -> tuple[int, int] | None:
    """``(limit, usage)`` of this process's memory cgroup, if it has a limit (containers)."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_path)
        if limit is not None:
            usage = _read_int(usage_path)
            return limit, (usage or 0)
    return None


def host_memory_info() -> tuple[int, int]:
    """``(free, total)`` bytes of host memory from the OS.

    Linux: ``MemAvailable``/``MemTotal`` of ``/proc/meminfo``, narrowed by a cgroup memory limit
    when one is set. Elsewhere: ``sysconf`` page counts. Never an assumed size.
    """
    free = total = None
    try:
        with open("/proc/meminfo") as f:
            info = {}
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    info[key] = int(parts[0]) * 1024   # values are in kB
        total = info.get("MemTotal")
        free = info.get("MemAvailable", info.get("MemFree"))
    except OSError:
        pass
    if total is None or free is None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page
            free = os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError, AttributeError) as exc:
            raise DriverError(f"cannot read host memory size from the OS: {exc}") from None
    cg = _cgroup_limit()
    if cg is not None and 0 < cg[0] < total:
        limit, usage = cg
        total = limit
        free = min(free, max(0, limit - usage))
    return int(min(free, total)), int(total)


# --------------------------------------------------------------------------------------------
# Backend and device
# --------------------------------------------------------------------------------------------
@dataclass
class _Segment:
    address: int
    nbytes: int
    pinned: bool
    mapping: mmap.mmap | None = None   # pageable segments
    holder: Any = None                 # ctypes export of the mapping (released before close)


def _env_pinned() -> bool | None:
    value = os.environ.get("GPUMEM_HOST_PINNED", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return None


def _cuda_available() -> bool:
    try:
        from gpumem.backends import cuda
        return cuda.BACKEND.availability()[0]
    except Exception:
        return False


class HostBackend(Backend):
    """One device, ``"cpu"``: host memory, pinned when CUDA is available.

    ``pinned``: True/False forces the mode, None (default) pins when CUDA is available; the
    environment variable ``GPUMEM_HOST_PINNED=0/1`` overrides the default.
    """

    name = "cpu"
    kind = DeviceKind.HOST

    def __init__(self, pinned: bool | None = None) -> None:
        self._pinned = pinned

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def device_count(self) -> int:
        return 1

    def open(self, index: int = 0) -> HostDevice:
        if index != 0 or isinstance(index, bool):
            raise InvalidDeviceError(
                f"no cpu device with index {index!r}; the cpu backend has one device: "
                f"cpu (index 0)")
        pinned = self._pinned
        if pinned is None:
            pinned = _env_pinned()
        if pinned is None:
            pinned = _cuda_available()
        return HostDevice(pinned=pinned)


class HostDevice(Device):
    """Host memory as a device. Handles are the segments' base addresses."""

    backend = "cpu"
    kind = DeviceKind.HOST
    dlpack_device_type = DLPACK_CPU

    def __init__(self, pinned: bool = False) -> None:
        self.index = 0
        self._pinned = bool(pinned)
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._streams: set[int] = set()
        self._next_stream = 1
        self._events: set[int] = set()
        self._next_event = 1
        self._pinned_fallbacks = 0
        self._held = 0

    # --- queries -------------------------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        free, total = host_memory_info()
        name = _cpu_name()
        with self._lock:
            extra = {"pinned": self._pinned, "pinned_fallbacks": self._pinned_fallbacks,
                     "page_size": PAGE_SIZE, "cpu_count": os.cpu_count(),
                     "bytes_held": self._held}
        return DeviceProperties(name=name, total_memory=total, alignment=HOST_ALIGNMENT,
                                extra=extra)

    def mem_get_info(self) -> tuple[int, int]:
        return host_memory_info()

    # --- raw segments ----------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int) -> tuple[int, int]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidInputError(f"segment size must be a positive int, got {nbytes!r}")
        free, _total = host_memory_info()
        if nbytes > free:
            # Populating more than the OS can give would summon the OOM killer, not an error.
            raise DriverOutOfMemory(
                f"cpu: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes): the OS reports "
                f"{format_bytes(free)} available", code=errno.ENOMEM, code_name="ENOMEM")
        seg = None
        if self._pinned:
            seg = self._alloc_pinned(nbytes)
        if seg is None:
            seg = self._alloc_pageable(nbytes)
        with self._lock:
            self._segments[seg.address] = seg
            self._held += nbytes
        return seg.address, seg.address

    def _alloc_pinned(self, nbytes: int) -> _Segment | None:
        try:
            from gpumem.backends.cuda_host import pinned_alloc
            ptr = pinned_alloc(nbytes)
        except Exception:
            # Pinning is an optimisation: fall back to pageable memory and count it.
            with self._lock:
                self._pinned_fallbacks += 1
            return None
        return _Segment(address=ptr, nbytes=nbytes, pinned=True)

    def _alloc_pageable(self, nbytes: int) -> _Segment:
        size = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        populate = getattr(mmap, "MAP_POPULATE", 0)
        try:
            if hasattr(mmap, "MAP_ANONYMOUS"):
                m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
            else:  # Windows
                m = mmap.mmap(-1, size)
        except (OSError, OverflowError, MemoryError, ValueError) as exc:
            code = getattr(exc, "errno", None) or errno.ENOMEM
            raise DriverOutOfMemory(
                f"cpu: cannot allocate {format_bytes(nbytes)} ({nbytes} bytes): {exc}",
                code=code, code_name=errno.errorcode.get(code, "ENOMEM")) from None
        holder = (ctypes.c_ubyte * size).from_buffer(m)
        address = ctypes.addressof(holder)
        if not populate:
            ctypes.memset(address, 0, size)   # touch every page now (resident at allocation)
        return _Segment(address=address, nbytes=nbytes, pinned=False, mapping=m, holder=holder)

    def free_segment(self, handle: int) -> None:
        with self._lock:
            seg = self._segments.pop(handle, None)
            if seg is None:
                raise InvalidInputError(
                    f"cpu: unknown segment handle {handle!r} "
                    f"(not allocated by this device, or already freed)")
            self._held -= seg.nbytes
        _release(seg)

    def _segment(self, handle: int, offset: int, nbytes: int) -> _Segment:
        with self._lock:
            seg = self._segments.get(handle)
        check_block_range("cpu", handle, None if seg is None else seg.nbytes, offset, nbytes)
        return seg

    def resolve(self, handle: int, offset: int, nbytes: int) -> int:
        return self._segment(handle, offset, nbytes).address + offset

    @property
    def device_string(self) -> str:
        return "cpu"                    # one host: the backend's name alone

    def segment_size(self, handle: int) -> int:
        return self._segment(handle, 0, 0).nbytes

    def segment_pinned(self, handle: int) -> bool:
        """True when the segment is page-locked (cuMemHostAlloc): DLPack calls it kDLCUDAHost."""
        with self._lock:
            seg = self._segments.get(handle)
        if seg is None:
            raise InvalidInputError(f"cpu: unknown segment handle {handle!r}")
        return seg.pinned

    # --- data movement ---------------------------------------------------------------------------
    def copy_from_host(self, handle: int, offset: int, src: memoryview, stream: int = 0) -> None:
        mv = byte_view(src)
        seg = self._segment(handle, offset, mv.nbytes)
        if mv.nbytes:
            host_memoryview(seg.address + offset, mv.nbytes)[:] = mv

    def copy_to_host(self, handle: int, offset: int, dst: memoryview, stream: int = 0) -> None:
        mv = byte_view(dst)
        if mv.readonly:
            raise InvalidInputError("copy_to_host: the destination buffer is read-only")
        seg = self._segment(handle, offset, mv.nbytes)
        if mv.nbytes:
            mv[:] = host_memoryview(seg.address + offset, mv.nbytes)

    def memset(self, handle: int, offset: int, value: int, nbytes: int, stream: int = 0) -> None:
        if not 0 <= value <= 255:
            raise InvalidInputError(f"memset value must be a byte 0..255, got {value}")
        seg = self._segment(handle, offset, nbytes)
        if nbytes:
            ctypes.memset(seg.address + offset, value, nbytes)

    # --- streams (host work is synchronous) ------------------------------------------------------
    def create_stream(self) -> int:
        with self._lock:
            sid = self._next_stream
            self._next_stream += 1
            self._streams.add(sid)
        return sid

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            if stream not in self._streams:
                raise InvalidInputError(f"cpu: stream {stream!r} was not created by this device")
            self._streams.discard(stream)
        self._stream_destroyed(stream)

    def stream_idle(self, stream: int) -> bool:
        with self._lock:
            if stream != 0 and stream not in self._streams:
                raise InvalidInputError(f"cpu: unknown stream {stream!r}")
        return True

    def synchronize(self) -> None:
        return None

    # Host work is done when its call returns, so an event is complete when recorded; the
    # handles are still tracked so misuse (an unknown or destroyed event) is reported.
    def record_event(self, stream: int = 0) -> int:
        self.stream_idle(stream)
        with self._lock:
            event = self._next_event
            self._next_event += 1
            self._events.add(event)
        return event

    def event_done(self, event: int) -> bool:
        with self._lock:
            if event not in self._events:
                raise InvalidInputError(f"cpu: unknown event {event!r}")
        return True

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if event not in self._events:
                raise InvalidInputError(f"cpu: unknown event {event!r}")
            self._events.discard(event)

    def close(self) -> None:
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._streams.clear()
            self._held = 0
        for seg in segments:
            try:
                _release(seg)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<HostDevice cpu pinned={self._pinned}>"


def _release(seg: _Segment) -> None:
    if seg.pinned:
        from gpumem.backends.cuda_host import pinned_free
        pinned_free(seg.address)
        return
    seg.holder = None          # drop the ctypes export first, or mmap.close() refuses
    if seg.mapping is not None:
        seg.mapping.close()
        seg.mapping = None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "host CPU"


BACKEND = HostBackend()
