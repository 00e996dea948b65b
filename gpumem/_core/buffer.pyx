# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Buffers and the thin malloc/free that makes them.

`ManagerCore` is the base class of `gpumem.MemoryManager`: its `malloc`/`free` are the whole
Python-level hot path (argument checks, one gm_alloc/gm_free, one Buffer built without
`__init__`). Everything rare (a miss, an error, tracking hooks) calls back into Python methods the
subclass defines: `_malloc_slow`, `_on_alloc`, `_on_free`, `_trim_cache`, `_free_other`.

The manager's state and cold machinery (deferred frees, destroyed streams, the address log)
are in ManagerBase (manager_base.pyx), which ManagerCore subclasses.

Thread safety (docs/concurrency.md): the pool lock is taken through the GIL-aware variants
(`gm_alloc_gil`/`gm_free_gil`).
"""
cimport cython
from libc.stdint cimport uint64_t
from cpython.long cimport PyLong_AsLongLong, PyLong_AsLongLongAndOverflow
from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from gpumem._core.manager_base cimport ManagerBase
from gpumem._core.native_cache cimport NativeCache
from gpumem._core.pool cimport (CachingPool, gm_pool, gm_block, gm_alloc_gil, gm_free_gil,
                                GM_OK, GM_MISS, GM_UNKNOWN_STREAM, GM_BAD_BLOCK)

import operator
import warnings

from gpumem._core.manager_base import NOT_COPYABLE
from gpumem.errors import (BufferInUseError, ClosedManagerError, DoubleFreeError,
                           ForeignBufferError, InvalidInputError)

cdef long long _SIZE_TOO_BIG = 1LL << 62


cdef long long _size_arg(object nbytes) except -1:
    """nbytes as a C integer: TypeError for non-integers and bools, InvalidInputError for
    negatives; values too large for C become _SIZE_TOO_BIG (an out-of-memory, not a crash)."""
    cdef long long n
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__} {nbytes!r}")
        nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise InvalidInputError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes >= _SIZE_TOO_BIG:
        return _SIZE_TOO_BIG
    return PyLong_AsLongLong(nbytes)


@cython.final
@cython.freelist(64)           # recycled objects: ~15 ns off every malloc/free pair
@cython.no_gc_clear            # __dealloc__ needs _owner even when collected in a cycle
cdef class Buffer:
    """A block of device memory. Returned to its pool by `free()`, on leaving a `with` block,
    or when garbage-collected. `ptr` is the device address (synthetic on OpenCL: use `native`
    for the sub-buffer)."""

    cdef size_t _ptr                     # read through `ptr`, which refuses freed buffers
    cdef readonly size_t nbytes
    cdef readonly uint64_t id
    cdef readonly object tag
    cdef uint64_t _stream
    cdef gm_block* _block
    cdef ManagerCore _owner
    cdef list _used_on                   # other streams that use the bytes (record_stream)
    cdef bint _free_after_exports        # a `with` block ended while views lived
    cdef Py_ssize_t _exports             # live BufferViews: free() is refused while > 0;
                                         # changed only under the GIL (view.pyx)
    cdef object __weakref__

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
        return "cpu" if self._owner.device_string == "cpu" else "device"

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
        cdef ManagerCore owner = self._owner
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
        return self._block.segment.handle, self._block.offset

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

    def copy_from_host(self, src) -> None:
        """Copy a bytes-like object (at most nbytes long) into the buffer; synchronous."""
        view = memoryview(src).cast("B")
        if len(view) > self.nbytes:
            raise InvalidInputError(f"source has {len(view)} bytes but the buffer holds "
                                    f"{self.nbytes}")
        handle, offset = self.segment_location()
        self._owner.device.copy_from_host(handle, offset, view, self._stream)

    def copy_to_host(self, out=None):
        """The buffer's bytes as a numpy uint8 array (or into `out`); synchronous."""
        import numpy as np
        if out is None:
            out = np.empty(self.nbytes, dtype=np.uint8)
        view = memoryview(out).cast("B")
        if len(view) > self.nbytes:
            raise InvalidInputError(f"destination has {len(view)} bytes but the buffer holds "
                                    f"{self.nbytes}")
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
        if self._owner.device.backend != "cuda":
            raise AttributeError("__cuda_array_interface__ is only offered by CUDA buffers")
        return self.view().__cuda_array_interface__

    @property
    def __array_interface__(self) -> dict:
        """The whole buffer as 1-D uint8 for numpy (host memory only). Its ``data`` is the
        bytes of a view (buffer protocol) rather than an address, so numpy keeps that view
        alive with the array and free() is refused while the array lives."""
        if self._owner.device.backend != "cpu":
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
        d.location = "cpu" if d.device == "cpu" else "device"
        return d


cdef class ManagerCore(ManagerBase):
    """malloc/free over a CachingPool; subclassed by gpumem.MemoryManager. Its state and cold
    machinery (deferred frees, destroyed streams, the address log) are in ManagerBase."""

    # plain method descriptors (not CyFunctions): mm.malloc(n) and buf.free() are direct calls;
    # the signature stays visible to inspect through the clinic-format docstring
    @cython.binding(False)
    @cython.embedsignature(True)
    @cython.embedsignature.format("clinic")
    def malloc(self, nbytes, *, stream=None, tag=None, fallback=True):
        """A Buffer of at least nbytes on this manager's device (stream: an int handle or any
        framework's stream object, see `_stream_handle`), or a FallbackBuffer in host memory when the device is exhausted and CPU
        fallback is on (the config's ``cpu_fallback_enabled``, and `fallback` for this call).
        Raises OutOfMemoryError when neither can serve."""
        cdef long long n = -1
        cdef int overflow = 0
        cdef uint64_t s
        if type(nbytes) is int:          # C compares only: no Python int is built per call
            n = PyLong_AsLongLongAndOverflow(nbytes, &overflow)
        if overflow or not 0 <= n < _SIZE_TOO_BIG:
            n = _size_arg(nbytes)
        if stream is None:
            s = 0
        else:
            s = self._stream_handle(stream)
        if n == _SIZE_TOO_BIG and not self._closed:
            raise self._oom_error(operator.index(nbytes))   # no device holds it: say what was asked
        if fallback is True:                 # the hot path: one pointer comparison
            return self._malloc_c(n, s, tag)
        if fallback is False:
            return self._malloc_c(n, s, tag, False)
        raise InvalidInputError(f"fallback must be True or False, got "
                                f"{type(fallback).__name__} {fallback!r}")

    cdef object _malloc_c(self, long long n, uint64_t s, object tag, bint fallback=True):
        """malloc after argument checks (shared with PlacementCore); `fallback` False: an
        exhausted device raises OutOfMemoryError instead of returning host memory."""
        cdef gm_block* b
        if self._closed:
            raise ClosedManagerError(f"the manager for {self.device_string} is closed")
        if self.pending_free_bytes:
            self.collect_pending_frees()
        if self._ndead and s in self._dead_streams:       # refused there, or revived (handle reused)
            return self._malloc_slow(n, s, tag) if fallback else \
                self._malloc_slow(n, s, tag, False)
        if <size_t>n > self._max_request or gm_alloc_gil(self._p, <size_t>n, s, &b) != GM_OK:
            return self._malloc_slow(n, s, tag) if fallback else \
                self._malloc_slow(n, s, tag, False)
        return self._wrap(b, <size_t>n, s, tag)

    @cython.binding(False)
    @cython.embedsignature(True)
    @cython.embedsignature.format("clinic")
    def free(self, buffer) -> None:
        """Return a buffer to the pool (DoubleFreeError, ForeignBufferError on misuse)."""
        if type(buffer) is Buffer:
            self._release(<Buffer>buffer)
        else:
            self._free_other(buffer)

    cdef Buffer _wrap(self, gm_block* b, size_t n, uint64_t s, object tag):
        cdef Buffer buf = Buffer.__new__(Buffer)
        buf._block = b
        buf.id = b.serial
        buf._ptr = b.segment.base + b.offset
        buf.nbytes = n
        buf._stream = s
        buf.tag = tag
        buf._owner = self
        if self._addr_log != NULL:       # history recording: C stores only
            self._addr_log[2 * (self._addr_count & self._addr_mask)] = b.serial
            self._addr_log[2 * (self._addr_count & self._addr_mask) + 1] = buf._ptr
            self._addr_count += 1
        if tag is not None and self._tags is not None:    # untagged buffers: one test
            self._tags[b.serial] = tag
            if len(self._tags) > self._tags_limit:
                self._prune_tags()
        if self._hooks:
            self._on_alloc(buf)
        return buf

    cdef int _release(self, Buffer buf) except -1:
        cdef int rc
        if buf._owner is not self:
            raise ForeignBufferError(f"buffer {buf.id} belongs to {buf._owner.device_string} "
                                     f"manager {id(buf._owner):#x}, not this one")
        if self._closed:
            raise ClosedManagerError(f"cannot free buffer {buf.id}: the manager for "
                                     f"{self.device_string} is closed")
        if buf._block == NULL:
            raise DoubleFreeError(f"buffer {buf.id} ({buf.nbytes} B) was already freed")
        if buf._exports:
            raise BufferInUseError(
                f"buffer {buf.id} cannot be freed: {buf._exports} view(s) of it are alive "
                f"(Buffer.view(), numpy arrays or DLPack capsules made from it); drop them "
                f"first, or drop the buffer: it goes back to the pool with its last view")
        if buf._used_on is not None:
            self._defer_free(buf._block, buf.id, buf._used_on)
            buf._block = NULL
            buf._used_on = None
            if self._hooks:
                self._on_free(buf)
            return 0
        rc = gm_free_gil(self._p, buf._block, buf.id)
        if rc != GM_OK:
            raise DoubleFreeError(f"buffer {buf.id} is not live in this pool")
        buf._block = NULL
        if self._hooks:
            self._on_free(buf)
        if (self._p.stats.reserved_bytes.load() - self._p.stats.in_use_bytes.load()
                > self._cache_limit):
            self._trim_cache()
        return 0

    cdef int _release_dropped(self, gm_block* b, uint64_t serial, object info,
                              list used_on) except -1:
        """Buffer.__dealloc__'s free: the block by pointer and serial, observers told `info`."""
        if used_on is not None:
            self._defer_free(b, serial, used_on)
        elif gm_free_gil(self._p, b, serial) != GM_OK:
            return 0                  # already returned (e.g. the pool was reset)
        if info is not None:
            self._on_free(info)
        if (self._p.stats.reserved_bytes.load() - self._p.stats.in_use_bytes.load()
                > self._cache_limit):
            self._trim_cache()
        return 0

    # --- used by MemoryManager's slow paths ---------------------------------------------------
    def _alloc_in_new_segment(self, uint64_t handle, size_t base, size_t seg_size,
                              size_t nbytes, uint64_t stream, tag) -> Buffer:
        cdef gm_block* b
        self.pool.add_segment_and_alloc(handle, base, seg_size, nbytes, stream, &b)
        return self._wrap(b, nbytes, stream, tag)

    def _alloc_in_grown_segment(self, uint64_t handle, size_t extra, size_t nbytes,
                                uint64_t stream, tag):
        """The request from segment `handle` grown by `extra` mapped bytes; None when the pool
        did not take them (nothing changed)."""
        cdef gm_block* b
        if self.pool.grow_segment_and_alloc(handle, extra, nbytes, stream, &b) != 0:
            return None
        return self._wrap(b, nbytes, stream, tag)

    def _alloc_cached(self, size_t nbytes, uint64_t stream, tag):
        """A retry of the cache only; None on a miss."""
        cdef gm_block* b
        if gm_alloc_gil(self._p, nbytes, stream, &b) != GM_OK:
            return None
        return self._wrap(b, nbytes, stream, tag)

    # defaults, overridden by MemoryManager
    def _check_stream(self, stream) -> None:
        pass

    def _malloc_slow(self, nbytes, stream, tag, fallback=True):
        raise TypeError("ManagerCore is abstract: use gpumem.MemoryManager")

    def _on_alloc(self, buf) -> None:
        pass

    def _on_free(self, buf) -> None:
        pass

    def _trim_cache(self) -> None:
        pass

    def _free_other(self, buffer) -> None:
        raise TypeError(f"free() takes a gpumem Buffer, got {type(buffer).__name__}")


@cython.binding(False)
def _pyopencl_buffer(ManagerCore core, uint64_t stream, object from_int_ptr, object slow,
                     object nbytes):
    """The body of gpumem.integrations.pyopencl's allocator (a functools.partial of it): a
    new ``pyopencl.Buffer`` on the block's cached sub-buffer (retained: its death, not the
    shared sub-buffer's, returns the block, which it carries). A plain device allocation of a
    positive size runs here with no Python frame; anything else (a bad size, a block in host
    memory) goes to ``slow(nbytes[, host_buffer])``, which raises the errors."""
    cdef long long n = -1
    cdef int overflow = 0
    cdef size_t cl_mem
    cdef NativeCache cache = core._native_cache
    if type(nbytes) is int:
        n = PyLong_AsLongLongAndOverflow(nbytes, &overflow)
    if overflow or not 0 < n < _SIZE_TOO_BIG or cache is None:
        return slow(nbytes)
    buf = core._malloc_c(n, stream, None)
    if type(buf) is not Buffer:
        return slow(nbytes, buf)
    cl_mem = cache.find_int_ptr((<Buffer>buf)._ptr, <size_t>n)
    if cl_mem == 0:
        sub = (<Buffer>buf).native     # a miss: the device creates and caches the sub-buffer
        cl_mem = cache.find_int_ptr((<Buffer>buf)._ptr, <size_t>n) or sub.int_ptr
    mem = from_int_ptr(cl_mem, True)
    mem._gpumem_buffer = buf
    return mem


cdef class PlacementCore:
    """The hot path of gpumem.MultiDeviceManager: "most free usable memory" read from each
    pool's C counters, then that manager's malloc, with no Python frame in between. Anything
    else (a name, a stream, another policy, a closed manager) goes to `_allocate`."""

    cdef tuple _fast_cores             # ManagerCores for the fast path, or None
    cdef tuple _members                # every manager whose buffers free() accepts

    def _set_fast_path(self, cores) -> None:
        self._fast_cores = None if cores is None else tuple(cores)

    def _set_members(self, managers) -> None:
        self._members = tuple(managers)

    # plain method descriptors, like ManagerCore.malloc/free: no CyFunction call per pair
    @cython.binding(False)
    @cython.embedsignature(True)
    @cython.embedsignature.format("clinic")
    def free(self, buffer) -> None:
        """Free a buffer through the manager that allocated it (ForeignBufferError if that is
        not one of this object's managers)."""
        cdef ManagerCore owner
        cdef tuple members = self._members
        cdef Py_ssize_t i
        if type(buffer) is Buffer and members is not None:
            owner = (<Buffer>buffer)._owner
            for i in range(PyTuple_GET_SIZE(members)):     # identity compares, no refcounts
                if PyTuple_GET_ITEM(members, i) == <PyObject*>owner:
                    owner._release(<Buffer>buffer)
                    return
        self._free_other(buffer)

    def _free_other(self, buffer):
        raise TypeError("PlacementCore is abstract: use gpumem.MultiDeviceManager")

    @cython.binding(False)
    @cython.embedsignature(True)
    @cython.embedsignature.format("clinic")
    def allocate_on_best_device(self, nbytes, name=None, *, stream=None, tag=None):
        """Allocate nbytes on the device the policy picks; a `name` pins the device on its
        first allocation and later ones follow it."""
        cdef tuple cores = self._fast_cores
        cdef PyObject* core
        cdef PyObject* best = NULL
        cdef size_t in_use, room, best_room = 0, limit
        cdef long long n = -1
        cdef int overflow = 0
        cdef Py_ssize_t i
        if name is None and stream is None and cores is not None and type(nbytes) is int:
            # the size in C, as in ManagerCore.malloc: no Python int is built per call
            n = PyLong_AsLongLongAndOverflow(nbytes, &overflow)
            if not overflow and 0 <= n < _SIZE_TOO_BIG:
                # "most free": one C load per device (borrowed references, no Python frame)
                for i in range(PyTuple_GET_SIZE(cores)):
                    core = PyTuple_GET_ITEM(cores, i)
                    if (<ManagerCore>core)._closed:
                        best = NULL
                        break
                    in_use = (<ManagerCore>core)._p.stats.in_use_bytes.load()
                    limit = (<ManagerCore>core)._max_request
                    room = limit - in_use if limit > in_use else 0
                    if best == NULL or room > best_room:
                        best = core
                        best_room = room
                if best != NULL:
                    return (<ManagerCore>best)._malloc_c(n, 0, tag)
        return self._allocate(nbytes, name, stream, tag)

    def _allocate(self, nbytes, name, stream, tag):
        raise TypeError("PlacementCore is abstract: use gpumem.MultiDeviceManager")
