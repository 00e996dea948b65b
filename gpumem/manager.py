"""MemoryManager: one device, one caching pool, and everything around the hot path.

The hot path (a cache hit, a free) is `ManagerCore.malloc/free` in Cython. This module holds
what runs on a miss: the OOM ladder, limits, CPU fallback, pressure responses, and the hooks
tracking and history recording attach to.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from gpumem._core.buffer import Buffer, ManagerCore
from gpumem._core.pool import CachingPool
from gpumem.backends import Device, open_device
from gpumem.config import MemoryConfig
from gpumem.errors import (ClosedManagerError, DriverError, DriverOutOfMemory,
                           ForeignBufferError, InvalidInputError, OutOfMemoryError)
from gpumem.fallback import FallbackBuffer
from gpumem.pressure import MemoryPressure, PressureCallback, pressure_level
from gpumem.stats import MemoryStats
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem.batch import BufferBatch
    from gpumem.history import HistoryRecorder

__all__ = ["MemoryManager", "OomCallback"]

log = logging.getLogger("gpumem")

#: a miss that needs a new segment warns when the cache holds enough free bytes for the request
#: but more than this share of them (1 - largest free block / cached) lies in smaller pieces
FRAGMENTATION_WARNING = 0.30

#: called as ``callback(manager, requested_bytes)`` when a request cannot be served; it may
#: free memory, after which the request is retried once.
OomCallback = Callable[["MemoryManager", int], None]


def _byte_count(value: Any, what: str) -> int:
    """An int >= 0 (numpy integers accepted), else a specific error naming `what`."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidInputError(f"{what} must be an int >= 0, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0:
        raise InvalidInputError(f"{what} must be >= 0, got {value}")
    return value


class MemoryManager(ManagerCore):
    """Allocates device memory through a caching pool.

    >>> mm = MemoryManager("sim:0")
    >>> with mm.malloc(1 << 20, tag="weights") as buf:
    ...     buf.nbytes
    1048576
    """

    def __init__(self, device: str | Device = "sim:0", config: MemoryConfig | None = None) -> None:
        if config is None:
            config = MemoryConfig.from_env()
        elif not isinstance(config, MemoryConfig):
            raise InvalidInputError(
                f"config must be a MemoryConfig (or None), got {type(config).__name__}")
        dev = open_device(device) if isinstance(device, str) else device
        if not isinstance(dev, Device):
            raise InvalidInputError(
                f"device must be a device string such as 'sim:0' or a Device, got {device!r}")
        props = dev.properties()
        free, total = dev.mem_get_info()
        pool = CachingPool(
            granularity=max(config.granularity, props.alignment),
            small_size=config.small_size, small_segment=config.small_segment,
            large_segment=config.large_segment, large_threshold=config.large_threshold,
            large_round=config.large_round, max_split_size=config.max_split_size,
            large_split_min=config.large_split_min, oversize_slack=config.oversize_slack)
        self._core_init(pool, dev, dev.device_string)
        self.config = config
        self.total_memory = total
        reserve = config.reserve_bytes
        if reserve is None:
            reserve = dev.recommended_reserve(total)
        self.usable_memory = max(0, min(int(total * config.gpu_memory_fraction), total - reserve))
        self._max_pool_size = config.max_pool_size
        self._set_limits(self.usable_memory, config.max_pool_size)
        self._slow = threading.RLock()
        self._oom_callbacks: list[OomCallback] = []
        self._pressure_callbacks: list[PressureCallback] = []
        self._pressure = MemoryPressure.LOW
        self._observers: list[Any] = []
        self._num_ooms = 0
        self._cpu_fallbacks = 0
        self._fallback_bytes = 0
        self._fallback_live = 0
        self._host: MemoryManager | None = None
        self._streams: set[int] = {0}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._frag_warned = False
        self.tracker = None
        if config.track_allocations:
            from gpumem.tracking import AllocationTracker
            self.tracker = AllocationTracker(self, capture_stacks=config.track_stacks)
            self.add_observer(self.tracker)

    # --- properties -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, from the driver."""
        return self.device.mem_get_info()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{format_bytes(self.pool.reserved_bytes)} reserved"
        return f"<gpumem.MemoryManager {self.device_string}, {state}>"

    def __enter__(self) -> "MemoryManager":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    # --- observers (tracking, history) ------------------------------------------------------
    def add_observer(self, observer: Any) -> None:
        """Call ``observer.on_alloc(buf)`` / ``observer.on_free(buf)`` for every buffer. With
        no observer the hot path does no extra work."""
        if not (callable(getattr(observer, "on_alloc", None))
                and callable(getattr(observer, "on_free", None))):
            raise InvalidInputError("an observer needs on_alloc(buf) and on_free(buf) methods")
        self._observers.append(observer)
        self._hooks = True

    def remove_observer(self, observer: Any) -> None:
        self._observers.remove(observer)
        self._hooks = bool(self._observers)

    def _on_alloc(self, buf: Buffer) -> None:
        for obs in self._observers:
            obs.on_alloc(buf)

    def _on_free(self, buf: Buffer) -> None:
        for obs in self._observers:
            obs.on_free(buf)

    # --- the miss path: the OOM ladder ------------------------------------------------------
    def _malloc_slow(self, nbytes: int, stream: int, tag: Any) -> Buffer | FallbackBuffer:
        buf = self._malloc_device(nbytes, stream, tag)
        if buf is not None:
            return buf
        if self.config.cpu_fallback_enabled and nbytes <= self.total_memory:
            return self._fallback(nbytes, stream, tag)
        raise self._oom_error(nbytes)

    def _malloc_device_only(self, nbytes: int, stream: int, tag: Any) -> Buffer:
        """Like malloc but never falls back to the CPU (used by migrate_to_device)."""
        if self._closed:
            raise ClosedManagerError(f"the manager for {self.device_string} is closed")
        buf = self._alloc_cached(nbytes, stream, tag) if self.pool.has_stream(stream) else None
        if buf is None:
            buf = self._malloc_device(nbytes, stream, tag)
        if buf is None:
            raise self._oom_error(nbytes)
        return buf

    def _malloc_device(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """Ladder: cache -> idle streams' cache -> new segment -> release cache and retry ->
        OOM callbacks and retry. None when all fail."""
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
            if buf is None and self._oom_callbacks:
                for callback in list(self._oom_callbacks):
                    callback(self, nbytes)
                buf = self._alloc_cached(nbytes, stream, tag)
                if buf is None:
                    self._release_cached(reason="after OOM callbacks")
                    buf = self._grow(nbytes, stream, tag)
            return buf

    def _ensure_stream(self, stream: int) -> None:
        if stream in self._streams:
            return
        try:
            self.device.stream_idle(stream)       # the device validates the handle
        except (DriverError, InvalidInputError) as exc:   # drivers differ in which they raise
            raise InvalidInputError(f"stream {stream} is not a stream of {self.device_string}: "
                                    f"{exc}") from None
        self.pool.register_stream(stream)
        self._streams.add(stream)

    _check_stream = _ensure_stream            # Buffer.record_stream validates through it

    def _from_idle_streams(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """Blocks cached by streams whose work has finished are merged into `stream`'s heaps
        (whole segments reappear, so release_before_grow can see them); then retry the cache."""
        idle = [s for s in self.pool.streams_with_free(stream) if self.device.stream_idle(s)]
        if not idle:
            return None
        self.pool.reclaim_idle(idle, stream)
        return self._alloc_cached(nbytes, stream, tag)

    def _grow(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """A new segment from the driver, within usable_memory and min_free_bytes."""
        self._check_fragmentation(nbytes)
        rounded = self.pool.round_size(nbytes)
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
                    "%s, so a %s request needs a new segment (MemoryConfig.max_split_size or "
                    "empty_cache() can help)", self.device_string, 100 * frag,
                    format_bytes(pooled), format_bytes(largest), format_bytes(nbytes))
        elif frag < FRAGMENTATION_WARNING / 2:
            self._frag_warned = False

    def _segment_allowed(self, seg_size: int, reserved: int, free: int) -> bool:
        return (reserved + seg_size <= self.usable_memory
                and free - seg_size >= self.config.min_free_bytes)

    def _release_segments(self, segments: Sequence[tuple]) -> int:
        """Return detached segments to the driver; a refused one goes back into the pool."""
        released = 0
        for handle, base, size, is_small, stream in segments:
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
            if self.pool.reserved_bytes == self.pool.in_use_bytes:
                return 0
            kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
            if small is not None:
                kwargs["small"] = int(small)
            detached = self.pool.release_free_segments(**kwargs)
            if not detached:
                return 0
            self.device.synchronize()             # no pending work may touch what we free
            released = self._release_segments(detached)
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
        if pooled > limit and self.pool.whole_free_bytes:
            self._release_cached(pooled - limit, reason="max_pool_size")

    # --- OOM ------------------------------------------------------------------------------------
    def _oom_error(self, nbytes: int) -> OutOfMemoryError:
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
        err = OutOfMemoryError(nbytes, device=self.device_string, free=free, total=total,
                               in_use=in_use, cached=reserved - in_use, limit=self.usable_memory,
                               largest_free_block=self.pool.largest_free_block(), reason=reason)
        log.warning("%s", err)
        from gpumem.history import on_oom
        on_oom(self, err)                     # err.history; the dump of GPUMEM_DUMP_ON_OOM
        return err

    def on_oom(self, callback: OomCallback) -> OomCallback:
        """Register ``callback(manager, nbytes)``, run when a request cannot be served; it
        may free buffers, and the request is retried once after all callbacks ran."""
        if not callable(callback):
            raise InvalidInputError("on_oom takes a callable(manager, nbytes)")
        self._oom_callbacks.append(callback)
        return callback

    # --- CPU fallback -----------------------------------------------------------------------------
    def _fallback(self, nbytes: int, stream: int, tag: Any) -> FallbackBuffer:
        with self._slow:
            if self._host is None:
                self._host = MemoryManager(
                    "cpu", MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0,
                                        track_allocations=False, gpu_memory_fraction=1.0))
            host = self._host
        fb = FallbackBuffer(self, host._malloc_device_only(nbytes, 0, tag), stream, tag)
        self._cpu_fallbacks += 1
        self._fallback_bytes += nbytes
        self._fallback_live += 1
        log.warning("%s: device exhausted, %s served from CPU memory (fallback #%d)",
                    self.device_string, format_bytes(nbytes), self._cpu_fallbacks)
        if self._hooks:
            self._on_alloc(fb)
        return fb

    def _fallback_released(self, fb: FallbackBuffer) -> None:
        self._fallback_bytes -= fb.nbytes
        self._fallback_live -= 1
        if self._hooks and not self._closed:
            self._on_free(fb)

    def _free_other(self, buffer: Any) -> None:
        if isinstance(buffer, FallbackBuffer):
            if buffer._manager is not self:
                raise ForeignBufferError(f"fallback buffer {buffer.id} belongs to another manager")
            buffer.free()
            return
        raise TypeError(f"free() takes a gpumem Buffer, got {type(buffer).__name__}")

    # --- cache control ------------------------------------------------------------------------------
    def empty_cache(self) -> int:
        """Return every wholly free cached segment to the driver; the bytes returned."""
        self._check_open()
        self.collect_pending_frees()
        return self._release_cached(reason="empty_cache")

    def shrink(self, target_cached_bytes: int = 0) -> int:
        """Release wholly free segments until at most target bytes stay cached."""
        self._check_open()
        target_cached_bytes = _byte_count(target_cached_bytes, "target_cached_bytes")
        pooled = self.pool.reserved_bytes - self.pool.in_use_bytes
        if pooled <= target_cached_bytes:
            return 0
        return self._release_cached(pooled - target_cached_bytes, reason="shrink")

    def set_max_pool_size(self, nbytes: int | None) -> None:
        """Cap the cached (free) bytes; None removes the cap. Trims at once."""
        if nbytes is not None:
            nbytes = _byte_count(nbytes, "max pool size")
        self._max_pool_size = nbytes
        self._set_limits(self.usable_memory, nbytes)
        self._trim_cache()

    def reset_peak_stats(self) -> None:
        self.pool.reset_peaks()

    # --- statistics ----------------------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        c = self.pool.counters(consistent=True)
        return MemoryStats(
            device=self.device_string,
            total_allocated_bytes=c["reserved_bytes"],
            in_use_bytes=c["in_use_bytes"],
            requested_bytes=c["requested_bytes"],
            pooled_bytes=c["reserved_bytes"] - c["in_use_bytes"],
            peak_bytes=c["peak_in_use_bytes"],
            peak_reserved_bytes=c["peak_reserved_bytes"],
            largest_free_block=c["largest_free_block"],
            pool_hits=c["hits"],
            pool_misses=c["misses"],
            cpu_fallbacks=self._cpu_fallbacks,
            fallback_bytes=self._fallback_bytes,
            active_buffers=c["active_blocks"] - self.pending_free_count + self._fallback_live,
            num_allocs=c["num_allocs"],
            num_frees=c["num_frees"],
            num_segments=c["num_segments"],
            segments_created=c["segments_created"],
            segments_released=c["segments_released"],
            num_ooms=self._num_ooms,
            pending_free_bytes=self.pending_free_bytes,
        )

    # --- pressure ----------------------------------------------------------------------------------
    def pressure_ratio(self) -> float:
        """Bytes held from the device over usable memory, in [0, 1]."""
        if self.usable_memory == 0:
            return 1.0
        return min(1.0, self.pool.reserved_bytes / self.usable_memory)

    def pressure(self) -> MemoryPressure:
        return pressure_level(self.pressure_ratio(), self.config.pressure_thresholds)

    def on_pressure(self, callback: PressureCallback) -> PressureCallback:
        """Register ``callback(old_level, new_level, ratio)``, called on each level change."""
        if not callable(callback):
            raise InvalidInputError("on_pressure takes a callable(old, new, ratio)")
        self._pressure_callbacks.append(callback)
        return callback

    def _update_pressure(self) -> None:
        level = self.pressure()
        if level == self._pressure:
            return
        old, self._pressure = self._pressure, level
        ratio = self.pressure_ratio()
        log.debug("%s pressure %s -> %s (%.1f%%)", self.device_string, old.name, level.name,
                  100 * ratio)
        for callback in list(self._pressure_callbacks):
            try:
                callback(old, level, ratio)
            except Exception as exc:  # an observer must not fail the allocation it observes
                warnings.warn(f"gpumem: pressure observer {callback!r} raised {exc!r}",
                              RuntimeWarning)
        if level > old:
            self._respond_to_pressure(level)

    def _respond_to_pressure(self, level: MemoryPressure) -> None:
        if level >= MemoryPressure.CRITICAL and self.config.auto_cleanup_at_critical:
            self.emergency_cleanup()
        elif level >= MemoryPressure.HIGH and self.config.auto_release_at_high:
            keep = int(self.config.high_cache_fraction * self.usable_memory)
            pooled = self.pool.reserved_bytes - self.pool.in_use_bytes
            if pooled > keep:
                self._release_cached(pooled - keep, reason="HIGH pressure")

    def emergency_cleanup(self) -> int:
        """Release every wholly free segment now (the CRITICAL response); bytes released."""
        self._check_open()
        return self._release_cached(reason="emergency cleanup")

    # --- RAII helpers and batches -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedManagerError(f"the manager for {self.device_string} is closed")

    def _validated_sizes(self, sizes: Iterable[int], what: str = "sizes") -> list[int]:
        out = []
        for i, n in enumerate(sizes):
            if isinstance(n, bool) or not hasattr(n, "__index__"):
                raise TypeError(f"{what}[{i}] must be an int, got {type(n).__name__} {n!r}")
            n = int(n)
            if n < 0:
                raise InvalidInputError(f"{what}[{i}] must be >= 0, got {n}")
            out.append(n)
        return out

    def batch(self) -> "BufferBatch":
        """A BufferBatch: buffers allocated through it are all freed when the block exits."""
        from gpumem.batch import BufferBatch
        self._check_open()
        return BufferBatch(self)

    def allocate_batch(self, sizes: Iterable[int], *, stream: int | None = None,
                       tag: Any = None) -> list[Buffer]:
        """Allocate many buffers at once, placed in as few segments as possible."""
        from gpumem.batch import allocate_batch
        return allocate_batch(self, sizes, stream=stream, tag=tag)

    def warmup(self, sizes: Sequence[int], counts: Sequence[int] | int = 1) -> int:
        """Pre-populate the cache so later requests of these sizes are hits; bytes reserved."""
        from gpumem.batch import warmup
        return warmup(self, sizes, counts)

    def malloc_async(self, nbytes: int, *, stream: int | None = None,
                     tag: Any = None) -> "concurrent.futures.Future[Buffer]":
        """malloc on a worker thread; the Future holds the buffer or the exception."""
        self._check_open()
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__} {nbytes!r}")
        if nbytes < 0:                                   # fail fast, in the caller's thread
            raise InvalidInputError(f"nbytes must be >= 0, got {nbytes}")
        with self._slow:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"gpumem-{self.device_string}")
        return self._executor.submit(self.malloc, int(nbytes), stream=stream, tag=tag)

    # --- seeing memory ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Segments and blocks as a plain, JSON-ready dict (see gpumem.snapshot)."""
        from gpumem.snapshot import take_snapshot
        self._check_open()
        return take_snapshot(self)

    def record_history(self, max_entries: int = 1_000_000) -> "HistoryRecorder":
        """Start recording alloc/free events into a ring buffer; returns the recorder (its
        ``write(path)`` saves a trace in the ../shared/traces format)."""
        from gpumem.history import HistoryRecorder
        self._check_open()
        recorder = HistoryRecorder(self, max_entries=max_entries)
        self.add_observer(recorder)
        return recorder

    def check_leaks(self) -> list:
        """Live buffers tracked by this manager (requires track_allocations)."""
        if self.tracker is None:
            raise InvalidInputError("check_leaks() needs track_allocations=True in the config "
                                    "(or GPUMEM_DEBUG=1)")
        return self.tracker.check_leaks()

    # --- close ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Return every segment to the driver. Live buffers become invalid. Idempotent."""
        with self._slow:
            if self._closed:
                return
            if self.tracker is not None:
                self.tracker.report_leaks(at="close()")
            self._mark_closed()
            # A device closed first (its context released at interpreter exit) took its
            # memory with it: nothing is left to return.
            if not getattr(self.device, "closed", False):
                self._return_everything()
            if self._host is not None:
                self._host.close()
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    def _return_everything(self) -> None:
        try:
            self.collect_pending_frees(wait=True)       # releases their events
            self.device.synchronize()
        except DriverError as exc:
            warnings.warn(f"gpumem: synchronize failed while closing: {exc}", RuntimeWarning)
        for handle in self.pool.live_segment_handles():
            try:
                self.device.free_segment(handle)
            except DriverError as exc:
                warnings.warn(f"gpumem: could not free segment {handle:#x} on close: {exc}",
                              RuntimeWarning)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # destructors never raise
