# cython: language_level=3
"""Layout of ManagerBase (manager_base.pyx): the state every manager keeps. buffer.pyx cimports
it (a Buffer's owner), manager_core.pyx subclasses it (ManagerCore, the malloc/free hot path)."""
from libc.stdint cimport uint64_t

from gpumem._core.native_cache cimport NativeCache
from gpumem._core.pool cimport CachingPool, gm_pool, gm_block


cdef class ManagerBase:
    cdef readonly CachingPool pool
    cdef gm_pool* _p
    cdef readonly object device
    cdef readonly str device_string
    cdef readonly bint _closed
    cdef public bint _hooks              # observers (stack tracking): _observers are called
    cdef public bint _via_python         # C clients' requests go through malloc (observers,
                                         # or tags kept: their buffers are tagged)
    cdef size_t _max_request             # above this a request fails at once, no driver call
    cdef size_t _cache_limit             # cached bytes above this call _trim()
    cdef list _pending                   # _PendingFree: freed, waiting for other streams
    cdef readonly size_t pending_free_bytes
    cdef object _collect_lock            # threading.RLock: one collect_pending_frees at a time
    cdef bint _collecting                # set while this manager's collector runs
    cdef set _dead_streams               # destroyed streams with heaps still in the pool
    cdef int _ndead                      # len(_dead_streams): one C test on the hot path
    cdef NativeCache _native_cache       # the device's `native_cache` (Buffer.native), or None
    # The slow path (gpumem.manager.miss_path.MissPath, see manager_base.pyi `SlowPath`): what
    # the core calls off the hot path, a part it holds rather than a method a subclass overrides
    cdef object _slow_path
    cdef readonly tuple _observers       # on_alloc/on_free observers, called while _hooks
    # Tracking and history read the pool's live blocks and C history rings; the only
    # per-buffer state they need on the hot path is kept here, written under the GIL:
    cdef public dict _tags               # id -> tag of tagged buffers (None: not kept)
    cdef public Py_ssize_t _tags_limit   # above this many entries _prune_tags() runs
    cdef public Py_ssize_t _tags_keep    # the newest tags kept anyway (a recorder shows them)
    cdef uint64_t* _addr_log             # (id, address) pairs of recent allocations, or NULL:
    cdef size_t _addr_mask               # the pool's history has no address column
    cdef size_t _addr_count
    # Sleep and wake (gpumem/manager/tag_pools.py, sleep.py): the parent's tag pools, read on
    # the hot path as one pointer test; a tag pool's mark while its memory sleeps
    cdef public object _tag_pools        # TagPools once a region or sleep tag was declared
    cdef public int _nregions            # region() blocks open (any thread): one C test
    cdef public object _asleep_tag       # not None while this (tag) pool's memory sleeps


    # Buffer's calls into its owner (implemented by ManagerCore; `buf` is a Buffer)
    cdef int _release(self, object buf) except -1
    cdef int _release_dropped(self, gm_block* b, uint64_t serial, object info,
                              list used_on) except -1
    cdef int _notify(self, object buf, bint alloc) except -1
    cdef int _trim(self) except -1
    cdef int _prune_tags(self) except -1
    cdef int _defer_free(self, gm_block* b, uint64_t serial, list streams) except -1
    cdef _destroy_events(self, list events)
    cdef bint _events_done(self, list events) except -1
    cdef int _mark_stream_dead(self, uint64_t s) except -1
    cdef int _mark_stream_alive(self, uint64_t s) except -1
