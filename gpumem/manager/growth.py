"""Segment growth: where a manager's pool gets memory from, and how it gives it back.

:class:`SegmentGrowth` is the one object behind which the pool grows and shrinks: plain
segments from the driver (within the hard limits; past the soft ones idle cached memory is
given back first: :mod:`gpumem.manager.limits`), expandable segments (their pages mapped, moved and
trimmed: :mod:`gpumem.manager.expandable`), the segments a batch carves many requests from
(:mod:`gpumem.manager.batch`), and every release of cached memory (``empty_cache``, ``shrink``,
the cache cap, pressure responses, the OOM ladder, ``close``). The miss path
(:mod:`gpumem.manager.miss_path`) calls :meth:`SegmentGrowth.grow`; batches and expandable
segments call the calls of :class:`Growth`, its declared interface, and nothing else of the
manager.

Buffers come from the manager's Cython core through a
:class:`~gpumem._core.manager_core.CoreAccess`, which holds the manager weakly: this object never
keeps its manager alive.

Thread safety: every method that changes the pool's segments runs under ``lock`` (the
manager's slow-path RLock, docs/concurrency.md); the pool's own C lock guards its structures.
"""
from __future__ import annotations

import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from gpumem.errors import DriverError, DriverOutOfMemory
from gpumem.manager.expandable import ExpandableSegments
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem._core.buffer import Buffer
    from gpumem._core.manager_core import CoreAccess
    from gpumem._core.pool import CachingPool
    from gpumem.backends.base import Device
    from gpumem.config import MemoryConfig
    from gpumem.manager.pressure import PressureWatch
    from gpumem.manager.stream_book import StreamBook
    from gpumem.placement.shared_budget import SharedBudget

__all__ = ["Growth", "SegmentGrowth", "FRAGMENTATION_WARNING"]

log = logging.getLogger("gpumem")

#: a miss that needs a new segment warns when the cache holds enough free bytes for the request
#: but more than this share of them (1 - largest free block / cached) lies in smaller pieces
FRAGMENTATION_WARNING = 0.30


class Growth(Protocol):
    """What batches and expandable segments may call to place requests in new memory."""

    lock: threading.RLock          # held while the pool's segments change
    pool: CachingPool
    device: Device
    config: MemoryConfig
    usable_memory: int             # the soft limit: the cache is trimmed past it (pressure scale)
    hold: int                      # the most bytes the pool may hold: a hard limit, else the total
    streams: StreamBook            # the streams the pool serves (which are dead)
    expandable: ExpandableSegments | None

    def alloc_cached(self, nbytes: int, stream: int, tag: Any) -> Buffer | None: ...
    def alloc_from_idle_streams(self, nbytes: int, stream: int, tag: Any) -> Buffer | None: ...
    def new_segment(self, sizes: Sequence[int],
                    small: bool | None = None) -> tuple[int, int, int] | None: ...
    def alloc_in_new_segment(self, handle: int, base: int, seg_size: int, nbytes: int,
                             stream: int, tag: Any) -> Buffer: ...
    def alloc_in_grown_segment(self, handle: int, extra: int, nbytes: int, stream: int,
                               tag: Any) -> Buffer | None: ...
    def device_bytes(self) -> int: ...
    def segment_allowed(self, seg_size: int, reserved: int, free: int, *,
                        ask_others: bool = True) -> bool: ...
    def release_cached(self, max_bytes: int | None = None, *, reason: str = "",
                       small: bool | None = None) -> int: ...
    def release_segments(self, segments: Sequence[tuple]) -> int: ...
    def reserved_changed(self) -> None: ...


class SegmentGrowth:
    """The segments of one manager's pool (see the module docstring); implements
    :class:`Growth`."""

    def __init__(self, core: CoreAccess, pool: CachingPool, device: Device,
                 config: MemoryConfig, usable_memory: int, lock: threading.RLock,
                 streams: StreamBook, pressure: PressureWatch, *, expandable: bool) -> None:
        self._core = core
        self.pool = pool
        self.device = device
        self.config = config
        self.usable_memory = usable_memory
        self.hold = usable_memory                 # set_limits() says what is hard
        self.min_free_hard = 0
        # the device's free memory as last read with what the pool held then: a growth far
        # from the soft min_free_bytes needs no extra driver call to know it
        self._seen_free = 0
        self._seen_reserved = 0
        self.lock = lock
        self.streams = streams
        self.pressure = pressure
        self.max_pool_size: int | None = config.max_pool_size   # the cache cap (trim_cache)
        self._frag_warned = False
        #: the shared group this manager joined (gpumem.placement.shared_budget), or None
        self.shared: SharedBudget | None = None
        self.expandable: ExpandableSegments | None = (ExpandableSegments(self) if expandable
                                                      else None)

    def set_limits(self, usable: int, hold: int, min_free_hard: int) -> None:
        """The soft scale (``usable``), the hard cap on held bytes (``hold``: a user's limit,
        else the device's total) and the hard free margin (0 when min_free_bytes is soft)."""
        self.usable_memory = usable
        self.hold = hold
        self.min_free_hard = min_free_hard

    # --- Buffers from the pool (through the core) --------------------------------------------
    def alloc_cached(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """A retry of the cache only; None on a miss."""
        return self._core.alloc_cached(nbytes, stream, tag)

    def alloc_from_idle_streams(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """Blocks cached by streams whose work has finished join ``stream``'s heaps, then the
        cache is tried again; None when that does not serve the request."""
        if not self.streams.reclaim_idle(stream):
            return None
        return self.alloc_cached(nbytes, stream, tag)

    def alloc_in_new_segment(self, handle: int, base: int, seg_size: int, nbytes: int,
                             stream: int, tag: Any) -> Buffer:
        """The pool adopts a new segment and serves the request from it; MemoryError when the
        pool could not record it (not adopted: the caller still owns the segment)."""
        return self._core.alloc_in_new_segment(handle, base, seg_size, nbytes, stream, tag)

    def alloc_in_grown_segment(self, handle: int, extra: int, nbytes: int, stream: int,
                               tag: Any) -> Buffer | None:
        """The request from segment ``handle`` grown by ``extra`` mapped bytes; None when the
        pool did not take them (nothing changed)."""
        return self._core.alloc_in_grown_segment(handle, extra, nbytes, stream, tag)

    def reserved_changed(self) -> None:
        """The bytes held from the device changed: the pressure level may have too, and the
        shared group's ledger is told."""
        self.pressure.update(self)
        if self.shared is not None:
            self.shared.sync()

    # --- growth ----------------------------------------------------------------------------------
    def grow(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """A new segment (or expandable pages) for a miss, within the hard limits, cached
        memory given back first past the soft ones; None when a hard limit or the driver
        refuses. Runs under ``lock``."""
        self._check_fragmentation(nbytes)
        rounded = self.pool.round_size(nbytes)
        self._keep_soft_limits(rounded)
        if self.expandable is not None and rounded > self.pool.small_size:
            buf = self.expandable.grow(nbytes, stream, tag)
            if buf is not None:
                self.reserved_changed()
            return buf
        seg = self.new_segment((self.pool.segment_size(nbytes), rounded),
                               small=rounded <= self.pool.small_size)
        if seg is None:
            return None
        handle, base, seg_size = seg
        try:
            buf = self.alloc_in_new_segment(handle, base, seg_size, nbytes, stream, tag)
        except BaseException:
            self.device.free_segment(handle)      # the pool did not adopt it
            raise
        self.reserved_changed()
        return buf

    def new_segment(self, sizes: Sequence[int],
                    small: bool | None = None) -> tuple[int, int, int] | None:
        """``(handle, base, size)`` of a raw segment of the first of `sizes` (largest first:
        the preferred size, then fall-backs) that the limits allow and the driver grants; None
        if none. Idle cached segments are given back first as the config asks. `small` says
        which pool the segment is for (None: unknown)."""
        preferred = sizes[0]
        pool = self.pool
        past_mark = pool.reserved_bytes + preferred > pool.peak_reserved_bytes
        if not small:
            # max_pooled_per_bucket caps idle *large* segments: enforced when the large pool
            # grows, not on every small-pool growth (one small segment would otherwise release
            # every surplus large one, which the next pass of the workload allocates again)
            self._release_excess_per_bucket()
        if (self.config.release_before_grow and past_mark
                and pool.whole_free_bytes >= preferred):
            # growth would set a new high-water mark while idle segments could offset it:
            # give back as much as we are about to take (largest first). Below the mark the
            # cache is kept, so a warm steady state does not churn the driver. A large-pool
            # growth never takes the small pool's idle segments: they cannot hold its request,
            # and the small pool would only have to grow them back on its next busy phase.
            self.release_cached(preferred, reason="release before grow",
                                small=False if small is False else None)
        if (self.config.release_before_grow and past_mark and small
                and self.expandable is not None and self.expandable.trimmable() >= preferred):
            # the small pool cannot use the large pool's free pages, but they can go back
            # to the device first: the high-water mark stays where it is
            self.expandable.trim(preferred)
        reserved = self.device_bytes()
        free, _ = self.device.mem_get_info()
        for size in dict.fromkeys(sizes):
            if not self.segment_allowed(size, reserved, free):
                continue
            try:
                handle, base = self.device.alloc_segment(size)
            except DriverOutOfMemory as exc:
                log.debug("driver refused a %s segment on %s: %s", format_bytes(size),
                          self.device.device_string, exc)
                return None
            log.debug("new %s segment on %s (reserved now %s)", format_bytes(size),
                      self.device.device_string, format_bytes(reserved + size))
            return handle, base, size
        return None

    def device_bytes(self) -> int:
        """The bytes this manager takes from the device now: the pool's ``reserved_bytes``
        plus the pages it does not count (``ExpandableSegments.held_bytes``: pages a growth is
        moving between segments, handles the driver refused to free). Every limit check adds
        the bytes a step takes to this figure (``segment_allowed``'s ``reserved``), so it sees
        what the manager holds after the step, page moves included."""
        expandable = self.expandable
        return self.pool.reserved_bytes + (expandable.held_bytes if expandable is not None
                                           else 0)

    def segment_allowed(self, seg_size: int, reserved: int, free: int, *,
                        ask_others: bool = True) -> bool:
        """Whether ``seg_size`` more bytes may come from the device (``reserved`` held now:
        :meth:`device_bytes`, never the pool's count alone; ``free`` on the device): within
        the hard limits (``hold``, a hard min_free_bytes), no more than the device has free,
        and (in a shared group) within the group's budget, the others asked to hand back
        cached memory first (to keep the soft min_free_bytes too) unless ``ask_others`` is
        False. Without ``ask_others`` (a larger size only worth having
        if it is free now) the soft limits must hold as well."""
        self._seen_free, self._seen_reserved = free, reserved
        if reserved + seg_size > self.hold:
            return False
        margin = self.min_free_hard
        if not ask_others:
            margin = max(margin, self.config.min_free_bytes)
            if reserved + seg_size > self.usable_memory:
                return False
        if self.shared is not None:           # the group's budget; others may hand back cache
            device_free = lambda: self.device.mem_get_info()[0]   # noqa: E731
            soft = self.config.min_free_bytes
            if ask_others and soft > margin and free - seg_size < soft:
                # past the soft margin: the others hand back cache first, then the device
                # decides (they were asked once in this miss: the second call asks nobody)
                if self.shared.allow(seg_size, reserved, free, soft, device_free):
                    return True
                free = device_free()
            return self.shared.allow(seg_size, reserved, free, margin, device_free,
                                     ask=ask_others)
        return free - seg_size >= margin

    def _keep_soft_limits(self, nbytes: int) -> None:
        """Before a growth of ``nbytes``: past the soft limits (usable memory, min_free_bytes
        left free on the device) idle cached memory goes back to the device first, as much as
        the growth overshoots them. The request goes to the driver whatever this frees. Asks
        the driver only when the free memory last seen, less what the pool took since, is
        near min_free_bytes."""
        pool = self.pool
        reserved = self.device_bytes()
        # a hard limit is not trimmed for here: it refuses, and the ladder releases and retries
        over = (reserved + nbytes - self.usable_memory if self.hold > self.usable_memory
                else 0)
        min_free = self.config.min_free_bytes if self.min_free_hard == 0 else 0
        near_margin = (min_free and self._seen_free - max(0, reserved - self._seen_reserved)
                       - nbytes < min_free)
        if over <= 0 and not near_margin:
            return
        if not pool.whole_free_bytes and not (self.expandable is not None
                                              and self.expandable.trimmable()):
            return                                # nothing cached could go back
        if near_margin:                           # the driver's figure
            free = self.device.mem_get_info()[0]
            self._seen_free, self._seen_reserved = free, reserved
            over = max(over, min_free - (free - nbytes))
        if over > 0:
            self.release_cached(over, reason="soft limit: cache trimmed before a growth")

    def _check_fragmentation(self, nbytes: int) -> None:
        """On a miss that needs a new segment: warn when the cache holds enough free bytes for
        the request but no block large enough, with fragmentation (1 - largest free block /
        cached) above FRAGMENTATION_WARNING. WARNING once, DEBUG after; re-armed once it falls
        below half the threshold."""
        reserved = self.pool.reserved_bytes
        pooled = reserved - self.pool.in_use_bytes
        # a cache smaller than two large segments, or a small share of what is held, cannot
        # be meaningfully fragmented: no warning
        if pooled < nbytes or pooled < 2 * self.config.large_segment or pooled * 10 < reserved:
            return
        largest = self.pool.largest_free_block()
        if nbytes <= largest:
            return                                # not fragmentation (size class / stream)
        frag = 1.0 - largest / pooled
        if frag > FRAGMENTATION_WARNING:
            level = logging.DEBUG if self._frag_warned else logging.WARNING
            self._frag_warned = True
            log.log(level, "%s: fragmentation %.0f%%: %s cached but the largest free block is "
                    "%s, so a %s request needs a new segment (%s can help)",
                    self.device.device_string, 100 * frag, format_bytes(pooled),
                    format_bytes(largest), format_bytes(nbytes),
                    "MemoryConfig(segments='auto')"
                    if self.expandable is None and self.device.supports_virtual_memory
                    else "MemoryConfig.max_split_size or empty_cache()")
        elif frag < FRAGMENTATION_WARNING / 2:
            self._frag_warned = False

    # --- giving memory back ----------------------------------------------------------------------
    def release_segments(self, segments: Sequence[tuple]) -> int:
        """Return detached segments to the driver; a refused one goes back into the pool
        (an expandable one is kept for a retry). Exception-safe: whatever a release raises,
        every segment is given back or kept, and an error other than the driver's refusal is
        raised after that."""
        released = 0
        error: BaseException | None = None
        for handle, base, size, is_small, stream in segments:
            try:
                if self.expandable is not None and self.expandable.owns(handle):
                    released += self.expandable.release(handle)   # keeps what it could not
                    continue
                try:
                    self.device.free_segment(handle)
                    released += size
                except BaseException:
                    self.pool.restore_segment(handle, base, size, is_small, stream)
                    raise
            except DriverError as exc:
                warnings.warn(f"gpumem: {self.device.device_string} refused to free a segment "
                              f"({exc}); it stays cached", RuntimeWarning)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            if released:
                self.reserved_changed()
            raise error
        if released:
            log.debug("released %s of cached segments on %s", format_bytes(released),
                      self.device.device_string)
        return released

    def release_cached(self, max_bytes: int | None = None, *, reason: str = "",
                       small: bool | None = None) -> int:
        """Release wholly free segments, largest first (only those of one pool if `small` is
        given), and free pages of expandable segments; the bytes released."""
        with self.lock:
            if self._core.closed:
                # close() gave every segment back (the pool still lists them): a free() or
                # a trim that waited for the lock while close() ran must not free them again
                return 0
            if (self.pool.reserved_bytes == self.pool.in_use_bytes
                    and (self.expandable is None or not (self.expandable.holds_empty()
                                                         or self.expandable.held_pages))):
                return 0
            kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
            if small is not None:
                kwargs["small"] = int(small)
            detached = self.pool.release_free_segments(**kwargs)
            released = 0
            if detached:
                self.device.synchronize()         # no pending work may touch what we free
                released = self.release_segments(detached)
            if self.expandable is not None and small is not True:
                # free tails of expandable segments go back page by page
                left = None if max_bytes is None else max(0, max_bytes - released)
                if left != 0:
                    released += self.expandable.trim(left)
            if released:
                log.debug("%s: released %s (%s)", self.device.device_string,
                          format_bytes(released), reason)
                self.reserved_changed()
            return released

    def _release_excess_per_bucket(self) -> None:
        excess = self.pool.excess_free_segments(self.config.max_pooled_per_bucket)
        if excess:
            self.device.synchronize()
            self.release_segments(excess)

    def trim_cache(self) -> None:
        """Called by free() when cached bytes exceed ``max_pool_size``."""
        limit = self.max_pool_size
        if limit is None:
            return
        pooled = self.pool.reserved_bytes - self.pool.in_use_bytes
        # whole_free_bytes is a C counter: no search (and no synchronize) on each free when
        # the cached bytes sit in partly used segments and nothing can be released
        if pooled > limit and (self.pool.whole_free_bytes or (
                self.expandable is not None and self.expandable.trimmable())):
            self.release_cached(pooled - limit, reason="max_pool_size")

    def return_everything(self) -> None:
        """close(): every segment back to the driver (after the device finished its work)."""
        try:
            self.device.synchronize()
        except Exception as exc:  # close() always goes on to return the segments
            warnings.warn(f"gpumem: synchronize failed while closing: {exc}", RuntimeWarning)
        for handle in self.pool.live_segment_handles():
            try:
                if self.expandable is not None and self.expandable.owns(handle):
                    self.expandable.release(handle)     # keeps what it could not give back
                else:
                    self.device.free_segment(handle)
            except Exception as exc:  # keep returning the others
                warnings.warn(f"gpumem: could not free segment {handle:#x} on close: {exc}",
                              RuntimeWarning)
        if self.expandable is not None:
            try:
                self.expandable.release_held()   # pages the driver refused to free before
            except Exception as exc:  # noqa: BLE001 (close() goes on; they stay held)
                warnings.warn(f"gpumem: could not free held pages on close: {exc}",
                              RuntimeWarning)
            if self.expandable.held_pages:
                warnings.warn(f"gpumem: {self.device.device_string} still refuses to free "
                              f"{self.expandable.held_pages} page handle(s) on close",
                              RuntimeWarning)
