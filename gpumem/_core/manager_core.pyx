# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""The managers' hot paths: `ManagerCore` (one device) and `PlacementCore` (several).

`ManagerCore` is the base class of `gpumem.MemoryManager`: its `malloc`/`free` are the whole
Python-level hot path (argument checks, one gm_alloc/gm_free, one Buffer built without
`__init__`). Everything rare (a miss, an error, the cache above its cap, what is not a Buffer)
goes to the slow path part the core holds (`_slow_path`, see manager_base.pyx); observers are
called from here while any are registered.

The manager's parts get Buffers carved from the pool, and the dead-stream marks the hot path
tests, through a `CoreAccess` (`_core_access()`), which holds the manager weakly: parts never
keep their manager alive, so a dropped manager is closed at once.

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

from gpumem._core.buffer cimport Buffer, new_buffer
from gpumem._core.manager_base cimport ManagerBase
from gpumem._core.native_cache cimport NativeCache
from gpumem._core.pool cimport (CachingPool, gm_pool, gm_block, gm_alloc_gil, gm_free_gil,
                                GM_OK)

import operator
import weakref

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


cdef class ManagerCore(ManagerBase):
    """malloc/free over a CachingPool; subclassed by gpumem.MemoryManager. Its state and cold
    machinery (deferred frees, destroyed streams, the address log) are in ManagerBase; what is
    rare goes to its slow path part."""

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
            # no device holds it: say what was asked
            raise self._slow_path.oom_error(operator.index(nbytes))
        if fallback is True:                 # the hot path: one pointer comparison
            return self._malloc_c(n, s, tag)
        if fallback is False:
            return self._malloc_c(n, s, tag, False)
        raise InvalidInputError(f"fallback must be True or False, got "
                                f"{type(fallback).__name__} {fallback!r}")

    cdef object _malloc_c(self, long long n, uint64_t s, object tag, bint fallback=True):
        """malloc after argument checks (shared with PlacementCore); `fallback` False: an
        exhausted device raises OutOfMemoryError instead of returning host memory."""
        # tag pools (sleep and wake): one pointer test unless region()/sleep tags were used
        if self._tag_pools is not None and (tag is not None or self._nregions):
            pool, tag = self._tag_pools.route(n, tag)     # the region's tag; its pool or None
            if pool is not None:
                return pool.malloc(n, stream=s, tag=tag, fallback=False)
        return self._malloc_pool(n, s, tag, fallback)

    cdef object _malloc_pool(self, long long n, uint64_t s, object tag, bint fallback=True):
        cdef gm_block* b
        if self._closed:
            raise ClosedManagerError(f"the manager for {self.device_string} is closed")
        if self.pending_free_bytes:
            self.collect_pending_frees()
        if self._ndead and s in self._dead_streams:       # refused there, or revived (handle reused)
            return self._slow_path.malloc(n, s, tag, fallback)
        if <size_t>n > self._max_request or gm_alloc_gil(self._p, <size_t>n, s, &b) != GM_OK:
            return self._slow_path.malloc(n, s, tag, fallback)
        return self._wrap(b, <size_t>n, s, tag)

    @cython.binding(False)
    @cython.embedsignature(True)
    @cython.embedsignature.format("clinic")
    def free(self, buffer) -> None:
        """Return a buffer to the pool (DoubleFreeError, ForeignBufferError on misuse)."""
        if type(buffer) is Buffer:
            self._release(buffer)
        elif self._slow_path is not None:
            self._slow_path.free_other(buffer)
        else:
            raise TypeError(f"free() takes a gpumem Buffer, got {type(buffer).__name__}")

    cdef Buffer _wrap(self, gm_block* b, size_t n, uint64_t s, object tag):
        cdef Buffer buf = new_buffer(self, b, n, s, tag)
        if self._addr_log != NULL:       # history recording: C stores only
            self._addr_log[2 * (self._addr_count & self._addr_mask)] = b.serial
            self._addr_log[2 * (self._addr_count & self._addr_mask) + 1] = buf._ptr
            self._addr_count += 1
        if tag is not None and self._tags is not None:    # untagged buffers: one test
            self._tags[b.serial] = tag
            if len(self._tags) > self._tags_limit:
                self._prune_tags()
        if self._hooks:
            self._notify(buf, True)
        return buf

    cdef int _release(self, object obj) except -1:
        cdef Buffer buf = <Buffer>obj          # Buffer.free and ManagerCore.free checked it
        cdef int rc
        if buf._owner is not self:
            if self._tag_pools is not None and self._tag_pools.owns(buf._owner):
                return buf._owner._release(buf)     # a buffer of one of this manager's tags
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
                self._notify(buf, False)
            return 0
        rc = gm_free_gil(self._p, buf._block, buf.id)
        if rc != GM_OK:
            raise DoubleFreeError(f"buffer {buf.id} is not live in this pool")
        buf._block = NULL
        if self._hooks:
            self._notify(buf, False)
        if (self._p.stats.reserved_bytes.load() - self._p.stats.in_use_bytes.load()
                > self._cache_limit):
            self._trim()
        return 0

    def _core_access(self) -> CoreAccess:
        """The handle the manager's parts use to reach this core (see CoreAccess)."""
        cdef CoreAccess access = CoreAccess.__new__(CoreAccess)
        access._ref = weakref.ref(self)
        return access


@cython.final
cdef class CoreAccess:
    """What a manager's parts (segment growth, streams, the miss path) may ask of its core:
    Buffers carved from the pool, the dead-stream marks the hot path tests, observers, and the
    manager itself. Holds the manager weakly: a part never keeps its manager alive (a dropped
    manager is closed at once); once the manager is gone every call raises
    ClosedManagerError."""

    cdef object _ref                   # weakref.ref to the ManagerCore

    def __init__(self, *args, **kwargs):
        raise TypeError("CoreAccess comes from a manager's _core_access()")

    cdef ManagerCore _core(self):
        core = self._ref()
        if core is None:
            raise ClosedManagerError("the manager of this part is gone")
        return <ManagerCore>core

    @property
    def manager(self):
        """The manager (what user callbacks receive); ClosedManagerError once it is gone."""
        return self._core()

    @property
    def closed(self) -> bool:
        core = self._ref()
        return core is None or (<ManagerCore>core)._closed

    def alloc_cached(self, size_t nbytes, uint64_t stream, tag):
        """A Buffer from the cache only; None on a miss."""
        cdef ManagerCore core = self._core()
        cdef gm_block* b
        if gm_alloc_gil(core._p, nbytes, stream, &b) != GM_OK:
            return None
        return core._wrap(b, nbytes, stream, tag)

    def alloc_in_new_segment(self, uint64_t handle, size_t base, size_t seg_size,
                             size_t nbytes, uint64_t stream, tag) -> Buffer:
        """The pool adopts a new segment and serves the request from it (MemoryError: the
        pool could not record it, and did not adopt it)."""
        cdef ManagerCore core = self._core()
        cdef gm_block* b
        core.pool.add_segment_and_alloc(handle, base, seg_size, nbytes, stream, &b)
        return core._wrap(b, nbytes, stream, tag)

    def alloc_in_grown_segment(self, uint64_t handle, size_t extra, size_t nbytes,
                               uint64_t stream, tag):
        """The request from segment `handle` grown by `extra` mapped bytes; None when the pool
        did not take them (nothing changed)."""
        cdef ManagerCore core = self._core()
        cdef gm_block* b
        if core.pool.grow_segment_and_alloc(handle, extra, nbytes, stream, &b) != 0:
            return None
        return core._wrap(b, nbytes, stream, tag)

    def notify_alloc(self, buf) -> None:
        """Tell the manager's observers of a buffer made off the pool (a CPU fallback)."""
        cdef ManagerCore core = self._core()
        if core._hooks:
            core._notify(buf, True)

    def notify_free(self, buf) -> None:
        cdef ManagerCore core = self._core()
        if core._hooks and not core._closed:
            core._notify(buf, False)

    # --- streams destroyed under the pool: malloc on them takes the slow path -----------------
    def stream_died(self, uint64_t stream) -> None:
        self._core()._mark_stream_dead(stream)

    def stream_revived(self, uint64_t stream) -> None:
        self._core()._mark_stream_alive(stream)

    def is_dead_stream(self, uint64_t stream) -> bool:
        cdef ManagerCore core = self._core()
        return core._ndead != 0 and stream in core._dead_streams


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
        cdef ManagerBase owner
        cdef tuple members = self._members
        cdef Py_ssize_t i
        if type(buffer) is Buffer and members is not None:
            owner = (<Buffer>buffer)._owner
            for i in range(PyTuple_GET_SIZE(members)):     # identity compares, no refcounts
                if PyTuple_GET_ITEM(members, i) == <PyObject*>owner:
                    owner._release(buffer)
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
