"""The miss path of a MemoryManager: what runs when the cache cannot serve a request.

The OOM ladder: the cache, then blocks of idle streams, then a new segment within the limits
(giving idle cached segments back first when growth would set a new high-water mark), then
waiting for deferred frees, then releasing the cache and retrying, then the other managers on
the device, then the OOM callbacks, then CPU fallback, then an OutOfMemoryError that says why.
Segment release (``empty_cache``, ``shrink``, the cache cap, pressure) lives here too, since it
is the ladder's own step.

Mixed into :class:`gpumem.MemoryManager`; the ladder runs under the manager's ``_slow`` lock
(docs/concurrency.md).
"""
from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from gpumem.placement import peers
from gpumem.config import MemoryConfig
from gpumem.errors import (ClosedManagerError, CpuFallbackWarning, DriverError,
                           DriverOutOfMemory, OutOfMemoryError)
from gpumem.manager.fallback import FallbackBuffer
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem._core.buffer import Buffer

__all__ = ["MissPath", "FRAGMENTATION_WARNING"]

log = logging.getLogger("gpumem")

#: a miss that needs a new segment warns when the cache holds enough free bytes for the request
#: but more than this share of them (1 - largest free block / cached) lies in smaller pieces
FRAGMENTATION_WARNING = 0.30


class MissPath:
    """The miss half of MemoryManager (see the module docstring)."""

    def _malloc_slow(self, nbytes: int, stream: int, tag: Any,
                     fallback: bool = True) -> Buffer | FallbackBuffer:
        buf = self._malloc_device(nbytes, stream, tag)
        if buf is not None:
            return buf
        if fallback and self.config.cpu_fallback_enabled and nbytes <= self.total_memory:
            return self._fallback(nbytes, stream, tag)
        raise self._oom_error(nbytes, fallback_refused=not fallback)

    def _malloc_device_only(self, nbytes: int, stream: int, tag: Any) -> Buffer:
        """Like malloc but never falls back to the CPU (used by migrate_to_device)."""
        if self._closed:
            raise ClosedManagerError(f"the manager for {self.device_string} is closed")
        cached = self.pool.has_stream(stream) and not self._is_dead_stream(stream)
        buf = self._alloc_cached(nbytes, stream, tag) if cached else None
        if buf is None:
            buf = self._malloc_device(nbytes, stream, tag)
        if buf is None:
            raise self._oom_error(nbytes)
        return buf

    def _malloc_device(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """Ladder: cache -> idle streams' cache -> new segment -> release cache and retry ->
        other managers on this device release their caches, retry -> OOM callbacks and retry.
        None when all fail."""
        with self._slow:
            if self._closed:
                raise ClosedManagerError(f"the manager for {self.device_string} is closed")
            self._ensure_stream(stream)
            if nbytes > self.usable_memory:
                return None                       # can never fit: no driver call, cache kept
            buf = self._alloc_cached(nbytes, stream, tag)
            if buf is None:
                buf = self._from_idle_streams(nbytes, stream, tag)
            if buf is None:
                buf = self._grow(nbytes, stream, tag)
            if buf is None and self.collect_pending_frees(wait=True):
                # blocks freed after use on other streams: wait for those streams, then retry
                buf = self._alloc_cached(nbytes, stream, tag) or self._grow(nbytes, stream, tag)
            if buf is None and self._release_cached(reason="retry after a failed growth"):
                buf = self._grow(nbytes, stream, tag)
            if buf is None and peers.release_peer_caches(self):
                buf = self._grow(nbytes, stream, tag)
            if buf is None and self._oom_callbacks:
                for callback in list(self._oom_callbacks):
                    callback(self, nbytes)
                buf = self._alloc_cached(nbytes, stream, tag)
                if buf is None:
                    self._release_cached(reason="after OOM callbacks")
                    buf = self._grow(nbytes, stream, tag)
            return buf

    def _grow(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """A new segment from the driver, within usable_memory and min_free_bytes."""
        self._check_fragmentation(nbytes)
        rounded = self.pool.round_size(nbytes)
        if self._expandable is not None and rounded > self.pool.small_size:
            buf = self._expandable.grow(nbytes, stream, tag)
            if buf is not None:
                self._update_pressure()
            return buf
        seg = self._new_segment((self.pool.segment_size(nbytes), rounded),
                                small=rounded <= self.pool.small_size)
        if seg is None:
            return None
        handle, base, seg_size = seg
        try:
            buf = self._alloc_in_new_segment(handle, base, seg_size, nbytes, stream, tag)
        except BaseException:
            self.device.free_segment(handle)      # the pool did not adopt it
            raise
        self._update_pressure()
        return buf

    def _new_segment(self, sizes: Sequence[int],
                     small: bool | None = None) -> tuple[int, int, int] | None:
        """``(handle, base, size)`` of a raw segment of the first of `sizes` (largest first:
        the preferred size, then fall-backs) that the limits allow and the driver grants; None
        if none. Idle cached segments are given back first as the config asks. `small` says
        which pool the segment is for (None: unknown)."""
        preferred = sizes[0]
        past_mark = self.pool.reserved_bytes + preferred > self.pool.peak_reserved_bytes
        if not small:
            # max_pooled_per_bucket caps idle *large* segments: enforced when the large pool
            # grows, not on every small-pool growth (one small segment would otherwise release
            # every surplus large one, which the next pass of the workload allocates again)
            self._release_excess_per_bucket()
        if (self.config.release_before_grow and past_mark
                and self.pool.whole_free_bytes >= preferred):
            # growth would set a new high-water mark while idle segments could offset it:
            # give back as much as we are about to take (largest first). Below the mark the
            # cache is kept, so a warm steady state does not churn the driver. A large-pool
            # growth never takes the small pool's idle segments: they cannot hold its request,
            # and the small pool would only have to grow them back on its next busy phase.
            self._release_cached(preferred, reason="release before grow",
                                 small=False if small is False else None)
        if (self.config.release_before_grow and past_mark and small
                and self._expandable is not None and self._expandable.trimmable() >= preferred):
            # the small pool cannot use the large pool's free pages, but they can go back
            # to the device first: the high-water mark stays where it is
            self._expandable.trim(preferred)
        reserved = self.pool.reserved_bytes
        free, _ = self.device.mem_get_info()
        for size in dict.fromkeys(sizes):
            if not self._segment_allowed(size, reserved, free):
                continue
            try:
                handle, base = self.device.alloc_segment(size)
            except DriverOutOfMemory as exc:
                log.debug("driver refused a %s segment on %s: %s", format_bytes(size),
                          self.device_string, exc)
                return None
            log.debug("new %s segment on %s (reserved now %s)", format_bytes(size),
                      self.device_string, format_bytes(reserved + size))
            return handle, base, size
        return None

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
                    self.device_string, 100 * frag, format_bytes(pooled),
                    format_bytes(largest), format_bytes(nbytes),
                    "MemoryConfig(expandable_segments=True)"
                    if self._expandable is None and self.device.supports_virtual_memory
                    else "MemoryConfig.max_split_size or empty_cache()")
        elif frag < FRAGMENTATION_WARNING / 2:
            self._frag_warned = False

    def _segment_allowed(self, seg_size: int, reserved: int, free: int) -> bool:
        return (reserved + seg_size <= self.usable_memory
                and free - seg_size >= self.config.min_free_bytes)

    def _release_segments(self, segments: Sequence[tuple]) -> int:
        """Return detached segments to the driver; a refused one goes back into the pool."""
        released = 0
        for handle, base, size, is_small, stream in segments:
            if self._expandable is not None and self._expandable.owns(handle):
                released += self._expandable.release(handle)
                continue
            try:
                self.device.free_segment(handle)
                released += size
            except DriverError as exc:
                self.pool.restore_segment(handle, base, size, is_small, stream)
                warnings.warn(f"gpumem: {self.device_string} refused to free a segment "
                              f"({exc}); it stays cached", RuntimeWarning)
        if released:
            log.debug("released %s of cached segments on %s", format_bytes(released),
                      self.device_string)
        return released

    def _release_cached(self, max_bytes: int | None = None, *, reason: str = "",
                        small: bool | None = None) -> int:
        """Release wholly free segments, largest first (only those of one pool if `small` is
        given); the bytes released."""
        with self._slow:
            if (self.pool.reserved_bytes == self.pool.in_use_bytes
                    and (self._expandable is None or not (self._expandable.holds_empty()
                                                          or self._expandable.held_pages))):
                return 0
            kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
            if small is not None:
                kwargs["small"] = int(small)
            detached = self.pool.release_free_segments(**kwargs)
            released = 0
            if detached:
                self.device.synchronize()         # no pending work may touch what we free
                released = self._release_segments(detached)
            if self._expandable is not None and small is not True:
                # free tails of expandable segments go back page by page
                left = None if max_bytes is None else max(0, max_bytes - released)
                if left != 0:
                    released += self._expandable.trim(left)
            if released:
                log.debug("%s: released %s (%s)", self.device_string, format_bytes(released),
                          reason)
                self._update_pressure()
            return released

    def _release_excess_per_bucket(self) -> None:
        excess = self.pool.excess_free_segments(self.config.max_pooled_per_bucket)
        if excess:
            self.device.synchronize()
            self._release_segments(excess)

    def _trim_cache(self) -> None:
        """Called by free() when cached bytes exceed max_pool_size."""
        limit = self._max_pool_size
        if limit is None:
            return
        pooled = self.pool.reserved_bytes - self.pool.in_use_bytes
        # whole_free_bytes is a C counter: no search (and no synchronize) on each free when
        # the cached bytes sit in partly used segments and nothing can be released
        if pooled > limit and (self.pool.whole_free_bytes or (
                self._expandable is not None and self._expandable.trimmable())):
            self._release_cached(pooled - limit, reason="max_pool_size")

    # --- OOM ------------------------------------------------------------------------------------
    def _oom_error(self, nbytes: int, fallback_refused: bool = False) -> OutOfMemoryError:
        self._num_ooms += 1
        try:
            free, total = self.device.mem_get_info()
        except DriverError:
            free, total = None, self.total_memory
        reserved = self.pool.reserved_bytes
        in_use = self.pool.in_use_bytes
        if nbytes > self.total_memory:
            reason = "the request exceeds the device's total memory"
        elif nbytes > self.usable_memory:
            reason = "the request exceeds usable memory (gpu_memory_fraction / reserve)"
        else:
            reason = "device, cache and callbacks exhausted"
            if not self.config.cpu_fallback_enabled:
                reason += "; CPU fallback is disabled"
            elif fallback_refused:
                reason += "; CPU fallback refused by malloc(fallback=False)"
        cached = reserved - in_use
        largest = self.pool.largest_free_block()
        fits = nbytes <= self.usable_memory      # else how the cache looks is beside the point
        if cached and fits:
            reason += (f"; {1 - largest / cached:.0%} of the cache is fragmented (outside the "
                       f"largest free block)")
        if self.device.supports_virtual_memory and fits:
            on = self._expandable is not None
            reason += f"; expandable segments {'on' if on else 'off'}"
            # fragmentation is the cause when the bytes exist but not in one piece: in the
            # cache, or on the device (whose free memory is not one contiguous range)
            fragmented = cached >= nbytes > largest or (free is not None and free >= nbytes)
            if not on and fragmented:
                reason += (" (enough bytes are free but not in one piece: "
                           "MemoryConfig(expandable_segments=True) lets segments grow in place)")
        err = OutOfMemoryError(nbytes, device=self.device_string, free=free, total=total,
                               in_use=in_use, cached=cached, limit=self.usable_memory,
                               largest_free_block=largest, reason=reason)
        log.warning("%s", err)
        from gpumem.observe.history import on_oom
        on_oom(self, err)                     # err.history; the dump of GPUMEM_DUMP_ON_OOM
        return err

    def _fallback(self, nbytes: int, stream: int, tag: Any) -> FallbackBuffer:
        with self._slow:
            if self._host is None:
                self._host = type(self)(             # a MemoryManager on host memory
                    "cpu", MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0,
                                        track_allocations=False, gpu_memory_fraction=1.0))
                self._keep_buffer_state()           # the tracker wants its tags too
            host = self._host
            if not self._fallback_warned:
                # before the host allocation: a filter that turns this warning into an error
                # then leaves nothing allocated. stacklevel 3: the caller of malloc (Cython
                # frames do not count)
                warnings.warn(
                    f"gpumem: {self.device_string} is exhausted; {format_bytes(nbytes)} served "
                    f"from CPU memory (a FallbackBuffer). Later fallbacks are only logged. "
                    f"Refuse it with malloc(..., fallback=False) or "
                    f"MemoryConfig(cpu_fallback_enabled=False).",
                    CpuFallbackWarning, stacklevel=3)
                self._fallback_warned = True
        fb = FallbackBuffer(self, host._malloc_device_only(nbytes, 0, tag), stream, tag)
        self._cpu_fallbacks += 1
        self._fallback_bytes += nbytes
        self._fallback_live += 1
        log.warning("%s: device exhausted, %s served from CPU memory (fallback #%d)",
                    self.device_string, format_bytes(nbytes), self._cpu_fallbacks)
        if self._hooks:
            self._on_alloc(fb)
        if self._recorders:
            self._note_fallback(fb, "a")
        return fb

    def _fallback_released(self, fb: FallbackBuffer) -> None:
        self._fallback_bytes -= fb.nbytes
        self._fallback_live -= 1
        if self._hooks and not self._closed:
            self._on_free(fb)
        if self._recorders and not self._closed:
            self._note_fallback(fb, "f")
