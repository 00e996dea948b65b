"""The backend protocol: what the manager needs from a driver.

A *backend* (sim, cuda, opencl, cpu) enumerates devices and opens them. An opened
:class:`Device` hands out raw *segments* and knows nothing of blocks: the Cython pool carves
segments into blocks by offset. Every segment is named by an integer ``handle`` and starts at an
integer ``base`` address; ``base`` is a real device pointer for CUDA and host memory, a simulated
address for sim, and a synthetic, unique address range for OpenCL (where the user-facing object is
a sub-buffer, see :meth:`Device.resolve`).

Streams are integers; ``0`` is the device's default stream/queue.

What the rest of gpumem needs to know about a device it reads from declarations here, never
from a backend's name: :attr:`Device.kind` (an accelerator's own memory, the host's, or a
simulation), :attr:`Device.dlpack_device_type` and :meth:`Device.dlpack_device` (which array
protocols a buffer offers), :meth:`Device.segment_pinned`, :meth:`Device.segment_size`,
:attr:`Device.holds_host_memory` (ranked last when a device is chosen) and
:attr:`Device.supports_virtual_memory`. A new backend is one module with a :class:`Backend`
and a :class:`Device` subclass plus one row in the registry (``gpumem/backends/__init__.py``,
or :func:`gpumem.backends.register_backend` from outside the package).

Virtual memory (optional). A device whose driver can map physical pages into reserved address
ranges (CUDA's ``cuMem*`` VMM calls; sim models them) says so with
:attr:`Device.supports_virtual_memory` and implements the ``vm_*`` calls. The rules are the
strictest common ones, so code written for one such backend runs on every other:

- sizes and addresses are multiples of :meth:`Device.vm_granularity`;
- a reserved range costs address space only; a physical page handle (:meth:`Device.vm_create`)
  costs device memory (``mem_get_info`` drops) until it is released;
- :meth:`Device.vm_map` maps one whole handle at an address inside one reservation whose bytes
  there are unmapped, and makes it readable and writable by the device (map + set access);
- :meth:`Device.vm_unmap` removes exactly one mapping; a handle is released
  (:meth:`Device.vm_release`) and a reservation freed (:meth:`Device.vm_free`) only once
  nothing is mapped through it;
- a reservation's address is a segment handle for :meth:`Device.resolve`, the copies and
  memset; the bytes they touch must be mapped.

Devices that cannot (OpenCL, host) keep the defaults below: the flag is False and every call
raises :class:`~gpumem.errors.UnsupportedOperationError`; the pool then uses plain segments.
"""
from __future__ import annotations

import abc
import enum
import inspect
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from gpumem.errors import InvalidInputError, UnsupportedOperationError

__all__ = ["DeviceKind", "DeviceProperties", "DeviceDescription", "Device", "Backend",
           "check_block_range", "DLPACK_CPU", "DLPACK_CUDA", "DLPACK_CUDA_HOST"]

#: DLPack device types (dlpack.h ``DLDeviceType``) a device may declare for its memory
DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_CUDA_HOST = 3            # page-locked host memory (a pinned segment of a kDLCPU device)


class DeviceKind(str, enum.Enum):
    """What a backend's memory is."""

    DEVICE = "device"           # an accelerator's own memory (cuda, opencl)
    HOST = "host"               # the host's memory, addressable by the CPU (cpu)
    SIMULATED = "simulated"     # a simulated device (sim): addresses, not memory a library reads

#: Guards every device's list of stream listeners (short critical sections, no callbacks run
#: under it).
_listeners_lock = threading.Lock()


def check_block_range(device: str, handle: int, size: int | None, offset: int,
                      nbytes: int) -> None:
    """Raise InvalidInputError unless segment ``handle`` exists (``size`` is its byte count, None
    when unknown) and ``[offset, offset + nbytes)`` lies inside it. Every backend's copies,
    memset and resolve go through this one check."""
    if size is None:
        raise InvalidInputError(f"{device}: unknown segment handle {handle!r}")
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise InvalidInputError(
            f"{device}: range [{offset}, {offset + nbytes}) is outside the segment of "
            f"{size} bytes")


@dataclass(frozen=True)
class DeviceProperties:
    """What the driver says about a device. ``extra`` holds backend-specific attributes
    (compute capability, multiprocessor count, clock, bus width, OpenCL version...)."""

    name: str
    total_memory: int
    alignment: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceDescription:
    """One row of :func:`gpumem.devices`: a device, or an unavailable backend with its reason."""

    device: str                 # "cuda:0", "opencl:0", "sim:1", "cpu"; "cuda" when unavailable
    backend: str
    available: bool
    name: str = ""
    total_memory: int = 0
    free_memory: int = 0
    reason: str = ""            # why the backend is unavailable
    kind: DeviceKind = DeviceKind.DEVICE    # the backend's kind (Backend.kind)

    @property
    def simulated(self) -> bool:
        """A simulated device (or the sim backend's "none installed" row)."""
        return self.kind is DeviceKind.SIMULATED


class Device(abc.ABC):
    """One opened device. Implementations must be safe to call from several threads."""

    backend: str                # the registry name: "sim", "cuda", "opencl", "cpu", ...
    index: int
    #: what the memory is; a subclass declares it (Backend.kind says the same of its devices)
    kind: DeviceKind = DeviceKind.DEVICE
    #: the DLPack device type of this device's memory (DLPACK_CPU, DLPACK_CUDA), None where
    #: DLPack cannot address it (OpenCL buffers, simulated addresses). DLPACK_CUDA buffers also
    #: offer ``__cuda_array_interface__``, DLPACK_CPU ones ``__array_interface__``.
    dlpack_device_type: int | None = None

    @property
    def device_string(self) -> str:
        return f"{self.backend}:{self.index}"

    @property
    def holds_host_memory(self) -> bool:
        """True when the memory is the host's (the ``host`` kind; a CPU-type OpenCL device such
        as PoCL overrides it). Such a device ranks after every accelerator when a device is
        chosen automatically."""
        return self.kind is DeviceKind.HOST

    # --- queries -------------------------------------------------------------------------
    @abc.abstractmethod
    def properties(self) -> DeviceProperties:
        """Name, total memory, base-address alignment and what else the driver reports."""

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes, from the driver, never an assumed size."""

    def recommended_reserve(self, total: int) -> int:
        """Bytes of ``total`` a manager should leave to the driver and context (CUDA: driver
        and context overhead plus an emergency margin). Default: nothing."""
        return 0

    # --- raw segments ------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc_segment(self, nbytes: int) -> tuple[int, int]:
        """Allocate ``nbytes`` of raw device memory, resident now. Returns ``(handle, base)``.

        Raises :class:`gpumem.errors.DriverOutOfMemory` when the driver has no room and
        :class:`gpumem.errors.DriverError` for any other driver failure.
        """

    @abc.abstractmethod
    def free_segment(self, handle: int) -> None:
        """Return a segment to the driver. Raises DriverError if the driver fails."""

    @abc.abstractmethod
    def resolve(self, handle: int, offset: int, nbytes: int) -> Any:
        """The native object for a block: its address (int) for cuda/cpu/sim, a sub-buffer
        (``pyopencl.Buffer``) for OpenCL."""

    @abc.abstractmethod
    def segment_size(self, handle: int) -> int:
        """The byte count of a live segment from :meth:`alloc_segment`; InvalidInputError for
        a handle the device does not hold (freed, or never one of its segments)."""

    def segment_pinned(self, handle: int) -> bool:
        """True when the segment is page-locked host memory (DLPack: kDLCUDAHost). Default:
        no segment is."""
        return False

    def dlpack_device(self, handle: int) -> tuple[int, int] | None:
        """``(DLPack device type, device id)`` of segment ``handle``'s memory, None where DLPack
        cannot address it: from :attr:`dlpack_device_type`, a pinned host segment being
        kDLCUDAHost."""
        kind = self.dlpack_device_type
        if kind is None:
            return None
        if kind == DLPACK_CPU:
            return (DLPACK_CUDA_HOST if self.segment_pinned(handle) else DLPACK_CPU, 0)
        return (kind, self.index)

    # --- data movement (tests, CPU fallback, migration) ---------------------------------------
    @abc.abstractmethod
    def copy_from_host(self, handle: int, offset: int, src: memoryview, stream: int = 0) -> None:
        """Copy ``src`` (contiguous bytes) into the segment at ``offset``; synchronous."""

    @abc.abstractmethod
    def copy_to_host(self, handle: int, offset: int, dst: memoryview, stream: int = 0) -> None:
        """Copy ``len(dst)`` bytes from the segment at ``offset`` into ``dst``; synchronous."""

    @abc.abstractmethod
    def memset(self, handle: int, offset: int, value: int, nbytes: int, stream: int = 0) -> None:
        """Fill ``nbytes`` at ``offset`` with the byte ``value``; synchronous."""

    # --- streams -------------------------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self) -> int:
        """A new stream (CUDA stream, OpenCL queue); returns its nonzero integer handle."""

    @abc.abstractmethod
    def destroy_stream(self, stream: int) -> None:
        """Release a stream made by :meth:`create_stream`."""

    @abc.abstractmethod
    def stream_idle(self, stream: int) -> bool:
        """True when every piece of work submitted to ``stream`` so far has finished. The pool
        lends a block freed on one stream to another only once this says so."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on the device (before segments are returned to the driver)."""

    # --- who is told when a stream is destroyed -------------------------------------------------
    def add_stream_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(stream)`` after :meth:`destroy_stream` destroyed ``stream`` (managers
        stop serving it). A bound method is held weakly: a listener never keeps its manager
        alive."""
        ref: Callable[[], Any] = (weakref.WeakMethod(callback) if inspect.ismethod(callback)
                                  else (lambda: callback))
        with _listeners_lock:
            self.__dict__.setdefault("_stream_listeners", []).append(ref)

    def _stream_destroyed(self, stream: int) -> None:
        """Backends call this at the end of a successful destroy_stream."""
        with _listeners_lock:
            refs = self.__dict__.get("_stream_listeners", [])
            alive = [r for r in refs if r() is not None]
            refs[:] = alive
        for ref in alive:                     # outside the lock: listeners take their own
            callback = ref()
            if callback is not None:
                callback(stream)

    # --- events (a block used on several streams is reused only once they pass its free) -----
    # The defaults are correct for any device but coarse: recording synchronizes everything.
    # Every bundled backend overrides them with the driver's own events.
    def record_event(self, stream: int = 0) -> int:
        """A marker after the work submitted to ``stream`` so far; returns its handle."""
        self.stream_idle(stream)          # validates the stream
        self.synchronize()
        return 0

    def event_done(self, event: int) -> bool:
        """True once the work before the event has finished; never blocks."""
        return True

    def destroy_event(self, event: int) -> None:
        """Release an event from :meth:`record_event` (it may still be pending)."""

    def wait_event(self, stream: int, event: int) -> None:
        """Make work submitted to ``stream`` after this call wait for ``event``, without
        blocking the host where the driver can (DLPack hands a buffer to another stream)."""
        self.stream_idle(stream)          # validates the stream
        self.synchronize()                # the coarse default: everything before is done

    # --- virtual memory (optional; see the module docstring for the rules) -------------------
    @property
    def supports_virtual_memory(self) -> bool:
        """True when the ``vm_*`` calls work on this device."""
        return False

    def _no_virtual_memory(self, call: str) -> UnsupportedOperationError:
        return UnsupportedOperationError(
            f"{self.device_string}: the {self.backend} backend has no virtual-memory mapping, so "
            f"{call}() is not available (check Device.supports_virtual_memory first)")

    def vm_granularity(self) -> int:
        """Bytes every reservation, page handle, mapping and address is a multiple of."""
        raise self._no_virtual_memory("vm_granularity")

    def vm_reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of address space (no memory behind it); returns its address."""
        raise self._no_virtual_memory("vm_reserve")

    def vm_free(self, address: int, nbytes: int) -> None:
        """Give back a whole reservation from :meth:`vm_reserve`; nothing may be mapped in it."""
        raise self._no_virtual_memory("vm_free")

    def vm_create(self, nbytes: int) -> int:
        """A physical page handle of ``nbytes`` (a multiple of the granularity); raises
        :class:`~gpumem.errors.DriverOutOfMemory` when the device has no room."""
        raise self._no_virtual_memory("vm_create")

    def vm_map(self, address: int, nbytes: int, handle: int) -> None:
        """Map the whole of ``handle`` (``nbytes`` long) at ``address`` and give the device
        read/write access. On failure nothing stays mapped."""
        raise self._no_virtual_memory("vm_map")

    def vm_unmap(self, address: int, nbytes: int) -> None:
        """Remove the one mapping that starts at ``address`` and spans ``nbytes``."""
        raise self._no_virtual_memory("vm_unmap")

    def vm_release(self, handle: int) -> None:
        """Release a page handle that is not mapped anywhere; its memory returns to the device."""
        raise self._no_virtual_memory("vm_release")

    def close(self) -> None:
        """Release driver resources held by this object (contexts, queues). Idempotent."""


class Backend(abc.ABC):
    """A family of devices reached through one driver."""

    name: str                   # the registry name: "sim", "cuda", "opencl", "cpu", ...
    kind: DeviceKind = DeviceKind.DEVICE     # what its devices' memory is (Device.kind)

    @abc.abstractmethod
    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` or ``(False, reason)``; must not raise, must not crash without a driver."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices; raises BackendUnavailableError when the backend is unavailable."""

    @abc.abstractmethod
    def open(self, index: int) -> Device:
        """Open device ``index``; raises InvalidDeviceError (listing devices) for a bad index."""

    def describe(self) -> list[DeviceDescription]:
        """One row per device, or one row saying why the backend is unavailable."""
        ok, reason = self.availability()
        if not ok:
            return [DeviceDescription(device=self.name, backend=self.name, available=False,
                                      reason=reason, kind=self.kind)]
        rows = []
        for i in range(self.device_count()):
            dev = self.open(i)
            props = dev.properties()
            free, total = dev.mem_get_info()
            rows.append(DeviceDescription(device=dev.device_string, backend=self.name,
                                          available=True, name=props.name,
                                          total_memory=total, free_memory=free,
                                          kind=self.kind))
        return rows
