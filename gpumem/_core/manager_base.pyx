# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""The state of a manager and its cold machinery, below the hot path.

`ManagerBase` holds what every manager keeps (pool, device, limits, flags C clients read) and
runs what is rare: frees deferred until other streams pass an event (`Buffer.record_stream`),
streams destroyed under the pool, the address log of the history, stream arguments, observers.
`ManagerCore` (manager_core.pyx) subclasses it with malloc/free; `gpumem.MemoryManager`
subclasses that.

Off the hot path the core calls one part it holds, the *slow path* (`_slow_path`, set by
`_set_slow_path`; `gpumem.manager.miss_path.MissPath`): `malloc` on a miss, `trim_cache` when
the cache passes its cap, `free_other` for what is not a Buffer, `check_stream`, `oom_error`
(the `SlowPath` protocol in manager_base.pyi). No Python subclass overrides a core method.

Thread safety (docs/concurrency.md): deferred frees are appended to `_pending` without a lock
(one list operation under the GIL, safe from `__dealloc__`) and removed only by the one
collector holding `_collect_lock`.
"""
cimport cython
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free

from gpumem._core.native_cache cimport NativeCache
from gpumem._core.pool cimport CachingPool, gm_block, gm_free_gil, GM_OK

import operator
import threading
import warnings

from gpumem._core.stream_handles import foreign_stream_handle
from gpumem.errors import InvalidInputError

_STREAM_LIMIT = 1 << 64
NOT_COPYABLE = ("a gpumem {} cannot be copied or pickled: it owns device memory that has one "
                "owner; use copy_to_host() for the bytes, or a new malloc() and copy_from_host()")


@cython.final
cdef class _PendingFree:
    """A freed block waiting for events on the other streams that used it."""
    cdef gm_block* block
    cdef uint64_t serial
    cdef list events


def stream_handle(stream) -> int:
    """The integer handle of a stream argument: an int, or a stream object of any framework
    (``foreign_stream_handle``). Values outside [0, 2**64) raise InvalidInputError."""
    if type(stream) is int and 0 <= stream < _STREAM_LIMIT:
        return stream
    if isinstance(stream, bool):
        raise TypeError("stream must be an int handle or a stream object, not a bool")
    if hasattr(stream, "__index__"):
        handle = operator.index(stream)
    else:
        handle = foreign_stream_handle(stream)
    if not 0 <= handle < _STREAM_LIMIT:
        raise InvalidInputError(f"stream handle must be in [0, 2**64), got {handle}")
    return handle


cdef class ManagerBase:
    """The state of a manager and its cold machinery; ManagerCore (manager_core.pyx) adds the
    hot path."""

    # Device memory has one owner: see Buffer.__reduce_ex__.
    def __reduce_ex__(self, protocol):
        raise TypeError(NOT_COPYABLE.format(type(self).__name__))

    def __copy__(self):
        raise TypeError(NOT_COPYABLE.format(type(self).__name__))

    def __deepcopy__(self, memo):
        raise TypeError(NOT_COPYABLE.format(type(self).__name__))

    def __dealloc__(self):
        free(self._addr_log)

    def _set_address_log(self, size_t capacity) -> None:
        """Keep the addresses of the newest `capacity` allocations (rounded up to a power of
        two; 0: none) for history readers; forgets what was kept."""
        cdef size_t cap = 1
        cdef uint64_t* log = NULL
        if capacity:
            while cap < capacity:
                cap <<= 1
            log = <uint64_t*>calloc(2 * cap, sizeof(uint64_t))
            if log == NULL:
                raise MemoryError(f"cannot keep the addresses of {cap} allocations")
        free(self._addr_log)
        self._addr_log = log
        self._addr_mask = cap - 1 if capacity else 0
        self._addr_count = 0

    def _addresses(self) -> dict:
        """``{id: address}`` of the allocations in the address log."""
        cdef size_t i, n
        out = {}
        if self._addr_log == NULL:
            return out
        n = min(self._addr_count, self._addr_mask + 1)
        for i in range(self._addr_count - n, self._addr_count):
            out[self._addr_log[2 * (i & self._addr_mask)]] = \
                self._addr_log[2 * (i & self._addr_mask) + 1]
        return out

    cdef int _prune_tags(self) except -1:
        """``_tags`` outgrew ``_tags_limit`` (the alloc path, rarely): forget the tags of freed
        buffers, except the newest ``_tags_keep`` ones a running history recorder may still
        show."""
        tags = self._tags
        if tags is None:
            return 0
        ids = list(tags)
        old = ids[:max(0, len(ids) - self._tags_keep)]
        if old:
            live = {b["id"] for seg in self.pool.segments() for b in seg["blocks"]
                    if b["state"] == "allocated"}     # frees waiting for other streams too
            for bid in old:
                if bid not in live:
                    tags.pop(bid, None)
        self._tags_limit = 2 * len(tags) + 4096
        return 0

    def _core_init(self, CachingPool pool, device, str device_string) -> None:
        self.pool = pool
        self._p = pool._p
        self.device = device
        self.device_string = device_string
        cache = getattr(device, "native_cache", None)
        self._native_cache = cache if isinstance(cache, NativeCache) else None
        self._max_request = <size_t>-1
        self._cache_limit = <size_t>-1
        self._pending = []
        self._collect_lock = threading.RLock()
        self._dead_streams = set()
        self._observers = ()

    def _set_slow_path(self, slow_path) -> None:
        """The part called off the hot path (see the module docstring)."""
        self._slow_path = slow_path

    def _set_observers(self, observers) -> None:
        """Objects whose on_alloc(buf)/on_free(buf) see every buffer; () for none (the hot
        path then does no extra work)."""
        self._observers = tuple(observers)
        self._hooks = bool(self._observers)

    # --- Buffer's calls into its owner ------------------------------------------------------
    cdef int _release(self, object buf) except -1:
        raise TypeError("ManagerBase is abstract: use gpumem.MemoryManager")

    cdef int _release_dropped(self, gm_block* b, uint64_t serial, object info,
                              list used_on) except -1:
        """Buffer.__dealloc__'s free: the block by pointer and serial, observers told `info`."""
        if used_on is not None:
            self._defer_free(b, serial, used_on)
        elif gm_free_gil(self._p, b, serial) != GM_OK:
            return 0                  # already returned (e.g. the pool was reset)
        if info is not None:
            self._notify(info, False)
        if (self._p.stats.reserved_bytes.load() - self._p.stats.in_use_bytes.load()
                > self._cache_limit):
            self._trim()
        return 0

    cdef int _notify(self, object buf, bint alloc) except -1:
        """Tell the observers of an allocation (`alloc`) or a free."""
        for obs in self._observers:
            if alloc:
                obs.on_alloc(buf)
            else:
                obs.on_free(buf)
        return 0

    cdef int _trim(self) except -1:
        """The cached bytes passed the cap: the slow path gives some back."""
        if self._slow_path is not None:
            self._slow_path.trim_cache()
        return 0

    def _set_limits(self, max_request, cache_limit) -> None:
        """max_request: largest servable request; cache_limit: cached bytes kept (None: any)."""
        self._max_request = <size_t>-1 if max_request is None else <size_t>max_request
        self._cache_limit = <size_t>-1 if cache_limit is None else <size_t>cache_limit

    def _mark_closed(self) -> None:
        self._closed = True

    def _flag_addresses(self) -> tuple:
        """``(address of the closed flag, address of the via-Python flag)``, two C ints.
        C-level clients that allocate without the GIL (the torch allocator) read them to know
        when a request must go through Python instead; valid while they hold a reference to
        self."""
        return <size_t>&self._closed, <size_t>&self._via_python

    # --- frees that wait for other streams (Buffer.record_stream) ------------------------------
    cdef int _defer_free(self, gm_block* b, uint64_t serial, list streams) except -1:
        """Record an event on each stream that used the block; the block goes back to the pool
        once every event is done (collect_pending_frees). If an event cannot be recorded the
        device is synchronized instead, which is always safe, and the block is freed now."""
        cdef _PendingFree p = _PendingFree.__new__(_PendingFree)
        p.block = b
        p.serial = serial
        p.events = []
        try:
            for s in streams:
                p.events.append(self.device.record_event(s))
        except Exception as exc:
            self._destroy_events(p.events)
            warnings.warn(f"gpumem: could not record an event for buffer {serial} on "
                          f"{self.device_string} ({exc}); synchronizing instead", RuntimeWarning)
            self.device.synchronize()
            gm_free_gil(self._p, b, serial)
            return 0
        self._pending.append(p)
        self.pending_free_bytes += b.size
        return 0

    cdef _destroy_events(self, list events):
        for e in events:
            try:
                self.device.destroy_event(e)
            except Exception:
                pass                  # an event the driver already dropped: nothing to free

    cdef bint _events_done(self, list events) except -1:
        for e in events:
            if not self.device.event_done(e):
                return False
        return True

    @property
    def pending_free_count(self) -> int:
        """Freed buffers whose blocks wait for other streams (see Buffer.record_stream)."""
        return len(self._pending)

    def pending_free_ids(self) -> frozenset:
        """Ids of the freed buffers whose blocks wait for other streams."""
        return frozenset((<_PendingFree>p).serial for p in list(self._pending))

    def collect_pending_frees(self, bint wait=False) -> int:
        """Return to the pool every deferred free whose streams have passed it (all of them,
        after synchronizing the device, when `wait`); the number of blocks returned.

        One collector at a time (``_collect_lock``). Without `wait` a call that finds another
        thread collecting returns 0 at once (malloc calls this and must not queue behind it);
        a call re-entered from a finalizer that runs during a collection returns 0 too.
        Deferrers only append to ``_pending``; only the collector removes, so the first n
        entries it saw stay where they are while event queries let the GIL go."""
        cdef _PendingFree p
        cdef list pending = self._pending
        cdef list done = []
        cdef Py_ssize_t i, n
        if not pending:
            return 0
        if not self._collect_lock.acquire(wait):
            return 0
        try:
            if self._collecting:
                return 0
            self._collecting = True
            try:
                n = len(pending)
                error = None
                if wait:
                    self.device.synchronize()
                for i in range(n):
                    try:
                        if wait or self._events_done((<_PendingFree>pending[i]).events):
                            done.append(i)
                    except Exception as exc:  # a driver error: the rest stays pending
                        error = exc
                        break
                for i in reversed(done):
                    p = pending[i]
                    del pending[i]
                    self.pending_free_bytes -= p.block.size
                    gm_free_gil(self._p, p.block, p.serial)
                    self._destroy_events(p.events)
                if error is not None:
                    raise error
                return len(done)
            finally:
                self._collecting = False
        finally:
            self._collect_lock.release()

    # --- streams destroyed under the pool (Device.destroy_stream, or found unknown) ----------
    cdef int _mark_stream_dead(self, uint64_t s) except -1:
        """From now on malloc on `s` takes the slow path, which refuses it (or, if the driver
        reused the handle for a new stream, revives it)."""
        if s not in self._dead_streams:
            self._dead_streams.add(s)
            self._ndead += 1
        return 0

    cdef int _mark_stream_alive(self, uint64_t s) except -1:
        if s in self._dead_streams:
            self._dead_streams.discard(s)
            self._ndead -= 1
        return 0

    def _stream_died(self, stream) -> None:
        self._mark_stream_dead(stream)

    def _stream_revived(self, stream) -> None:
        self._mark_stream_alive(stream)

    def _is_dead_stream(self, stream) -> bool:
        return self._ndead != 0 and stream in self._dead_streams

    def _reset_collector(self) -> None:
        """After fork: the collector lock may have been held by a thread that is gone."""
        self._collect_lock = threading.RLock()
        self._collecting = False

    def _stream_handle(self, stream) -> int:
        """The integer handle of a stream argument (see `stream_handle`)."""
        if type(stream) is int and 0 <= stream < _STREAM_LIMIT:
            return stream
        return stream_handle(stream)

    def _check_stream(self, stream) -> None:
        """A stream handle the device knows (Buffer.record_stream); the slow path registers it."""
        if self._slow_path is not None:
            self._slow_path.check_stream(stream)
