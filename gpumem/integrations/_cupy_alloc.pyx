# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""The hot path of gpumem's CuPy allocator (``gpumem.integrations.cupy``), with no Python frame.

A request ``allocator(size)`` runs here in C: CuPy's current device and stream are read through
the callables CuPy exposes (``cupy.cuda.runtime.getDevice``, ``cupy.cuda.get_current_stream``),
the manager's C-level malloc gives a Buffer on that stream, and CuPy's own classes, called
through the type objects cached when the allocator was made
(``cupy.cuda.UnownedMemory(ptr, size, owner=buffer, device_id)`` in a
``cupy.cuda.MemoryPointer``), wrap it. When CuPy drops the pointer, the UnownedMemory drops the
Buffer, whose block returns to the pool filed under that stream.

This module knows no CuPy type at compile time: ``gpumem.integrations.cupy`` hands it CuPy's
callables and types (so gpumem builds and imports where CuPy is absent, and the tests can
replace CuPy's device queries, which need a GPU, before making an allocator).

What leaves the hot path: a size that is not a plain int in [0, 2**62) goes through the
manager's ``malloc``, whose checks raise the usual errors; an out-of-memory is converted to
the error type handed in (gpumem's OutOfMemoryError that is CuPy's too).

Thread safety: an allocator's fields are set once, by ``_configure``; the per-device cache of
shared managers is a list changed under the GIL (two threads refreshing it at once both store
the same manager, ``gpumem.get_manager``'s).
"""
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport uint64_t

from gpumem._core.buffer cimport Buffer
from gpumem._core.manager_core cimport ManagerCore

from gpumem.errors import InvalidInputError, OutOfMemoryError

cdef long long _SIZE_LIMIT = 1LL << 62      # ManagerCore.malloc's: larger ones take its checks
cdef object _TAG = "cupy"


cdef class CupyAllocatorCore:
    """``allocator(size) -> cupy.cuda.MemoryPointer``; configured by the Python subclass
    (``gpumem.integrations.cupy.GpumemCupyAllocator``), which passes CuPy's callables."""

    cdef readonly object manager           # the bound manager, or None: the shared managers
    cdef ManagerCore _bound                # `manager`, typed (None with shared managers)
    cdef readonly int device_id            # the bound manager's CUDA index, -1 when unbound
    cdef object _get_device                # () -> CuPy's current device index
    cdef object _get_stream                # (device) -> CuPy's current stream (has .ptr)
    cdef object _memory_type               # (ptr, size, owner, device) -> BaseMemory
    cdef object _pointer_type              # (memory, offset) -> MemoryPointer
    cdef object _convert_oom               # (gpumem OutOfMemoryError) -> the error to raise
    cdef object _get_manager               # (device string) -> the shared manager
    cdef list _shared                      # device index -> last shared manager (or None)

    def _configure(self, manager, int device_id, get_device, get_stream, memory_type,
                   pointer_type, convert_oom, get_manager) -> None:
        """Bind to `manager` (a MemoryManager of CUDA device `device_id`) or, with None, to
        the shared manager of CuPy's current device on each request; the rest is CuPy's API
        (see the module docstring) and gpumem.get_manager."""
        if manager is not None and not isinstance(manager, ManagerCore):
            raise InvalidInputError(f"manager must be a gpumem.MemoryManager or None, got "
                                    f"{type(manager).__name__}")
        self.manager = manager
        self._bound = manager
        self.device_id = device_id if manager is not None else -1
        self._get_device = get_device
        self._get_stream = get_stream
        self._memory_type = memory_type
        self._pointer_type = pointer_type
        self._convert_oom = convert_oom
        self._get_manager = get_manager
        self._shared = []

    def __call__(self, size):
        cdef int device
        cdef ManagerCore mm
        cdef Buffer buf
        cdef long long n = -1
        cdef int overflow = 0
        cdef uint64_t s
        if self._get_device is None:
            raise TypeError("CupyAllocatorCore is configured by its subclass: use "
                            "gpumem.integrations.cupy.allocator()")
        device_index = self._get_device()
        device = device_index
        if self._bound is not None:
            mm = self._bound
            if device != self.device_id:
                raise InvalidInputError(
                    f"CuPy's current device is {device} but this allocator serves "
                    f"{mm.device_string}; use one allocator per device or manager=None")
        else:
            mm = self._shared_manager(device)
        s = _stream_handle(mm, self._get_stream(device_index).ptr)
        if type(size) is int:             # C compares only, as in ManagerCore.malloc
            n = PyLong_AsLongLongAndOverflow(size, &overflow)
        try:
            if overflow or not 0 <= n < _SIZE_LIMIT:
                buf = mm.malloc(size, stream=s, tag=_TAG, fallback=False)   # raises
                size = buf.nbytes
            else:
                # fallback False: host memory cannot back a CuPy array, so an exhausted
                # device raises at once instead of taking host memory to give it back
                buf = mm._malloc_c(n, s, _TAG, False)
        except OutOfMemoryError as exc:
            raise self._convert_oom(exc) from None
        # CuPy's objects get the Python ints already at hand (`size`, `device_index`)
        return self._pointer_type(self._memory_type(buf._ptr, size, buf, device_index), 0)

    cdef ManagerCore _shared_manager(self, int device):
        """gpumem.get_manager(f"cuda:{device}"), remembered per device: a shared manager that
        gpumem replaces (configure, close_shared_managers) is closed first, so a closed one
        sends the next request to get_manager again."""
        cdef list cache = self._shared
        if 0 <= device < len(cache):
            mm = cache[device]
            if mm is not None and not (<ManagerCore>mm)._closed:
                return <ManagerCore>mm
        mm = self._get_manager(f"cuda:{device}")
        if not isinstance(mm, ManagerCore):
            raise InvalidInputError(f"gpumem.get_manager('cuda:{device}') returned "
                                    f"{type(mm).__name__}, not a MemoryManager")
        if device >= 0:
            while len(cache) <= device:
                cache.append(None)
            cache[device] = mm
        return <ManagerCore>mm


cdef inline uint64_t _stream_handle(ManagerCore mm, object ptr) except? 0:
    """A CuPy stream's ``ptr`` as the pool's stream key (the manager's own checks and errors
    for anything but a non-negative int)."""
    cdef int overflow = 0
    cdef long long v
    if type(ptr) is int:
        v = PyLong_AsLongLongAndOverflow(ptr, &overflow)
        if not overflow and v >= 0:
            return <uint64_t>v
    return mm._stream_handle(ptr)
