# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The caching pool: segments carved into blocks, in C structures, behind a spin mutex.

Free blocks live in two-level segregated size-class lists (TLSF): 32 classes per power of two,
a 64-bit word of "class non-empty" bits per 64 classes and one top word, so finding the smallest
non-empty class that fits is two count-trailing-zeros, whatever the number of cached blocks.
Each stream has its own pair of heaps (small pool, large pool): a block freed on stream S is
reused by S at once and handed to another stream only through `reclaim_idle`, which the
manager calls once the backend says S is idle.

Counters are std::atomic so `counters()` reads them without the lock; they are written only
under the lock, so a relaxed load+store (no locked read-modify-write) is enough.

The lock (one owner: the pool; it guards every C structure of the pool and nothing else):

- While it is held **no Python object is created, no Python code runs and the GIL is never
  needed**. Any allocation of a Python object can start the cyclic GC, which can free a Buffer
  whose ``__dealloc__`` needs this lock (a self-deadlock), or run a finalizer that lets the GIL
  go while another thread spins on the lock. So methods that return Python objects copy what
  they need into C memory under the lock and build their result after unlocking; arguments are
  converted to C before locking; errors are raised after unlocking.
- A caller that holds the GIL never spins on the lock: it tries it once and otherwise releases
  the GIL while it waits (``_lock_gil``; CuPy's idiom). ``gm_alloc_gil``/``gm_free_gil`` are
  the GIL-holding variants of ``gm_alloc``/``gm_free``; nogil callers use the plain ones.

Front caches (threads that scale; _pool_front.pxd): a block freed by a nogil gm_free stays carved
in its thread's front cache and serves that thread's next gm_alloc of the same (stream, size)
without the pool lock. The pool counts a front-cached block as in use; ``counters()``,
``in_use_bytes``, ``segments()``, ``largest_free_block()`` and ``check_invariants()`` fold the
front caches in, and ``release_free_segments()``/``excess_free_segments()`` (empty_cache, the OOM
ladder, trimming) flush them first. The GIL-holding path takes from its thread's front cache
but always frees to the pool, so Python-only use never fills one.

History: alloc/free events go to C rings (gm_ring), the pool's under the pool lock and each front
cache's under its own lock; ``history()`` copies them out under all locks and merges by time.
An event's time is one load of the history clock, a ticker thread's CLOCK_MONOTONIC sample
(_pool_clock.pxd: why, and its life cycle).

Modules (one job each; what several of them need is ``cdef inline`` in the internal .pxd
files, compiled into each module that uses it, so the hot path calls nothing through another
module):

- pool.pyx (this one): the hot path (carving and accounting, alloc/free under the lock,
  gm_alloc/gm_free and their _gil variants), CachingPool (its expandable-segment methods call
  pool_pages);
- _pool_inline.pxd: locks, size classes, heaps and best fit, block structs, stream slots,
  coalescing, history rings, segment lookup;
- _pool_front.pxd: the per-thread front caches (cimported by this module only);
- _pool_clock.pxd: the history clock and the ring write (cimported by this module only);
- pool_segments.pyx: adopting, detaching, releasing and restoring segments, flushing the front
  caches, re-filing idle streams' blocks, freeing the pool's records;
- pool_inspect.pyx: counters, the largest free block, the segment table, check_invariants;
- pool_history.pyx: sizing the history rings and exporting them to numpy;
- pool_pages.pyx: the unmapped block state of expandable segments (holes): carving free pages
  into holes, filling holes, planning where a miss maps pages.

CachingPool's cold methods call the cdef functions of the last four through their capsule
tables (one indirect call, on paths that go to the driver or build Python objects anyway).
"""
cimport cython
from array import array
from libc.stdint cimport uint64_t, SIZE_MAX
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from libcpp.atomic cimport memory_order_relaxed

from gpumem._core._pool_inline cimport (
    aligned_alloc, gm_add, gm_sub, gm_max, _lock, _unlock, _lock_gil, _shard_lock,
    _shard_lock_gil, _shard_unlock, _ring_init, _class_of, _heap_insert, _heap_remove,
    _take_fit, _new_block, _drop_block, _slot, _register_stream, _coalesce_insert,
    _round_up, _round_size, _find_segment, _last_block, _lock_all_gil, _unlock_all)
from gpumem._core._pool_clock cimport _record, gm_clock_ticking, gm_clock_value
from gpumem._core._pool_front cimport _my_shard, _front_take, _front_put, _top_up_serials
from gpumem._core cimport pool_history, pool_inspect, pool_pages, pool_segments


# ---------------------------------------------------------------------------------------------
# carving and accounting
cdef inline bint _worth_splitting(const gm_pool* p, const gm_block* b, size_t s) noexcept nogil:
    cdef size_t rest = b.size - s
    if b.segment.is_small:
        return rest >= p.cfg.granularity
    return rest >= p.cfg.large_split_min and s < p.cfg.max_split_size

cdef int _carve(gm_pool* p, gm_block* b, size_t s, size_t requested, uint64_t stream,
                int hi) noexcept nogil:
    """Make b (already out of every heap) a live block of s bytes; its remainder, if worth
    keeping, goes back to heap hi. Returns -1 when no block struct could be had."""
    cdef gm_block* r
    cdef size_t in_use
    if b.offset == 0 and b.next == NULL:
        gm_sub(p.stats.whole_free_bytes, b.segment.size)
    if _worth_splitting(p, b, s):
        r = _new_block(p)
        if r == NULL:
            return -1
        r.segment = b.segment
        r.offset = b.offset + s
        r.size = b.size - s
        r.stream = p.heaps[hi].stream
        r.prev = b
        r.next = b.next
        if b.next != NULL:
            b.next.prev = r
        b.next = r
        b.size = s
        _heap_insert(p.heaps[hi], r, hi)
    b.requested = requested
    b.stream = stream
    b.heap_index = -1
    b.serial = p.stats.next_serial.load(memory_order_relaxed) + 1
    p.stats.next_serial.store(b.serial, memory_order_relaxed)
    _record(&p.history, 0, b.serial, requested, stream)
    b.segment.live_blocks += 1
    gm_add(p.stats.in_use_bytes, b.size)
    gm_add(p.stats.requested_bytes, requested)
    gm_add(p.stats.active_blocks, 1)
    gm_add(p.stats.num_allocs, 1)
    in_use = p.stats.in_use_bytes.load(memory_order_relaxed)
    gm_max(p.stats.peak_in_use_bytes, in_use)
    return 0


# ---------------------------------------------------------------------------------------------
# allocation and free with the pool lock held
cdef size_t gm_round(const gm_pool* p, size_t nbytes) noexcept nogil:
    return _round_size(p, nbytes)

cdef inline int _alloc_locked(gm_pool* p, size_t nbytes, uint64_t stream,
                              gm_block** out) noexcept nogil:
    cdef size_t s = gm_round(p, nbytes)
    cdef int k, hi
    cdef gm_block* b
    k = _slot(p, stream)
    if k < 0:
        return GM_UNKNOWN_STREAM
    hi = 2 * k + (0 if s <= p.cfg.small_size else 1)
    b = _take_fit(p, p.heaps[hi], s)
    if b == NULL:
        return GM_MISS
    if _carve(p, b, s, nbytes, stream, hi) < 0:
        _heap_insert(p.heaps[hi], b, hi)
        return GM_MISS
    gm_add(p.stats.hits, 1)
    out[0] = b
    return GM_OK

cdef inline int _free_locked(gm_pool* p, gm_block* b, uint64_t serial) noexcept nogil:
    cdef int k, hi
    if serial == 0 or b.serial != serial or b.heap_index != -1:
        return GM_BAD_BLOCK
    k = _slot(p, b.stream)
    hi = 2 * k + (0 if b.segment.is_small else 1)
    gm_sub(p.stats.in_use_bytes, b.size)
    gm_sub(p.stats.requested_bytes, b.requested)
    gm_sub(p.stats.active_blocks, 1)
    gm_add(p.stats.num_frees, 1)
    _record(&p.history, 1, serial, b.requested, b.stream)
    b.serial = 0
    b.requested = 0
    b.segment.live_blocks -= 1
    _coalesce_insert(p, b, hi)
    return GM_OK

# ---------------------------------------------------------------------------------------------
# front caches (_pool_front.pxd): the pool path after a front-cache miss
cdef inline int _alloc_from_pool(gm_pool* p, gm_shard* sh, size_t nbytes, uint64_t stream,
                                gm_block** out) noexcept nogil:
    """Both locks held, after a front-cache miss: top up the shard's serials (the miss may have
    been for want of them, then the front cache serves after all), else the pool's heaps."""
    cdef gm_block* b
    if sh.serial_next == sh.serial_end:
        _top_up_serials(p, sh)
        b = _front_take(p, sh, gm_round(p, nbytes), nbytes, stream)
        if b != NULL:
            out[0] = b
            return GM_OK
    return _alloc_locked(p, nbytes, stream, out)


# ---------------------------------------------------------------------------------------------
# the public C API
cdef int gm_alloc(gm_pool* p, size_t nbytes, uint64_t stream, gm_block** out) noexcept nogil:
    cdef gm_shard* sh = _my_shard(p)
    cdef gm_block* b
    cdef int rc
    _shard_lock(sh)
    b = _front_take(p, sh, gm_round(p, nbytes), nbytes, stream)
    if b != NULL:
        _shard_unlock(sh)
        out[0] = b
        return GM_OK
    out[0] = NULL
    _lock(p)                          # shard lock kept: it comes first in the lock order
    rc = _alloc_from_pool(p, sh, nbytes, stream, out)
    _unlock(p)
    _shard_unlock(sh)
    return rc

cdef int gm_free(gm_pool* p, gm_block* b, uint64_t serial) noexcept nogil:
    cdef gm_shard* sh
    cdef int rc
    # a live block's serial, stream, size and segment change only when its owner frees it
    if serial == 0 or b.serial != serial or b.heap_index != -1:
        return GM_BAD_BLOCK
    sh = _my_shard(p)
    _shard_lock(sh)
    if _front_put(p, sh, b):
        _shard_unlock(sh)
        return GM_OK
    _shard_unlock(sh)
    _lock(p)
    rc = _free_locked(p, b, serial)
    _unlock(p)
    return rc

cdef int gm_alloc_gil(gm_pool* p, size_t nbytes, uint64_t stream, gm_block** out) noexcept:
    cdef gm_shard* sh = _my_shard(p)
    cdef gm_block* b
    cdef int rc
    if sh.cached_blocks.load(memory_order_relaxed):
        # this thread's front cache has blocks (nogil gm_free calls put them there): use them
        _shard_lock_gil(sh)
        b = _front_take(p, sh, gm_round(p, nbytes), nbytes, stream)
        if b != NULL:
            _shard_unlock(sh)
            out[0] = b
            return GM_OK
        out[0] = NULL
        _lock_gil(p)
        rc = _alloc_from_pool(p, sh, nbytes, stream, out)
        _unlock(p)
        _shard_unlock(sh)
        return rc
    out[0] = NULL
    _lock_gil(p)
    rc = _alloc_locked(p, nbytes, stream, out)
    _unlock(p)
    return rc

cdef int gm_free_gil(gm_pool* p, gm_block* b, uint64_t serial) noexcept:
    cdef int rc
    _lock_gil(p)
    rc = _free_locked(p, b, serial)
    _unlock(p)
    return rc



@cython.final
@cython.final
cdef class _Bounds:
    """An ascending sequence of mapping boundaries (an ``array('Q')``, or any sequence of ints,
    copied into one) seen as a C array (NULL for None) while the pool's lock is held: the view
    is taken and checked before, so nothing Python is touched under the lock."""
    cdef const unsigned long long[::1] view
    cdef const unsigned long long* data
    cdef size_t n

    def __cinit__(self, bounds):
        cdef size_t i
        self.data = NULL
        self.n = 0
        if bounds is None:
            return
        if not isinstance(bounds, array):
            try:
                bounds = array("Q", bounds)
            except (OverflowError, TypeError) as exc:
                raise ValueError(f"bounds must be offsets >= 0, got {bounds!r}") from exc
        self.view = bounds
        self.n = self.view.shape[0]
        if self.n:
            self.data = &self.view[0]
        for i in range(1, self.n):
            if self.data[i] <= self.data[i - 1]:
                raise ValueError(f"bounds must ascend strictly, got {self.data[i]} after "
                                 f"{self.data[i - 1]}")


cdef class CachingPool:
    """Segments and blocks of one device, without the device: the manager feeds it segments.

    Python code uses this class for introspection (segments, invariants, counters) and the
    manager's slow paths; the hot path is gm_alloc/gm_free.
    """

    def __cinit__(self, *, size_t granularity=512, size_t small_size=1 << 20,
                  size_t small_segment=2 << 20, size_t large_segment=20 << 20,
                  size_t large_threshold=10 << 20, size_t large_round=2 << 20,
                  max_split_size=None, size_t large_split_min=1 << 20,
                  size_t oversize_slack=20 << 20, history_events=100_000):
        if granularity == 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a power of two, got {granularity}")
        if small_size > small_segment:
            raise ValueError(f"small_size ({small_size}) must not exceed small_segment "
                             f"({small_segment})")
        if large_round == 0 or large_segment < large_threshold:
            raise ValueError("large_round must be > 0 and large_segment >= large_threshold")
        self._p = <gm_pool*>calloc(1, sizeof(gm_pool))
        if self._p == NULL:
            raise MemoryError("cannot allocate the pool structure")
        self._p.cfg.granularity = granularity
        self._p.cfg.small_size = small_size
        self._p.cfg.small_segment = _round_up(small_segment, granularity)
        self._p.cfg.large_segment = _round_up(large_segment, granularity)
        self._p.cfg.large_threshold = large_threshold
        self._p.cfg.large_round = _round_up(large_round, granularity)
        self._p.cfg.max_split_size = SIZE_MAX if max_split_size is None else <size_t>max_split_size
        self._p.cfg.large_split_min = max(large_split_min, granularity)
        self._p.cfg.oversize_slack = oversize_slack
        self._p.last_slot = -1
        if _register_stream(self._p, 0) < 0:
            raise MemoryError("cannot allocate the default stream's heaps")
        # aligned_alloc wants a multiple of the alignment
        self._p.shards = <gm_shard*>aligned_alloc(
            64, _round_up(sizeof(gm_shard) * GM_NSHARDS, 64))
        if self._p.shards == NULL:
            raise MemoryError("cannot allocate the front caches")
        memset(self._p.shards, 0, sizeof(gm_shard) * GM_NSHARDS)
        self.set_history(history_events)

    def __dealloc__(self):
        if self._p != NULL:
            pool_segments.destroy_pool(self._p)
            self._p = NULL

    # --- sizes ------------------------------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._p.cfg.granularity

    @property
    def small_size(self) -> int:
        return self._p.cfg.small_size

    def round_size(self, size_t nbytes) -> int:
        """The bytes a request of nbytes occupies in the pool."""
        return gm_round(self._p, nbytes)

    cdef size_t segment_size_for(self, size_t rounded) noexcept nogil:
        if rounded <= self._p.cfg.small_size:
            return self._p.cfg.small_segment
        if rounded < self._p.cfg.large_threshold:
            # a whole number of such blocks: same-size requests (the common case) tile the
            # segment with no tail too small for them
            return (self._p.cfg.large_segment // rounded) * rounded
        return _round_up(rounded, self._p.cfg.large_round)

    def segment_size(self, size_t nbytes) -> int:
        """Size of the segment a miss for nbytes asks the backend for."""
        return self.segment_size_for(gm_round(self._p, nbytes))

    # --- streams ------------------------------------------------------------------------------
    def register_stream(self, uint64_t stream) -> None:
        cdef int k
        _lock_gil(self._p)
        k = _register_stream(self._p, stream)
        _unlock(self._p)
        if k < 0:
            raise MemoryError("cannot allocate heaps for a new stream")

    def has_stream(self, uint64_t stream) -> bool:
        cdef int k
        _lock_gil(self._p)
        k = _slot(self._p, stream)
        _unlock(self._p)
        return k >= 0

    def streams_with_free(self, uint64_t stream) -> list:
        """Streams other than `stream` that hold cached free blocks."""
        return pool_segments.streams_with_free(self._p, stream)

    def reclaim_idle(self, idle_streams, uint64_t into) -> int:
        """Re-file every free block of `idle_streams` under stream `into`, merging neighbours.

        The caller has checked with the backend that each of those streams has no pending
        work, so their cached blocks are safe for `into`. Returns the bytes re-filed.
        """
        return pool_segments.reclaim_idle(self._p, idle_streams, into)

    # --- segments ---------------------------------------------------------------------------
    cdef int add_segment_and_alloc(self, uint64_t handle, size_t base, size_t seg_size,
                                   size_t nbytes, uint64_t stream, gm_block** out) except -1:
        """Adopt a fresh segment and carve the request from its start."""
        cdef gm_pool* p = self._p
        cdef size_t s = gm_round(p, nbytes)
        cdef gm_segment* seg
        cdef int hi, failed = 0
        if seg_size < s:
            raise ValueError(f"segment of {seg_size} bytes cannot hold a {s}-byte block")
        _lock_gil(p)
        seg = pool_segments.link_new_segment(p, handle, base, seg_size, s <= p.cfg.small_size,
                                             stream, &hi)
        if seg == NULL:
            failed = 1
        else:
            gm_max(p.stats.peak_reserved_bytes, p.stats.reserved_bytes.load(memory_order_relaxed))
            gm_add(p.stats.segments_created, 1)
            gm_add(p.stats.misses, 1)
            if _carve(p, seg.first, s, nbytes, stream, hi) < 0:
                # undo the adoption: the caller returns the segment to the driver
                _heap_insert(p.heaps[hi], seg.first, hi)
                pool_segments.detach_segment(p, seg, NULL)
                gm_sub(p.stats.segments_created, 1)
                gm_sub(p.stats.segments_released, 1)
                gm_sub(p.stats.misses, 1)
                failed = 2
            else:
                out[0] = seg.first
        _unlock(p)
        if failed == 1:
            raise MemoryError("cannot allocate a segment record")
        if failed == 2:
            raise MemoryError("cannot allocate a block record")
        return 0

    # --- expandable segments (virtual memory: pages mapped and unmapped) ----------------------
    # The manager (gpumem/manager/expandable.py) maps pages, then tells the pool (grow_segment_and_alloc,
    # fill_unmapped); or has the pool mark free pages unmapped (carve_free_pages), then unmaps
    # them. The unmapped state itself is in pool_pages.pyx. A segment's blocks may sit in other
    # streams' heaps (reclaim_idle moves them), so a free block at offset 0 need not be the
    # segment's last: whole_free_bytes follows each change. Callers hold the GIL: _lock_gil.
    cdef int grow_segment_and_alloc(self, uint64_t handle, size_t extra, size_t nbytes,
                                    uint64_t stream, gm_block** out) except -1:
        """Segment `handle` gains `extra` bytes at its end (already mapped by the caller; 0
        when its free tail is already large enough) and the request is carved from that tail. Returns 0, or 1 when nothing changed (unknown
        segment or stream, a tail too small, no block record): the caller unmaps the pages."""
        cdef gm_pool* p = self._p
        cdef size_t s = gm_round(p, nbytes)
        cdef gm_segment* seg
        cdef gm_block* last
        cdef gm_block* tail
        cdef int k, hi
        _lock_gil(p)
        seg = _find_segment(p, handle)
        k = _slot(p, stream)
        if seg == NULL or k < 0 or extra % p.cfg.granularity:
            _unlock(p)
            return 1
        hi = 2 * k + (0 if seg.is_small else 1)
        last = _last_block(seg)
        if last.heap_index == hi:
            if last.size + extra < s:
                _unlock(p)
                return 1
            _heap_remove(p.heaps[hi], last)
            if last.offset == 0:
                gm_sub(p.stats.whole_free_bytes, seg.size)
                gm_add(p.stats.whole_free_bytes, seg.size + extra)   # _carve takes it off
            last.size += extra
            tail = last
        else:
            if extra < s:               # also refuses extra == 0 without a free tail
                _unlock(p)
                return 1
            tail = _new_block(p)
            if tail == NULL:
                _unlock(p)
                return 1
            if last.offset == 0 and last.heap_index >= 0:
                # wholly free, in another stream's heap: no longer once the tail is added
                gm_sub(p.stats.whole_free_bytes, seg.size)
            tail.segment = seg
            tail.offset = seg.size
            tail.size = extra
            tail.stream = stream
            tail.prev = last
            last.next = tail
        seg.size += extra
        gm_add(p.stats.reserved_bytes, extra)
        gm_max(p.stats.peak_reserved_bytes, p.stats.reserved_bytes.load(memory_order_relaxed))
        gm_add(p.stats.misses, 1)
        if _carve(p, tail, s, nbytes, stream, hi) < 0:
            _coalesce_insert(p, tail, hi)   # the pages stay, as a cached free tail
            _unlock(p)
            raise MemoryError("cannot allocate a block record")
        out[0] = tail
        _unlock(p)
        return 0

    def carve_free_pages(self, uint64_t handle, size_t page, size_t max_bytes=SIZE_MAX, *,
                         stream=None, keep=(0, 0), size_t min_offset=0,
                         double ratio=-1, bounds=None, bint overshoot=False) -> list:
        """Mark up to ``max_bytes`` of whole mappings inside free blocks of segment ``handle``
        unmapped (only blocks cached for ``stream`` if given, else any stream's: the caller
        synchronized the device); not from blocks overlapping ``keep`` = (lo, hi), nor below
        ``min_offset``; ``ratio`` (-1: any block) limits which blocks give pages; ``bounds``:
        the ascending offsets where the segment's mappings (physical handles, mapped and
        unmapped whole) start and end, None when each page is one; ``overshoot``: the last
        mapping may pass ``max_bytes`` (see pool_pages.carve_free_pages). Returns
        ``[(offset, size), ...]``: the caller unmaps them (or fills them back with
        :meth:`fill_unmapped`)."""
        cdef size_t lo = keep[0], hi = keep[1]
        cdef _Bounds bd = _Bounds(bounds)
        return pool_pages.carve_free_pages(self._p, handle, page, bd.data, bd.n, max_bytes,
                                           stream is None,
                                           0 if stream is None else <uint64_t>stream, lo, hi,
                                           min_offset, ratio, overshoot)

    def fill_unmapped(self, uint64_t handle, size_t offset, size_t size,
                      uint64_t stream) -> bool:
        """[offset, offset + size) of segment ``handle``, unmapped (or just past its end) until
        the caller mapped it, becomes a free block cached for ``stream``, merged with its free
        neighbours. False when nothing changed (not an unmapped range, unknown stream)."""
        return pool_pages.fill_unmapped(self._p, handle, offset, size, stream) == 0

    def plan_fill(self, uint64_t handle, uint64_t stream, size_t nbytes, size_t page,
                  size_t reservation) -> tuple | None:
        """``(offset, bytes to map, keep_lo, keep_hi, at_end)``: where mapping the fewest pages
        into segment ``handle`` gives ``stream`` a block for ``nbytes`` (a hole between free
        neighbours, or the end, the span staying within ``reservation``); None if nowhere."""
        return pool_pages.plan_fill(self._p, handle, stream, nbytes, page, reservation)

    def detach_if_unused(self, uint64_t handle) -> bool:
        """Detach segment ``handle`` when it holds no live block (only free and unmapped ones);
        the caller returns it to the driver. Whether it did."""
        cdef gm_pool* p = self._p
        cdef gm_segment* seg
        cdef bint done = False
        _lock_gil(p)
        seg = _find_segment(p, handle)
        if seg != NULL and seg.live_blocks == 0:
            pool_segments.detach_segment(p, seg, NULL)
            done = True
        _unlock(p)
        return done

    def free_page_bytes(self, uint64_t handle, size_t page, bounds=None) -> int:
        """Bytes of whole mappings (``bounds`` as in :meth:`carve_free_pages`) inside segment
        ``handle``'s free blocks (a trim's worth)."""
        cdef _Bounds bd = _Bounds(bounds)
        return pool_pages.free_page_bytes(self._p, handle, page, bd.data, bd.n)

    def release_free_segments(self, size_t max_bytes=SIZE_MAX, int small=-1) -> list:
        """Detach wholly free segments, largest first, until max_bytes have been released;
        only those of the small pool (small=1) or of the large pool (small=0) if asked.

        Returns ``[(handle, base, size, is_small, stream), ...]``; the caller returns each to the
        backend, or hands it back with :meth:`restore_segment` if the backend refuses.
        """
        return pool_segments.release_free_segments(self._p, max_bytes, small)

    def excess_free_segments(self, size_t per_class) -> list:
        """Detach wholly free large-pool segments beyond `per_class` of one size class (the
        newest of each class are kept). Same return value as release_free_segments."""
        return pool_segments.excess_free_segments(self._p, per_class)

    def flush_front_caches(self) -> int:
        """Return the blocks of every thread's front cache to the pool (merging them with
        their neighbours); the bytes returned. release_free_segments does this first."""
        return pool_segments.flush_front_caches(self._p)

    def restore_segment(self, uint64_t handle, size_t base, size_t size, bint is_small,
                        uint64_t stream) -> None:
        """Put back a segment detached by release_free_segments (the backend kept it)."""
        pool_segments.restore_segment(self._p, handle, base, size, is_small, stream)

    def live_segment_handles(self) -> list:
        """Handles of every segment (for close(): all are returned to the backend)."""
        return pool_segments.live_segment_handles(self._p)

    # --- statistics ---------------------------------------------------------------------------
    def counters(self, bint consistent=False):          # a PoolCounters: a dict subclass
        """Every counter, as the user sees them (blocks in front caches are cached, not in use;
        ``peak_in_use_bytes`` counts them as in use, so it may exceed the true peak by at most
        what the front caches hold). By default read without the locks (each value exact
        unless a block moves between a front cache and the pool meanwhile, the set not one
        moment); with consistent=True copied under the locks, one moment, together with
        ``largest_free_block``. Keys: gpumem.stats' vocabulary (``reserved_bytes``,
        ``in_use_bytes``, ``cached_bytes``, ``pool_hits``...; docs/statistics.md); the old
        ``hits``/``misses`` still read, with a DeprecationWarning."""
        return pool_inspect.counters(self._p, consistent)


    @property
    def whole_free_bytes(self) -> int:
        """Bytes in segments that are entirely one free block: releasable without a search."""
        return self._p.stats.whole_free_bytes.load()

    @property
    def reserved_bytes(self) -> int:
        return self._p.stats.reserved_bytes.load()

    @property
    def in_use_bytes(self) -> int:
        """Bytes in live blocks (not counting blocks kept in front caches)."""
        return pool_inspect.in_use_bytes(self._p)

    @property
    def peak_reserved_bytes(self) -> int:
        return self._p.stats.peak_reserved_bytes.load()

    # --- fork (gpumem.placement.peers runs these from os.register_at_fork) --------------------------------
    def _hold_for_fork(self) -> None:
        """Take every lock of the pool (its front caches', then its own) just before fork(),
        so that no other thread is halfway through an update in the child's copy, and the
        child never inherits a lock whose holder does not exist there. Waits with the GIL
        released; a holder never needs the GIL, so the wait is short."""
        _lock_all_gil(self._p)

    def _release_after_fork(self) -> None:
        """Undo _hold_for_fork, in the parent and in the child."""
        _unlock_all(self._p)

    def reset_peaks(self) -> None:
        _lock_gil(self._p)
        self._p.stats.peak_in_use_bytes.store(self._p.stats.in_use_bytes.load())
        self._p.stats.peak_reserved_bytes.store(self._p.stats.reserved_bytes.load())
        _unlock(self._p)

    def largest_free_block(self) -> int:
        """Size of the biggest cached free block (0 if none); shows fragmentation."""
        return pool_inspect.largest_free_block(self._p)

    # --- history ------------------------------------------------------------------------------
    def set_history(self, events) -> None:
        """Keep the newest `events` alloc/free events (at least; rounded up to a power of two)
        in C rings; 0 turns recording off. Forgets what was recorded."""
        pool_history.set_history(self._p, events)

    @property
    def history_capacity(self) -> int:
        """Events kept per ring (0: history off)."""
        return self._p.history_capacity.load()

    def history(self, last=None) -> dict:
        """The recorded events, oldest first, as numpy arrays ``t_ns`` (CLOCK_MONOTONIC
        nanoseconds, as ``time.monotonic_ns()``, to the history clock's ~1 ms tick), ``op`` (0 alloc, 1 free), ``id``, ``size`` (bytes requested), ``stream``;
        only the newest `last` if given. Events of different threads are ordered by time, each
        free after its allocation."""
        return pool_history.history(self._p, last)

    @staticmethod
    def history_clock_ticking() -> bool:
        """Whether the history clock's ticker thread runs (process-wide; _pool_clock.pxd): it
        starts with the first event and stops after about 2 s without one."""
        return gm_clock_ticking() != 0

    @staticmethod
    def history_clock_ns() -> int:
        """The history clock's last reading (CLOCK_MONOTONIC ns, as ``time.monotonic_ns()``):
        the time the next event records. 0 while no ticker runs (events then read the clock
        themselves)."""
        return gm_clock_value()

    # --- introspection ------------------------------------------------------------------------
    def segments(self) -> list:
        """Every segment with its blocks in address order, as plain dicts (for snapshots). A
        block kept in a front cache is "free" (cached), though not merged with its neighbours."""
        return pool_inspect.segments(self._p)

    def check_invariants(self) -> None:
        """Raise AssertionError unless: blocks tile each segment exactly; no two adjacent free
        blocks of the same heap are left unmerged; every free block is in the list of its class
        and every list holds only free blocks; the bitmaps match the lists; and every counter
        equals a recount. The walk records findings as C records under the lock; the messages
        are written after unlocking."""
        pool_inspect.check_invariants(self._p)
