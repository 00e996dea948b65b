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

Thread safety: a view is immutable once built (its DLPack device is worked out once, an
idempotent write). ``Buffer.exports`` is changed only while holding the GIL (view creation and
deallocation, the DLPack deleter takes the GIL first), so it needs no other lock; the same holds
for the module's dtype cache (a dict; two threads at worst build one entry twice).
"""
cimport cython
from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES

import enum
import operator

import numpy as np

from gpumem._core.buffer import Buffer
from gpumem._core.dlpack import make_capsule
from gpumem.backends.base import DLPACK_CPU, DLPACK_CUDA
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

cdef char* _FORMAT_B = "B"


def dlpack_device(buffer) -> tuple:
    """``(device_type, device_id)`` of a live Buffer's memory, as its device declares it
    (``Device.dlpack_device``); BufferError where DLPack has no zero-copy answer (sim and
    OpenCL buffers)."""
    handle, _ = buffer.segment_location()
    found = buffer.manager.device.dlpack_device(handle)
    if found is None:
        raise BufferError(f"{buffer.device} buffers have no DLPack device: DLPack exports host "
                          f"(cpu, pinned, CPU fallback) and cuda buffers")
    return (DLDeviceType(found[0]), found[1])


cdef tuple _int_tuple(object value, str name):
    """A tuple of ints from an int or a sequence of ints (TypeError otherwise)."""
    if type(value) is tuple:
        for v in <tuple>value:
            if type(v) is not int:
                break
        else:
            return <tuple>value              # the common case: already a tuple of ints
    elif type(value) is int:
        return (value,)
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


@cython.final
cdef class _DtypeInfo:
    """What the protocols need of one numpy dtype, worked out once (numpy's dtype attributes
    cost ~100 ns each)."""
    cdef object dtype
    cdef Py_ssize_t itemsize
    cdef Py_ssize_t alignment
    cdef str typestr
    cdef object descr               # list for structured dtypes, else None
    cdef int dl_code                # DLPack type code, -1 when DLPack cannot carry the dtype


cdef dict _DTYPE_INFO = {}          # dtype argument (or numpy.dtype) -> _DtypeInfo
cdef Py_ssize_t _DTYPE_CACHE_MAX = 1024


cdef _DtypeInfo _dtype_info(object dtype):
    cdef _DtypeInfo info
    try:
        return _DTYPE_INFO[dtype]
    except (KeyError, TypeError):    # TypeError: an unhashable spec (a list for structs)
        pass
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as exc:
        # SyntaxError: numpy parses the shape in a comma string such as '(2,)i4,)' as Python
        # source (found by tests/fuzz/views.py)
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
    info = _DtypeInfo.__new__(_DtypeInfo)
    info.dtype = dt
    info.itemsize = dt.itemsize
    info.alignment = dt.alignment
    info.typestr = dt.str
    info.descr = dt.descr if dt.names is not None else None
    info.dl_code = -1
    if (dt.kind in _DL_CODES and dt.itemsize <= _DL_MAX_ITEMSIZE.get(dt.kind, 8)
            and dt.isnative and dt.names is None):
        info.dl_code = _DL_CODES[dt.kind]
    if len(_DTYPE_INFO) < _DTYPE_CACHE_MAX:
        try:
            _DTYPE_INFO[dtype] = info
        except TypeError:
            pass
    return info


cdef long long _C_LIMIT = 1LL << 62    # shapes, strides and products stay below this


cdef tuple _layout(tuple shp, object strides, Py_ssize_t itemsize, Py_ssize_t offset,
                   Py_ssize_t size):
    """``(byte strides, C-contiguous?, element count)`` for ``shp``: C order when ``strides``
    is None, else the given ones, checked (count, item-size multiples, every element inside
    ``[0, size)``). C arithmetic: each value is bounded by 2**62 first, so nothing overflows."""
    cdef Py_ssize_t nd = len(shp), i
    cdef long long n = 1, d, st, expect = itemsize, lo = offset, hi = offset
    cdef bint contiguous = True
    cdef list c_order = [0] * nd
    if nd > MAX_NDIM:
        raise InvalidInputError(f"shape has {nd} dimensions; at most {MAX_NDIM}")
    for i in range(nd):
        if not 0 <= shp[i] < _C_LIMIT:
            if shp[i] < 0:
                raise InvalidInputError(f"shape must not be negative, got {shp}")
            raise InvalidInputError(f"shape {shp} has more elements than memory can address")
    for i in range(nd - 1, -1, -1):
        d = shp[i]
        c_order[i] = expect
        if d > 1:
            if expect > _C_LIMIT // d:
                raise InvalidInputError(f"shape {shp} has more elements than memory can "
                                        f"address")
            expect *= d
        n *= d                               # <= expect / itemsize: no overflow
    if strides is None:
        st_tuple = tuple(c_order)
    else:
        st_tuple = _int_tuple(strides, "strides")
        if len(st_tuple) != nd:
            raise InvalidInputError(f"strides has {len(st_tuple)} entries but shape has {nd}; "
                                    f"give one byte stride per dimension")
        for i in range(nd):
            if not -_C_LIMIT < st_tuple[i] < _C_LIMIT:
                raise InvalidInputError(f"strides {st_tuple} reach beyond the buffer of "
                                        f"{size} bytes")
            st = st_tuple[i]
            if st % itemsize:
                raise InvalidInputError(f"strides {st_tuple} must be multiples of the item "
                                        f"size ({itemsize} bytes)")
            if shp[i] != 1 and st != c_order[i]:
                contiguous = False
    if n:
        for i in range(nd):
            d = shp[i] - 1
            st = st_tuple[i]
            if d and (st if st >= 0 else -st) > _C_LIMIT // d:
                lo = -1                      # |st| * d alone is past any buffer
                break
            if st < 0:
                lo += st * d                 # each step adds less than 2**62 and is checked,
            else:                            # so lo and hi never overflow
                hi += st * d
            if lo < 0 or hi > size:
                break
        hi += itemsize
        if lo < 0 or hi > size:
            what = "shape" if strides is None else "shape/strides"
            raise InvalidInputError(f"{what} {shp}/{st_tuple} at offset {offset} reach "
                                    f"outside the buffer's {size} bytes")
    return st_tuple, contiguous, n


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
    cdef size_t _ptr                    # address of element (0, ..., 0)
    cdef _DtypeInfo _info
    cdef int _dl_type                   # the device's declared DLPack type; -1: none
    cdef tuple _dl_device               # (DLPack device type, id), worked out on first use
    cdef bint _counted

    def __init__(self, *args, **kwargs):
        raise TypeError("BufferViews come from Buffer.view(); they cannot be built directly")

    @staticmethod
    def _of(buffer, dtype, shape, strides, offset, readonly) -> BufferView:
        """Validate the arguments against ``buffer`` (nothing changes when one is wrong)."""
        cdef BufferView v
        cdef _DtypeInfo info
        cdef Py_ssize_t size, itemsize, off
        cdef bint contiguous = True
        if type(buffer) is not Buffer:
            raise TypeError(f"views are made of gpumem Buffers, got {type(buffer).__name__}")
        if not buffer.alive:
            raise InvalidInputError(f"buffer {buffer.id} has been freed (or its manager "
                                    f"closed)")
        size = buffer.nbytes
        info = _dtype_info(dtype)
        itemsize = info.itemsize
        if type(offset) is not int:
            if isinstance(offset, bool) or not hasattr(offset, "__index__"):
                raise TypeError(f"offset must be an int, got {type(offset).__name__}")
            offset = operator.index(offset)
        if not 0 <= offset <= size:
            raise InvalidInputError(f"offset must be in [0, {size}] (the buffer's nbytes), "
                                    f"got {offset}")
        off = offset
        if off % info.alignment:
            raise InvalidInputError(f"offset {off} is not a multiple of the alignment of "
                                    f"{info.dtype} ({info.alignment} bytes)")
        if shape is None:
            if strides is not None:
                raise InvalidInputError("strides given without shape: give shape too")
            shp = ((size - off) // itemsize,)
            st = (itemsize,)
            n_elems = shp[0]
        else:
            shp = _int_tuple(shape, "shape")
            st, contiguous, n_elems = _layout(shp, strides, itemsize, off, size)
        v = BufferView.__new__(BufferView)
        v.buffer = buffer
        v._info = info
        v.dtype = info.dtype
        v.shape = shp
        v.strides = st
        v.offset = off
        v.readonly = bool(readonly)
        v.c_contiguous = contiguous or n_elems == 0
        v.nbytes = n_elems * itemsize
        v._ptr = buffer.ptr + off
        dl_type = buffer.manager.device.dlpack_device_type
        v._dl_type = -1 if dl_type is None else dl_type
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
        return self._ptr

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.nbytes // self._info.itemsize

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

    cdef int _memory(self) except -2:
        """The declared DLPack type of the memory (-1: none); raises once the buffer is dead."""
        if not self.buffer.alive:
            raise InvalidInputError(f"buffer {self.buffer.id} has been freed (its manager "
                                    f"was closed)")
        return self._dl_type

    cdef dict _interface(self):
        d = {"shape": self.shape, "typestr": self._info.typestr,
             "data": (self._ptr, bool(self.readonly)),
             "strides": None if self.c_contiguous else self.strides, "version": 3}
        if self._info.descr is not None:
            d["descr"] = self._info.descr
        return d

    # --- numpy -----------------------------------------------------------------------------------
    @property
    def __array_interface__(self) -> dict:
        if self._memory() != DLPACK_CPU:
            raise AttributeError(f"__array_interface__ is offered for host memory only (cpu "
                                 f"and CPU fallback); this view is on {self.buffer.device}")
        return self._interface()

    def _flat_bytes(self) -> _ViewBytes:
        """The view's bytes behind the Python buffer protocol (host, C-contiguous views): what
        ``Buffer.__array_interface__`` gives numpy as ``data``, so numpy keeps it (and this
        view) as the array's base. A separate object, because numpy prefers the buffer
        protocol to ``__array_interface__`` and would ignore the view's dtype and shape."""
        cdef _ViewBytes b
        if self._memory() != DLPACK_CPU:
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

    # --- CUDA array interface ---------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        if self._memory() != DLPACK_CUDA:
            raise AttributeError(f"__cuda_array_interface__ is offered for cuda memory only; "
                                 f"this view is on {self.buffer.device}")
        d = self._interface()
        s = self.buffer.stream
        # v3 "stream": where the consumer must synchronize. gpumem's stream 0 is CUDA's legacy
        # default stream, which the interface spells 1 (0 is disallowed there).
        d["stream"] = 1 if s == 0 else s
        return d

    # --- DLPack -----------------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple:
        self._memory()
        return self._device()

    cdef tuple _device(self):
        # A segment's memory kind never changes: ask the backend once per view.
        if self._dl_device is None:
            self._dl_device = dlpack_device(self.buffer)
        return self._dl_device

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
        cdef Py_ssize_t itemsize = self._info.itemsize
        if getattr(self.buffer, "asleep_tag", None) is not None:
            self.buffer.segment_location()      # raises: the memory sleeps (no pages mapped)
        memory = self._memory()
        device = self._device()
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
        versioned = False
        if max_version is not None:
            try:
                major, _minor = [operator.index(x) for x in max_version]
            except (TypeError, ValueError):     # not iterable, not ints, not two of them
                raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, "
                                f"got {max_version!r}") from None
            versioned = major >= 1
        if self.readonly and not versioned:
            raise BufferError("a read-only view can be exported only as a versioned DLPack "
                              "capsule (max_version >= (1, 0)); the legacy capsule cannot say "
                              "read-only")
        if self._info.dl_code < 0:
            raise BufferError(f"dtype {self.dtype} has no DLPack equivalent (DLPack holds "
                              f"native bool, int, uint, float and complex up to 64+64 bits)")
        if memory == DLPACK_CUDA:
            self._order_for_consumer(stream)
        elif stream is not None and stream != -1 and device[0] == DLDeviceType.kDLCPU:
            raise BufferError(f"stream must be None for host memory, got {stream!r}")
        elem_strides = tuple([s // itemsize for s in self.strides])   # DLPack counts elements
        return make_capsule(self, self._ptr, device[0], device[1], self.shape, elem_strides,
                            self._info.dl_code, 8 * itemsize, self.readonly, versioned)

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
        v._memory()                          # raises once the manager is closed
        info.buf = <void*>v._ptr
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
