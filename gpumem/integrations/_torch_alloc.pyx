# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The C allocator that PyTorch loads through ``torch.cuda.memory.CUDAPluggableAllocator``.

This extension's shared library exports, with C linkage::

    void* gpumem_torch_alloc(ssize_t size, int device, cudaStream_t stream)
    void  gpumem_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream)

Python must import this module before torch ``dlopen()``s the file (gpumem.integrations.torch
does): the import links in the pool's C API, and ``dlopen`` of the same path returns the
module already loaded.

- **Hit** (no GIL): ``gm_alloc`` on the pool of the manager bound to ``device``, then the pointer
  is filed in a C open-addressing table (pointer -> block, serial), because the free gets only
  the pointer. The free of such a block is ``gm_free``, also without the GIL.
- **Through Python** (the GIL): a miss (a new segment, the OOM ladder), a first request on a new
  stream or an unbound device, and every request while the manager has observers (tracking,
  history), so that they see torch's memory. The manager's ``malloc`` returns a Buffer, which
  the table entry keeps; its free goes back through ``Buffer.free``. Host memory from the CPU
  fallback cannot back a CUDA tensor: such a request returns NULL (torch raises its OOM).
- A free of a pointer not in the table (not from here, or freed twice) is counted, nothing else.

Shared state and its locks:

- ``_devices[d]``: the context for torch device ``d`` (an owned reference to the manager, its
  pool and flag addresses), published through an atomic pointer. Written with the GIL only, by
  :func:`bind`/:func:`unbind`, which refuse while the device has live blocks; read without the
  GIL. Bind before torch allocates: a context replaced while a hit is under way is not
  reclaimed for that reason (it is kept, a few dozen bytes, never freed).
- ``_table``: guarded by ``_table_lock``, a C spin lock. Under it only C runs: no Python object
  is created or released. A thread that holds the GIL tries the lock once and otherwise
  releases the GIL while it waits. fork() takes it first (``os.register_at_fork``) and both
  processes release it after, so a child never inherits it held by a thread it lacks.
- Counters: ``std::atomic``, read without a lock. Those the hot path bumps (hits, misses,
  frees, per-device live) are written only under ``_table_lock``, with a relaxed load and
  store, so a hit costs no extra locked instruction; the rare ones use ``fetch_add``.
"""
cimport cython
from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF
from libc.stdint cimport uint64_t, uint8_t, SIZE_MAX
from libc.stdlib cimport calloc, free, malloc
from libcpp.atomic cimport atomic, memory_order_acquire, memory_order_release, memory_order_relaxed

from gpumem._core.manager_base cimport ManagerBase
from gpumem._core.pool cimport (CachingPool, gm_pool, gm_block, gm_alloc, gm_free,
                                gm_block_address, GM_OK)

import atexit
import os
import warnings

from gpumem._core.buffer import Buffer
from gpumem._core.manager_core import ManagerCore
from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.stats import StatsDict

cdef extern from "Python.h":
    ctypedef struct PyThreadState
    int PyGILState_Check() nogil
    PyThreadState* PyEval_SaveThread() nogil
    void PyEval_RestoreThread(PyThreadState*) nogil

cdef extern from *:
    """
    #include <atomic>
    /* A counter written only under the table lock: a relaxed load and store, no locked
       read-modify-write (readers without the lock see a recent value). */
    template <typename A> static inline void tm_add(A &c, long v) {
        c.store(c.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
    }
    """
    void tm_add(atomic[size_t]& c, long v) nogil

cdef extern from "<sched.h>":
    int sched_yield() nogil

cdef extern from "<sys/types.h>":
    ctypedef long ssize_t

cdef enum:
    MAX_DEVICES = 64
    _EMPTY = 0
    _FULL = 1
    _TOMB = 2
    _MIN_CAPACITY = 1024                 # power of two

ctypedef struct dev_ctx:
    gm_pool* pool
    const int* closed                    # the manager's _closed (a bint)
    const int* hooks                     # the manager's _via_python: every request through malloc
    PyObject* manager                    # owned reference
    atomic[size_t] cache_limit           # max_pool_size, SIZE_MAX when unlimited (written with
                                         # the GIL, read by frees without it: an atomic)
    int shared                           # bound from gpumem.get_manager (manager=None)
    atomic[size_t] live                  # table entries of this device

ctypedef struct entry:
    size_t ptr
    gm_block* block                      # NULL when `buf` holds the memory
    uint64_t serial
    PyObject* buf                        # owned reference to a Buffer (Python path) or NULL
    dev_ctx* ctx
    uint8_t state

cdef atomic[dev_ctx*] _devices[MAX_DEVICES]
cdef atomic[int] _table_lock
cdef entry* _table = NULL
cdef size_t _capacity = 0                # 0 or a power of two
cdef size_t _used = 0                    # full entries
cdef size_t _tombs = 0
cdef atomic[int] _shutting_down          # set at interpreter exit: no more Python work

cdef atomic[size_t] _hits, _misses, _frees     # written under the table lock (tm_add)
cdef atomic[size_t] _python_frees, _ooms, _fallbacks_refused
cdef atomic[size_t] _unknown_frees, _bad_frees, _bad_requests, _errors, _dropped_at_exit


# --- the table lock --------------------------------------------------------------------------
cdef inline void _spin_lock() noexcept nogil:
    cdef int spins = 0
    while _table_lock.exchange(1, memory_order_acquire):
        while _table_lock.load(memory_order_relaxed):
            spins += 1
            if spins >= 64:
                sched_yield()
                spins = 0

cdef void _lock_table() noexcept nogil:
    cdef PyThreadState* ts
    if not _table_lock.exchange(1, memory_order_acquire):
        return
    if PyGILState_Check():               # never spin while holding the GIL
        ts = PyEval_SaveThread()
        _spin_lock()
        PyEval_RestoreThread(ts)
    else:
        _spin_lock()

cdef inline void _unlock_table() noexcept nogil:
    _table_lock.store(0, memory_order_release)


# --- the pointer table (callers hold the table lock) -------------------------------------------
cdef inline size_t _slot_of(size_t ptr, size_t mask) noexcept nogil:
    # Fibonacci hashing of the address without its always-zero alignment bits
    return ((ptr >> 8) * <size_t>0x9E3779B97F4A7C15ULL >> 20) & mask

cdef int _rehash(size_t capacity) noexcept nogil:
    cdef entry* fresh = <entry*>calloc(capacity, sizeof(entry))
    cdef size_t i, j, mask = capacity - 1
    if fresh == NULL:
        return -1
    for i in range(_capacity):
        if _table[i].state == _FULL:
            j = _slot_of(_table[i].ptr, mask)
            while fresh[j].state == _FULL:
                j = (j + 1) & mask
            fresh[j] = _table[i]
    free(_table)
    global _table, _capacity, _tombs
    _table = fresh
    _capacity = capacity
    _tombs = 0
    return 0

cdef int _insert(size_t ptr, gm_block* block, uint64_t serial, PyObject* buf,
                 dev_ctx* ctx) noexcept nogil:
    """File a live pointer; -1 when the table cannot grow (out of host memory)."""
    cdef size_t j, mask
    global _used, _tombs
    if (_used + _tombs + 1) * 4 > _capacity * 3:
        if _rehash(_MIN_CAPACITY if _capacity == 0 else
                   (_capacity * 2 if _used * 2 >= _capacity else _capacity)) < 0:
            return -1
    mask = _capacity - 1
    j = _slot_of(ptr, mask)
    while _table[j].state == _FULL:
        j = (j + 1) & mask
    if _table[j].state == _TOMB:
        _tombs -= 1
    _table[j].ptr = ptr
    _table[j].block = block
    _table[j].serial = serial
    _table[j].buf = buf
    _table[j].ctx = ctx
    _table[j].state = _FULL
    _used += 1
    tm_add(ctx.live, 1)
    if block != NULL:
        tm_add(_hits, 1)
    else:
        tm_add(_misses, 1)
    return 0

cdef bint _remove(size_t ptr, entry* out) noexcept nogil:
    """Take the entry of `ptr` out of the table into `out`; False when it is not there."""
    cdef size_t j, mask
    global _used, _tombs
    if _capacity == 0:
        return False
    mask = _capacity - 1
    j = _slot_of(ptr, mask)
    while _table[j].state != _EMPTY:
        if _table[j].state == _FULL and _table[j].ptr == ptr:
            out[0] = _table[j]
            _table[j].state = _TOMB
            _table[j].buf = NULL
            _used -= 1
            _tombs += 1
            tm_add(out.ctx.live, -1)
            if out.buf == NULL:
                tm_add(_frees, 1)
            return True
        j = (j + 1) & mask
    return False


# --- the two entry points torch calls ----------------------------------------------------------
cdef public void* gpumem_torch_alloc(ssize_t size, int device, void* stream) noexcept nogil:
    cdef dev_ctx* c
    cdef gm_block* b
    cdef size_t ptr
    cdef int rc
    if size < 0 or device < 0 or device >= MAX_DEVICES:
        _bad_requests.fetch_add(1)
        return NULL
    c = _devices[device].load(memory_order_acquire)
    if c != NULL and not c.closed[0] and not c.hooks[0]:
        if gm_alloc(c.pool, <size_t>size, <uint64_t>stream, &b) == GM_OK:
            ptr = gm_block_address(b)
            _lock_table()
            rc = _insert(ptr, b, b.serial, NULL, c)
            _unlock_table()
            if rc == 0:
                return <void*>ptr
            gm_free(c.pool, b, b.serial)
            _errors.fetch_add(1)
            return NULL
    if _shutting_down.load():
        return NULL
    with gil:
        return <void*>_alloc_through_python(size, device, <size_t>stream)


cdef public void gpumem_torch_free(void* ptr, ssize_t size, int device,
                                   void* stream) noexcept nogil:
    cdef entry e
    cdef bint found
    cdef gm_pool* p
    _lock_table()
    found = _remove(<size_t>ptr, &e)
    _unlock_table()
    if not found:
        _unknown_frees.fetch_add(1)
        return
    if e.buf != NULL:
        if _shutting_down.load():
            _dropped_at_exit.fetch_add(1)   # the interpreter is going away with the memory
            return
        with gil:
            _free_through_python(e.buf)
        return
    p = e.ctx.pool
    if gm_free(p, e.block, e.serial) != GM_OK:    # the pool refused it (a bug): not a free
        _lock_table()
        tm_add(_frees, -1)
        _unlock_table()
        _bad_frees.fetch_add(1)
        return
    if (p.stats.reserved_bytes.load() - p.stats.in_use_bytes.load()
            > e.ctx.cache_limit.load(memory_order_relaxed)
            and not _shutting_down.load()):
        with gil:
            _trim(e.ctx)


# --- the Python side of a request (called with the GIL; never raise) ----------------------------
cdef size_t _alloc_through_python(ssize_t size, int device, size_t stream) noexcept:
    cdef dev_ctx* c
    cdef size_t ptr
    cdef int rc
    try:
        c = _context_for(device)
        buf = (<object>c.manager).malloc(size, stream=stream, tag="torch")
        _refresh_limits(c)
    except OutOfMemoryError:
        _ooms.fetch_add(1)
        return 0
    except BaseException as exc:
        _errors.fetch_add(1)
        warnings.warn(f"gpumem torch allocator: {size} B on device {device} failed: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning)
        return 0
    if type(buf) is not Buffer:          # a FallbackBuffer: host memory is no CUDA tensor
        _fallbacks_refused.fetch_add(1)
        try:
            buf.free()
        except BaseException:
            pass
        return 0
    ptr = buf.ptr
    Py_INCREF(buf)
    _lock_table()
    rc = _insert(ptr, NULL, buf.id, <PyObject*>buf, c)
    _unlock_table()
    if rc != 0:
        Py_DECREF(buf)
        _errors.fetch_add(1)
        return 0
    return ptr


cdef void _free_through_python(PyObject* owned) noexcept:
    buf = <object>owned                  # a new reference; the table's is dropped next
    Py_DECREF(buf)
    try:
        buf.free()
        _python_frees.fetch_add(1)
    except BaseException as exc:
        _bad_frees.fetch_add(1)
        warnings.warn(f"gpumem torch allocator: freeing buffer {buf.id} failed: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning)


cdef void _trim(dev_ctx* c) noexcept:
    try:
        (<ManagerBase>c.manager)._trim()
    except BaseException as exc:
        warnings.warn(f"gpumem torch allocator: trimming the cache failed: {exc}",
                      RuntimeWarning)


cdef void _refresh_limits(dev_ctx* c):
    limit = getattr(<object>c.manager, "_max_pool_size", None)
    c.cache_limit.store(SIZE_MAX if limit is None else <size_t>limit, memory_order_relaxed)


cdef dev_ctx* _context_for(int device) except NULL:
    """The device's context; an unbound device, or one whose shared manager was closed (and
    has nothing left in torch's hands), gets gpumem.get_manager's manager."""
    cdef dev_ctx* c = _devices[device].load(memory_order_acquire)
    if c == NULL or (c.shared and c.closed[0] and c.live.load() == 0):
        import gpumem
        bind(gpumem.get_manager(f"cuda:{device}"), device)
        c = _devices[device].load(memory_order_acquire)
        c.shared = 1
    return c


# --- Python API (with the GIL) -----------------------------------------------------------------
def _check_device(device) -> int:
    if isinstance(device, bool) or not isinstance(device, int):
        raise InvalidInputError(f"device must be an int index, got {type(device).__name__}")
    if not 0 <= device < MAX_DEVICES:
        raise InvalidInputError(f"device must be in [0, {MAX_DEVICES}), got {device}")
    return device


def bind(manager, device) -> None:
    """Serve torch device `device` from `manager`'s pool. Refused (InvalidInputError) while the
    device has live blocks from another manager; binding the same manager again is a no-op."""
    cdef dev_ctx* old
    cdef dev_ctx* c
    cdef CachingPool pool
    cdef size_t closed_addr, hooks_addr
    if not isinstance(manager, ManagerCore):
        raise InvalidInputError(f"manager must be a gpumem.MemoryManager, got "
                                f"{type(manager).__name__}")
    _check_device(device)
    if manager.closed:
        raise InvalidInputError(f"manager {manager!r} is closed")
    old = _devices[device].load(memory_order_acquire)
    if old != NULL and <object>old.manager is manager:
        return
    if old != NULL and old.live.load():
        raise InvalidInputError(
            f"torch device {device} still has {old.live.load()} live blocks from "
            f"{<object>old.manager!r}; free them before binding another manager")
    pool = manager.pool
    closed_addr, hooks_addr = manager._flag_addresses()
    c = <dev_ctx*>calloc(1, sizeof(dev_ctx))
    if c == NULL:
        raise MemoryError()
    c.pool = pool._p
    c.closed = <const int*>closed_addr
    c.hooks = <const int*>hooks_addr
    c.manager = <PyObject*>manager
    Py_INCREF(manager)
    _refresh_limits(c)
    _devices[device].store(c, memory_order_release)
    if old != NULL:
        Py_DECREF(<object>old.manager)   # `old` itself is kept: see the module docstring


def unbind(device) -> None:
    """Forget the manager of torch device `device` (refused while it has live blocks)."""
    cdef dev_ctx* old
    _check_device(device)
    old = _devices[device].load(memory_order_acquire)
    if old == NULL:
        return
    if old.live.load():
        raise InvalidInputError(f"torch device {device} still has {old.live.load()} live blocks")
    _devices[device].store(NULL, memory_order_release)
    Py_DECREF(<object>old.manager)


def bound_manager(device):
    """The manager serving torch device `device`, or None."""
    cdef dev_ctx* c = _devices[_check_device(device)].load(memory_order_acquire)
    return None if c == NULL else <object>c.manager


def live_blocks(device=None) -> int:
    """Pointers handed to torch and not yet freed (on `device`, or on all devices)."""
    cdef dev_ctx* c
    if device is None:
        return sum(live_blocks(d) for d in range(MAX_DEVICES))
    c = _devices[_check_device(device)].load(memory_order_acquire)
    return 0 if c == NULL else c.live.load()


class TorchCounters(StatsDict):
    """:func:`counters`: gpumem.stats' vocabulary where a figure has a name there; the names
    used before still read, with a DeprecationWarning."""
    what = "gpumem.integrations.torch.counters()"
    renamed = {"hits": "nogil_allocs", "frees": "nogil_frees", "ooms": "num_ooms"}


def counters():                          # a TorchCounters: a dict subclass
    """What the entry points did since the process started: requests served (``num_allocs``:
    without the GIL, ``nogil_allocs``, or through Python) and frees (``num_frees``, by path),
    ``num_ooms``, and what was refused or not understood."""
    nogil_allocs, through_python = _hits.load(), _misses.load()
    nogil_frees, python_frees = _frees.load(), _python_frees.load()
    return TorchCounters(
        num_allocs=nogil_allocs + through_python, num_frees=nogil_frees + python_frees,
        num_ooms=_ooms.load(), nogil_allocs=nogil_allocs, through_python=through_python,
        nogil_frees=nogil_frees, python_frees=python_frees,
        fallbacks_refused=_fallbacks_refused.load(), unknown_frees=_unknown_frees.load(),
        bad_frees=_bad_frees.load(), bad_requests=_bad_requests.load(), errors=_errors.load(),
        dropped_at_exit=_dropped_at_exit.load())


def _at_exit() -> None:
    _shutting_down.store(1)


atexit.register(_at_exit)


def _before_fork() -> None:
    _lock_table()


def _after_fork() -> None:
    _unlock_table()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                        after_in_child=_after_fork)
