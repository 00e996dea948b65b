# cython: language_level=3
"""Typed zero-copy views of a Buffer: ``Buffer.view(dtype, shape, strides, offset)``.

A :class:`BufferView` is a dtype, a shape, byte strides and a byte offset over one Buffer, and
exposes them to array libraries without copying:

- ``__array_interface__`` (v3) for host memory (the ``cpu`` device, pinned or not, and
  CPU-fallback buffers): ``numpy.asarray(view)``;
- ``__cuda_array_interface__`` (v3, with the buffer's stream) for ``cuda`` buffers;
- ``__dlpack__`` / ``__dlpack_device__`` (array-API rules) for both: kDLCPU for pageable host
  memory, kDLCUDAHost for pinned host memory, kDLCUDA for device memory.

Lifetime: a view holds its Buffer, and counts in ``Buffer.exports`` from creation until it is
garbage. Every consumer keeps the view it was given alive (numpy's ``base``, a DLPack capsule's
``manager_ctx``, CuPy's owner), so ``Buffer.free()`` is refused with BufferInUseError while any
array made from a view exists, as ``bytearray`` refuses to resize under a memoryview; a Buffer
that is only dropped goes back to the pool when its last view dies.

Thread safety: a view is immutable once built. ``Buffer.exports`` is changed only while holding
the GIL (view creation and deallocation), so it needs no other lock.
"""
cimport cython
from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES

import enum
import operator

import numpy as np

from gpumem._core.buffer import Buffer
from gpumem._core.dlpack import make_capsule
from gpumem.errors import InvalidInputError

__all__ = ["BufferView", "DLDeviceType", "dlpack_device", "MAX_NDIM"]

MAX_NDIM = 64                           # numpy's limit; DLPack's is int32


class DLDeviceType(enum.IntEnum):
    """The DLPack device types a gpumem view can be on (values of dlpack.h's DLDeviceType)."""
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3


# DLPack type codes (dlpack.h DLDataTypeCode) for numpy kinds. Floats wider than 64 bits are
# long doubles, not IEEE binary128, so they have none (as in numpy's own exporter).
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
_DL_MAX_ITEMSIZE = {"f": 8, "c": 16}
_SIZE_LIMIT = 1 << 62

cdef char* _FORMAT_B = "B"


def dlpack_device(buffer) -> tuple:
    """``(device_type, device_id)`` of a live Buffer's memory; BufferError where DLPack has no
    zero-copy answer (sim and OpenCL buffers)."""
    device = buffer.manager.device
    if device.backend == "cuda":
        return (DLDeviceType.kDLCUDA, device.index)
    if device.backend == "cpu":
        handle, _ = buffer.segment_location()
        pinned = device.segment_pinned(handle)
        return (DLDeviceType.kDLCUDAHost if pinned else DLDeviceType.kDLCPU, 0)
    raise BufferError(f"{buffer.device} buffers have no DLPack device: DLPack exports host "
                      f"(cpu, pinned, CPU fallback) and cuda buffers")


cdef tuple _int_tuple(object value, str name):
    """A tuple of ints from an int or a sequence of ints (TypeError otherwise)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a tuple of ints, not a bool")
    if hasattr(value, "__index__"):
        return (operator.index(value),)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be an int or a tuple of ints, got "
                        f"{type(value).__name__}")
    items = []
    for v in value:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name} must hold ints, got {type(v).__name__} {v!r}")
        items.append(operator.index(v))
    return tuple(items)


cdef object _parse_dtype(object dtype):
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"dtype {dtype!r} is not a numpy dtype ({exc})") from None
    if dt.hasobject:
        raise InvalidInputError(f"dtype {dt} holds Python objects, which raw memory cannot "
                                f"hold; use a numeric, bool, bytes, str, datetime or "
                                f"structured dtype")
    if dt.itemsize == 0:
        raise InvalidInputError(f"dtype {dt} has no size; give its length (e.g. 'S8', 'U4', "
                                f"'V16')")
    if dt.subdtype is not None:
        raise InvalidInputError(f"dtype {dt} is a sub-array dtype; put its shape "
                                f"{dt.shape} into `shape` and pass dtype={dt.base}")
    return dt


@cython.final
@cython.no_gc_clear            # __dealloc__ needs `buffer` to give its export back
cdef class BufferView:
    """A typed window on a Buffer; made by ``Buffer.view()``, never directly."""

    cdef readonly object buffer         # the Buffer; kept alive and counted as exported
    cdef readonly object dtype          # numpy.dtype
    cdef readonly tuple shape
    cdef readonly tuple strides         # bytes, one per dimension
    cdef readonly Py_ssize_t offset     # bytes from the buffer's start to element (0, ..., 0)
    cdef readonly bint readonly
    cdef readonly bint c_contiguous
    cdef readonly Py_ssize_t nbytes     # bytes the elements cover (size * itemsize)
    cdef bint _counted

    def __init__(self, *args, **kwargs):
        raise TypeError("BufferViews come from Buffer.view(); they cannot be built directly")

    @staticmethod
    def _of(buffer, dtype, shape, strides, offset, readonly) -> BufferView:
        """Validate the arguments against ``buffer`` (nothing changes when one is wrong)."""
        cdef BufferView v
        cdef Py_ssize_t size, itemsize
        if type(buffer) is not Buffer:
            raise TypeError(f"views are made of gpumem Buffers, got {type(buffer).__name__}")
        size = buffer.nbytes
        if not buffer.alive:
            raise InvalidInputError(f"buffer {buffer.id} has been freed (or its manager "
                                    f"closed)")
        dt = _parse_dtype(dtype)
        itemsize = dt.itemsize
        if isinstance(offset, bool) or not hasattr(offset, "__index__"):
            raise TypeError(f"offset must be an int, got {type(offset).__name__}")
        off = operator.index(offset)
        if not 0 <= off <= size:
            raise InvalidInputError(f"offset must be in [0, {size}] (the buffer's nbytes), "
                                    f"got {off}")
        if off % dt.alignment:
            raise InvalidInputError(f"offset {off} is not a multiple of the alignment of "
                                    f"{dt} ({dt.alignment} bytes)")
        if shape is None:
            if strides is not None:
                raise InvalidInputError("strides given without shape: give shape too")
            shp = ((size - off) // itemsize,)
        else:
            shp = _int_tuple(shape, "shape")
        if len(shp) > MAX_NDIM:
            raise InvalidInputError(f"shape has {len(shp)} dimensions; at most {MAX_NDIM}")
        n_elems = 1
        for d in shp:
            if d < 0:
                raise InvalidInputError(f"shape must not be negative, got {shp}")
            n_elems *= d
        if n_elems * itemsize >= _SIZE_LIMIT:
            raise InvalidInputError(f"shape {shp} has {n_elems} elements of {itemsize} bytes: "
                                    f"more than memory can address")
        contiguous_strides = []
        expect = itemsize
        for d in reversed(shp):
            contiguous_strides.append(expect)
            expect *= max(d, 1)
        contiguous_strides = tuple(reversed(contiguous_strides))
        if strides is None:
            st = contiguous_strides
        else:
            st = _int_tuple(strides, "strides")
            if len(st) != len(shp):
                raise InvalidInputError(f"strides has {len(st)} entries but shape has "
                                        f"{len(shp)}; give one byte stride per dimension")
            for s in st:
                if s % itemsize:
                    raise InvalidInputError(f"strides {st} must be multiples of the item size "
                                            f"of {dt} ({itemsize} bytes)")
        lo = hi = off
        if n_elems:
            for d, s in zip(shp, st):
                if s < 0:
                    lo += s * (d - 1)
                else:
                    hi += s * (d - 1)
            hi += itemsize
            if lo < 0 or hi > size:
                what = "shape" if strides is None else "shape/strides"
                raise InvalidInputError(
                    f"{what} {shp}/{st} at offset {off} reach bytes [{lo}, {hi}) but the "
                    f"buffer holds {size}")
        v = BufferView.__new__(BufferView)
        v.buffer = buffer
        v.dtype = dt
        v.shape = shp
        v.strides = st
        v.offset = off
        v.readonly = bool(readonly)
        v.c_contiguous = n_elems == 0 or all(
            d == 1 or s == c for d, s, c in zip(shp, st, contiguous_strides))
        v.nbytes = n_elems * itemsize
        buffer._export_added()
        v._counted = True
        return v

    def __dealloc__(self):
        if self._counted:
            self._counted = False
            try:
                self.buffer._export_dropped()
            except Exception:       # never raise from a destructor
                pass

    # --- where and what ------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """Address of element (0, ..., 0)."""
        return self.buffer.ptr + self.offset

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.nbytes // self.dtype.itemsize

    @property
    def device(self) -> str:
        return self.buffer.device

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d view")
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"<gpumem.BufferView {self.dtype} {self.shape} strides={self.strides} "
                f"offset={self.offset} of buffer {self.buffer.id} on {self.buffer.device}"
                f"{', read-only' if self.readonly else ''}>")

    cdef str _backend(self):
        if not self.buffer.alive:
            raise InvalidInputError(f"buffer {self.buffer.id} has been freed (its manager "
                                    f"was closed)")
        return self.buffer.manager.device.backend

    cdef dict _interface(self):
        d = {"shape": self.shape, "typestr": self.dtype.str,
             "data": (self.ptr, bool(self.readonly)),
             "strides": None if self.c_contiguous else self.strides, "version": 3}
        if self.dtype.names is not None:
            d["descr"] = self.dtype.descr
        return d

    # --- numpy -----------------------------------------------------------------------------------
    @property
    def __array_interface__(self) -> dict:
        if self._backend() != "cpu":
            raise AttributeError(f"__array_interface__ is offered for host memory only (cpu "
                                 f"and CPU fallback); this view is on {self.buffer.device}")
        return self._interface()

    def _flat_bytes(self) -> _ViewBytes:
        """The view's bytes behind the Python buffer protocol (host, C-contiguous views): what
        ``Buffer.__array_interface__`` gives numpy as ``data``, so numpy keeps it (and this
        view) as the array's base. A separate object, because numpy prefers the buffer
        protocol to ``__array_interface__`` and would ignore the view's dtype and shape."""
        cdef _ViewBytes b
        if self._backend() != "cpu":
            raise BufferError(f"the buffer protocol is offered for host memory only; this view "
                              f"is on {self.buffer.device}")
        if not self.c_contiguous:
            raise BufferError("the buffer protocol exports C-contiguous views only; this one "
                              f"has strides {self.strides}")
        b = _ViewBytes.__new__(_ViewBytes)
        b.view = self
        b.shape[0] = self.nbytes
        b.strides[0] = 1
        return b

    # --- CUDA array interface ----------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        if self._backend() != "cuda":
            raise AttributeError(f"__cuda_array_interface__ is offered for cuda memory only; "
                                 f"this view is on {self.buffer.device}")
        d = self._interface()
        s = self.buffer.stream
        # v3 "stream": where the consumer must synchronize. gpumem's stream 0 is CUDA's legacy
        # default stream, which the interface spells 1 (0 is disallowed there).
        d["stream"] = 1 if s == 0 else s
        return d

    # --- DLPack ------------------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple:
        self._backend()
        return dlpack_device(self.buffer)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of this view (array-API ``__dlpack__``).

        ``stream`` (cuda): the consumer's stream: None or 1 the legacy default stream, 2 the
        per-thread default stream, -1 no synchronization, else a stream handle (or any stream
        object ``malloc`` accepts). Work already on the buffer's stream is ordered before later
        work on the consumer's (an event and cuStreamWaitEvent, no host wait), and the buffer
        records that stream (``record_stream``) so a later free waits for it.
        ``max_version``: a versioned (DLPack 1.0) capsule when ``>= (1, 0)``, else the legacy
        one. ``dl_device`` other than this memory's: BufferError (pinned memory may also be
        taken as kDLCPU). ``copy=True``: BufferError (views are zero-copy; copy in the
        consumer)."""
        backend = self._backend()
        device = dlpack_device(self.buffer)
        if copy is not None and not isinstance(copy, bool):
            raise TypeError(f"copy must be None or a bool, got {type(copy).__name__}")
        if copy:
            raise BufferError("gpumem views export their memory without copying; copy=True is "
                              "not supported (copy in the consumer)")
        if dl_device is not None:
            wanted = tuple(operator.index(x) for x in dl_device)
            if wanted == (DLDeviceType.kDLCPU, 0) and device[0] == DLDeviceType.kDLCUDAHost:
                device = wanted                  # pinned host memory is host memory
            elif wanted != tuple(device):
                raise BufferError(f"dl_device {wanted} asked for, but this view's memory is on "
                                  f"{tuple(device)}; gpumem does not copy across devices")
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        if self.readonly and not versioned:
            raise BufferError("a read-only view can be exported only as a versioned DLPack "
                              "capsule (max_version >= (1, 0)); the legacy capsule cannot say "
                              "read-only")
        kind = self.dtype.kind
        if (kind not in _DL_CODES or self.dtype.itemsize > _DL_MAX_ITEMSIZE.get(kind, 8)
                or not self.dtype.isnative or self.dtype.names is not None):
            raise BufferError(f"dtype {self.dtype} has no DLPack equivalent (DLPack holds "
                              f"native bool, int, uint, float and complex up to 64+64 bits)")
        if backend == "cuda":
            self._order_for_consumer(stream)
        elif stream is not None and stream != -1 and device[0] == DLDeviceType.kDLCPU:
            raise BufferError(f"stream must be None for host memory, got {stream!r}")
        itemsize = self.dtype.itemsize
        return make_capsule(self, self.ptr, device[0], device[1], self.shape,
                            tuple(s // itemsize for s in self.strides), _DL_CODES[kind],
                            8 * itemsize, self.readonly, versioned)

    cdef _order_for_consumer(self, stream):
        buf = self.buffer
        if stream is None:
            consumer = 1                         # the spec's default: the legacy stream
        elif type(stream) is int and stream in (-1, 0):
            if stream == 0:
                raise BufferError("stream=0 is ambiguous in DLPack (legacy or per-thread "
                                  "default?); pass 1, 2, -1 or a stream handle")
            return                               # -1: the consumer asked for no ordering
        else:
            consumer = buf.manager._stream_handle(stream)
        producer = buf.stream if buf.stream else 1
        if consumer == producer:
            return
        device = buf.manager.device
        event = device.record_event(buf.stream)
        try:
            device.wait_event(consumer, event)
        finally:
            device.destroy_event(event)
        if consumer != 2:   # the per-thread default stream is a different one in each thread
            buf.record_stream(consumer)


@cython.final
cdef class _ViewBytes:
    """A host BufferView's bytes, flat ('B'), through the Python buffer protocol."""

    cdef readonly BufferView view
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __getbuffer__(self, Py_buffer* info, int flags):
        cdef BufferView v = self.view
        if v.readonly and (flags & PyBUF_WRITABLE) == PyBUF_WRITABLE:
            raise BufferError("this view is read-only")
        v._backend()                         # raises once the manager is closed
        info.buf = <void*><size_t>v.ptr
        info.obj = self
        info.len = v.nbytes
        info.readonly = v.readonly
        info.itemsize = 1
        info.format = NULL
        if (flags & PyBUF_FORMAT) == PyBUF_FORMAT:
            info.format = _FORMAT_B
        info.ndim = 1
        info.shape = NULL
        info.strides = NULL
        if (flags & PyBUF_ND) == PyBUF_ND:
            info.shape = self.shape
        if (flags & PyBUF_STRIDES) == PyBUF_STRIDES:
            info.strides = self.strides
        info.suboffsets = NULL
        info.internal = NULL

    def __releasebuffer__(self, Py_buffer* info):
        pass
