# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Buffer: one block of a manager's pool, handed to the user.

A Buffer is built only by its manager's hot path (ManagerCore, manager_core.pyx) and goes back
through it (`free()`, a `with` block, garbage collection). What a Buffer may offer is read from
its device's declared capabilities (gpumem.backends.base.Device): host memory (`kind`) gets
`__array_interface__`, memory DLPack calls kDLCUDA gets `__cuda_array_interface__`; no backend
is named here.
"""
cimport cython
from libc.stdint cimport uint64_t
from cpython.ref cimport PyObject

from gpumem._core.manager_base cimport ManagerBase
from gpumem._core.native_cache cimport NativeCache
from gpumem._core.pool cimport gm_block

import warnings

from gpumem._core.manager_base import NOT_COPYABLE
from gpumem.backends.base import DeviceKind, DLPACK_CUDA, DLPACK_CPU
from gpumem.errors import ClosedManagerError, GpuMemoryError, InvalidInputError


@cython.freelist(64)           # recycled objects: ~15 ns off every malloc/free pair
@cython.no_gc_clear            # __dealloc__ needs _owner even when collected in a cycle
cdef class Buffer:
    """A block of device memory. Returned to its pool by `free()`, on leaving a `with` block,
    or when garbage-collected. `ptr` is the device address (synthetic on OpenCL: use `native`
    for the sub-buffer)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("Buffers come from MemoryManager.malloc(); they cannot be built directly")

    # Device memory has one owner: a copy would free the same block twice, a pickle would
    # name an address that means nothing in another process.
    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_COPYABLE.format("Buffer"))

    def __copy__(self):
        raise TypeError(NOT_COPYABLE.format("Buffer"))

    def __deepcopy__(self, memo):
        raise TypeError(NOT_COPYABLE.format("Buffer"))

    @property
    def ptr(self) -> int:
        """The device address (synthetic on OpenCL). Raises once the buffer is freed or its
        manager closed, instead of handing out a dangling address."""
        if self._block == NULL or self._owner._closed:
            self._raise_dead()
        return self._ptr

    cdef int _raise_dead(self) except -1:
        if self._owner is not None and self._owner._closed:
            raise ClosedManagerError(f"buffer {self.id}: the manager for "
                                     f"{self._owner.device_string} is closed")
        raise InvalidInputError(f"buffer {self.id} has been freed")

    @property
    def stream(self) -> int:
        return self._stream

    @property
    def device(self) -> str:
        return self._owner.device_string

    @property
    def location(self) -> str:
        """"cpu" for host memory, else "device"."""
        return _location(self._owner.device)

    @property
    def alive(self) -> bool:
        """False once the buffer has been freed (or its manager closed)."""
        return self._block != NULL and not self._owner._closed

    @property
    def manager(self):
        return self._owner

    @cython.binding(False)
    @cython.embedsignature(True)
    @cython.embedsignature.format("clinic")
    def free(self) -> None:
        """Return the block to its pool. Freeing twice raises DoubleFreeError."""
        self._owner._release(self)

    def record_stream(self, stream) -> None:
        """Declare that work on `stream` (besides the allocation stream) uses these bytes.

        When the buffer is freed an event is recorded on each such stream, and the block is
        reused only once all of them have passed it (as torch's ``Tensor.record_stream``).
        Until then its bytes count as ``pending_free_bytes``."""
        cdef uint64_t s
        if self._block == NULL or self._owner._closed:
            self._raise_dead()
        s = self._owner._stream_handle(stream)
        self._owner._check_stream(s)
        if s == self._stream:
            return
        if self._used_on is None:
            self._used_on = [s]
        elif s not in self._used_on:
            self._used_on.append(s)

    @property
    def used_on_streams(self) -> tuple:
        """Streams given to record_stream(), besides the allocation stream."""
        return () if self._used_on is None else tuple(self._used_on)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._block != NULL and not self._owner._closed:
            if self._exports:
                # arrays made from views still use the bytes: the block goes back to the
                # pool when the last of them dies, not under them (and without an error here)
                self._free_after_exports = True
            else:
                self._owner._release(self)
        return False

    def __dealloc__(self):
        # RAII: a buffer dropped without free() goes back to the pool. This runs inside
        # tp_dealloc, so `self` must not reach Python code: observers get a _DroppedBuffer.
        cdef ManagerBase owner = self._owner
        if self._block == NULL or owner is None or owner._closed:
            return
        try:
            owner._release_dropped(self._block, self.id,
                                   _DroppedBuffer.of(self) if owner._hooks else None,
                                   self._used_on)
        except Exception as exc:  # never raise from a destructor (e.g. at interpreter exit)
            warnings.warn(f"gpumem: could not return buffer {self.id} to its pool: {exc}",
                          ResourceWarning)
        self._block = NULL

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "" if self.alive else ", freed"
        tag = "" if self.tag is None else f", tag={self.tag!r}"
        return (f"<gpumem.Buffer id={self.id} {self.nbytes} B at {self._ptr:#x} on "
                f"{self._owner.device_string}, stream {self._stream}{tag}{state}>")

    # --- where the bytes are, for the backend ------------------------------------------------
    def segment_location(self) -> tuple:
        """``(segment handle, offset)`` for backend calls; raises InvalidInputError if the
        buffer is freed, ClosedManagerError if its manager is closed."""
        if self._block == NULL or self._owner._closed:
            self._raise_dead()
        if self._owner._asleep_tag is not None:
            self._raise_asleep()
        return self._block.segment.handle, self._block.offset

    @property
    def asleep_tag(self):
        """The tag whose sleep took this buffer's memory (``MemoryManager.sleep``), None while
        its memory is mapped. Its address stays the same; copies, views and DLPack exports
        raise GpuMemoryError until ``wake``."""
        return self._owner._asleep_tag if self._owner is not None else None

    cdef int _raise_asleep(self) except -1:
        raise GpuMemoryError(f"buffer {self.id} is asleep: its tag {self._owner._asleep_tag!r} "
                             f"was put to sleep (MemoryManager.sleep) and its memory given "
                             f"back to the device; wake({self._owner._asleep_tag!r}) first")

    @property
    def native(self):
        """The backend's own object for these bytes: the address for cuda/cpu/sim, a
        pyopencl sub-buffer for OpenCL (None for a zero-length buffer there), cached: the same
        object each time the pool hands out the same range. Do not release() it."""
        # A device with a NativeCache (OpenCL) is looked up in C by address and size: no
        # Python object is built on a hit; a miss calls device.resolve(), which fills it.
        cdef NativeCache cache = self._owner._native_cache
        cdef PyObject* hit
        if cache is not None and self._block != NULL and not self._owner._closed:
            hit = cache.find(self._ptr, self.nbytes)
            if hit != NULL:
                return <object>hit
        handle, offset = self.segment_location()
        return self._owner.device.resolve(handle, offset, self.nbytes)

    cdef object _host_bytes(self, object obj, str what):
        """``obj`` as flat bytes, no longer than the buffer (InvalidInputError naming `what`)."""
        view = memoryview(obj).cast("B")
        if len(view) > self.nbytes:
            raise InvalidInputError(f"{what} has {len(view)} bytes but the buffer holds "
                                    f"{self.nbytes}")
        return view

    def copy_from_host(self, src) -> None:
        """Copy a bytes-like object (at most nbytes long) into the buffer; synchronous."""
        view = self._host_bytes(src, "source")
        handle, offset = self.segment_location()
        self._owner.device.copy_from_host(handle, offset, view, self._stream)

    def copy_to_host(self, out=None):
        """The buffer's bytes as a numpy uint8 array (or into `out`); synchronous."""
        import numpy as np
        if out is None:
            out = np.empty(self.nbytes, dtype=np.uint8)
        view = self._host_bytes(out, "destination")
        handle, offset = self.segment_location()
        self._owner.device.copy_to_host(handle, offset, view, self._stream)
        return out

    def memset(self, int value) -> None:
        """Fill the buffer with one byte value (0..255)."""
        if not 0 <= value <= 255:
            raise InvalidInputError(f"memset value must be a byte (0..255), got {value}")
        handle, offset = self.segment_location()
        self._owner.device.memset(handle, offset, value, self.nbytes, self._stream)

    # --- zero-copy views and the array protocols (gpumem/_core/view.pyx) ----------------------
    def view(self, dtype="uint8", shape=None, strides=None, offset=0, *, readonly=False):
        """A typed zero-copy view: ``shape`` elements of ``dtype`` (numpy dtype rules) starting
        ``offset`` bytes in, with byte ``strides`` (None: C order; shape None: 1-D over the rest
        of the buffer). It offers ``__array_interface__`` (host memory),
        ``__cuda_array_interface__`` (cuda) and ``__dlpack__``. While it (or an array made from
        it) lives, ``free()`` raises BufferInUseError. InvalidInputError names the argument that
        does not fit the buffer."""
        if self._owner._asleep_tag is not None and self._block != NULL:
            self._raise_asleep()
        return _view_class()._of(self, dtype, shape, strides, offset, readonly)

    @property
    def exports(self) -> int:
        """Live views of this buffer (see ``view()``); ``free()`` is refused while > 0."""
        return self._exports

    def _export_added(self) -> None:
        self._exports += 1

    def _export_dropped(self) -> None:
        if self._exports > 0:
            self._exports -= 1
            if (self._exports == 0 and self._free_after_exports and self._block != NULL
                    and not self._owner._closed):
                self._free_after_exports = False
                self._owner._release(self)      # the `with` block ended while views lived

    @property
    def __cuda_array_interface__(self) -> dict:
        """The whole buffer as 1-D uint8 (CUDA array interface v3, with the stream). The
        consumer holds this Buffer, not a view: pass ``view()`` to have free() refused while
        the consumer's array lives."""
        if self._owner.device.dlpack_device_type != DLPACK_CUDA:
            raise AttributeError("__cuda_array_interface__ is only offered by CUDA buffers")
        return self.view().__cuda_array_interface__

    @property
    def __array_interface__(self) -> dict:
        """The whole buffer as 1-D uint8 for numpy (host memory only). Its ``data`` is the
        bytes of a view (buffer protocol) rather than an address, so numpy keeps that view
        alive with the array and free() is refused while the array lives."""
        if self._owner.device.dlpack_device_type != DLPACK_CPU:
            raise AttributeError("__array_interface__ is only offered by host (cpu) buffers")
        v = self.view()
        d = v.__array_interface__
        d["data"] = v._flat_bytes()
        return d

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack export of the whole buffer as 1-D uint8 (see ``BufferView.__dlpack__``)."""
        return self.view().__dlpack__(stream=stream, max_version=max_version,
                                      dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple:
        if not self.alive:
            raise InvalidInputError(f"buffer {self.id} has been freed")
        return _view_module().dlpack_device(self)


cdef Buffer new_buffer(ManagerBase owner, gm_block* b, size_t n, uint64_t s, object tag):
    """A Buffer for block `b` of `owner`'s pool: C stores only (the manager's hot path)."""
    cdef Buffer buf = Buffer.__new__(Buffer)
    buf._block = b
    buf.id = b.serial
    buf._ptr = b.segment.base + b.offset
    buf.nbytes = n
    buf._stream = s
    buf.tag = tag
    buf._owner = owner
    return buf


cdef str _location(device):
    """A buffer's ``location``: "cpu" on a host-memory device, else "device"."""
    return "cpu" if device.kind is DeviceKind.HOST else "device"


cdef object _VIEW_MODULE = None

cdef object _view_module():
    """gpumem._core.view, imported on first use (it imports numpy)."""
    global _VIEW_MODULE
    if _VIEW_MODULE is None:
        from gpumem._core import view
        _VIEW_MODULE = view
    return _VIEW_MODULE

cdef object _view_class():
    return _view_module().BufferView


@cython.final
cdef class _DroppedBuffer:
    """What observers (tracking, history) see of a buffer returned by garbage collection."""

    cdef readonly size_t ptr
    cdef readonly size_t nbytes
    cdef readonly uint64_t id
    cdef readonly object tag
    cdef readonly uint64_t stream
    cdef readonly str device
    cdef readonly str location

    @staticmethod
    cdef _DroppedBuffer of(Buffer buf):
        cdef _DroppedBuffer d = _DroppedBuffer.__new__(_DroppedBuffer)
        d.ptr = buf._ptr
        d.nbytes = buf.nbytes
        d.id = buf.id
        d.tag = buf.tag
        d.stream = buf._stream
        d.device = buf._owner.device_string
        d.location = _location(buf._owner.device)
        return d


