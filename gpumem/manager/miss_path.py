"""The miss path of a MemoryManager: what runs when the cache cannot serve a request.

The OOM ladder: the cache, then blocks of idle streams, then a new segment within the hard
limits (giving idle cached segments back first when growth would set a new high-water mark or
pass a soft limit; soft limits never refuse: docs/pressure_and_oom.md), then waiting for
deferred frees, then releasing the cache and retrying, then the other managers on the device,
then the OOM callbacks, then CPU fallback, then an OutOfMemoryError that says who refused: the
device, a shared group's budget or a user's hard limit.
Segments themselves come and go through :class:`~gpumem.manager.growth.SegmentGrowth`.

:class:`MissPath` is the part the manager's Cython core calls off the hot path (its *slow
path*, the ``SlowPath`` protocol of ``gpumem/_core/manager_base.pyi``): ``malloc`` on a miss,
``trim_cache`` when the cache passes its cap, ``free_other`` for a FallbackBuffer,
``check_stream``, ``oom_error``. It reaches its manager only through a
:class:`~gpumem._core.manager_core.CoreAccess` (held weakly: the manager's parts never keep it
alive, so a dropped manager is closed at once).

Thread safety: the ladder runs under the manager's slow-path lock (``growth.lock``,
docs/concurrency.md); the counters here are written only under it.
"""
from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable

from gpumem._core.manager_base import stream_handle
from gpumem.errors import (ClosedManagerError, CpuFallbackWarning, DriverError,
                           ForeignBufferError, OutOfMemoryError)
from gpumem.manager.fallback import FallbackBuffer
from gpumem.manager.group_advice import group_cause
from gpumem.manager.limits import SOFT_NOTE, device_reserve, refusal_causes, who_refused
from gpumem.placement import peers
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem._core.buffer import Buffer
    from gpumem._core.manager_core import CoreAccess
    from gpumem.config import MemoryConfig
    from gpumem.manager.growth import SegmentGrowth
    from gpumem.manager.interfaces import HostAllocator, OomCallback
    from gpumem.manager.stream_book import StreamBook
    from gpumem.observe.history import HistoryRecorder

__all__ = ["MissPath"]

log = logging.getLogger("gpumem")


class MissPath:
    """The ladder of one manager (see the module docstring).

    ``make_host``: builds the CPU-fallback host manager on the first fallback. ``recorders``:
    the manager's running history recorders (its list, read here), told of fallback buffers,
    which the pool's history does not see."""

    def __init__(self, core: CoreAccess, growth: SegmentGrowth, streams: StreamBook,
                 config: MemoryConfig, total_memory: int,
                 make_host: Callable[[], HostAllocator],
                 recorders: list[HistoryRecorder]) -> None:
        self._core = core
        self.growth = growth
        self.streams = streams
        self.config = config
        self._total = total_memory
        self._make_host = make_host
        self._recorders = recorders
        self.oom_callbacks: list[OomCallback] = []
        self.host: HostAllocator | None = None     # serves CPU fallbacks, made on the first
        self.num_ooms = 0
        self.cpu_fallbacks = 0
        self.fallback_bytes = 0                    # held by live fallback buffers
        self.fallback_live = 0
        self._fallback_warned = False              # the first fallback warns

    # --- the SlowPath protocol (called by the Cython core) -------------------------------------
    def malloc(self, nbytes: int, stream: int, tag: Any,
               fallback: bool = True) -> Buffer | FallbackBuffer:
        """A request the cache could not serve: the ladder, then CPU fallback (when allowed),
        else OutOfMemoryError."""
        buf = self.malloc_device(nbytes, stream, tag)
        if buf is not None:
            return buf
        self.check_open()             # closed once the ladder dropped the lock: not an OOM
        if fallback and self.config.cpu_fallback_enabled and nbytes <= self._total:
            return self._fallback(nbytes, stream, tag)
        raise self.oom_error(nbytes, fallback_refused=not fallback)

    def trim_cache(self) -> None:
        self.growth.trim_cache()

    def check_stream(self, stream: int) -> None:
        self.streams.ensure(stream)

    def free_other(self, buffer: Any) -> None:
        """free() of what is not a Buffer: a FallbackBuffer of this manager."""
        if isinstance(buffer, FallbackBuffer):
            if buffer.manager is not self._core.manager:
                raise ForeignBufferError(f"fallback buffer {buffer.id} belongs to another "
                                         f"manager")
            buffer.free()
            return
        raise TypeError(f"free() takes a gpumem Buffer, got {type(buffer).__name__}")

    # --- the ladder --------------------------------------------------------------------------
    def check_open(self) -> None:
        """ClosedManagerError once the manager is closed (or gone)."""
        if self._core.closed:
            raise ClosedManagerError(f"the manager for {self.growth.device.device_string} is "
                                     f"closed")

    def malloc_device_only(self, nbytes: int, stream: int, tag: Any) -> Buffer:
        """Like malloc but never falls back to the CPU (warm-up, migrate_to_device)."""
        self.check_open()
        if nbytes > self._total:
            raise self.oom_error(nbytes)             # no device holds it (nor a C size_t)
        buf = (self.growth.alloc_cached(nbytes, stream, tag) if self.streams.usable(stream)
               else None)
        if buf is None:
            buf = self.malloc_device(nbytes, stream, tag)
        if buf is None:
            raise self.oom_error(nbytes)
        return buf

    def malloc_device(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """Ladder: cache -> idle streams' cache -> new segment -> release cache and retry ->
        other managers on this device release their caches, retry -> OOM callbacks and retry.
        None when all fail. A miss that raises drops its shared-budget claim at once."""
        try:
            return self._malloc_device(nbytes, stream, tag)
        except BaseException:
            shared = self.growth.shared
            if shared is not None:
                shared.drop_claim()
            raise

    def _malloc_device(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        growth = self.growth
        with growth.lock:
            manager = self._core.manager
            if manager.closed:
                raise ClosedManagerError(f"the manager for {manager.device_string} is closed")
            self.streams.ensure(stream)
            if nbytes > growth.hold:
                return None                       # can never fit: no driver call, cache kept
            shared = growth.shared                # a shared group: others may hand back cache
            if shared is not None:
                shared.begin_miss()
            buf = growth.alloc_cached(nbytes, stream, tag)
            if buf is None:
                buf = growth.alloc_from_idle_streams(nbytes, stream, tag)
            if buf is None:
                buf = growth.grow(nbytes, stream, tag)
            if buf is None and manager.collect_pending_frees(wait=True):
                # blocks freed after use on other streams: wait for those streams, then retry
                buf = growth.alloc_cached(nbytes, stream, tag) or growth.grow(nbytes, stream, tag)
            if buf is None and growth.release_cached(reason="retry after a failed growth"):
                buf = growth.grow(nbytes, stream, tag)
            if buf is None and peers.release_peer_caches(manager):
                buf = growth.grow(nbytes, stream, tag)
            if buf is None and self.oom_callbacks:
                for callback in list(self.oom_callbacks):
                    callback(manager, nbytes)
                buf = growth.alloc_cached(nbytes, stream, tag)
                if buf is None:
                    growth.release_cached(reason="after OOM callbacks")
                    buf = growth.grow(nbytes, stream, tag)
            if shared is not None:
                shared.sync()                     # the true figures; drops an unused claim
            return buf

    # --- OOM ------------------------------------------------------------------------------------
    def oom_error(self, nbytes: int, fallback_refused: bool = False) -> OutOfMemoryError:
        """The OutOfMemoryError for a request nothing could serve, saying why (and counted)."""
        self.num_ooms += 1
        growth, cfg = self.growth, self.config
        device, pool, usable = growth.device, growth.pool, growth.hold
        # the hard limits that refused it, named with their values and how to change them
        free, total, causes = self._refusal(nbytes)
        reserved = pool.reserved_bytes
        in_use = pool.in_use_bytes
        shared = growth.shared if growth.shared is not None and growth.shared.active else None
        if nbytes > self._total:
            reason = "the request exceeds the device's total memory"
        else:
            if causes:
                reason = "; ".join(causes)
            elif free is not None and free < nbytes:
                reason = (f"the device refused it: it has only {format_bytes(free)} free (no "
                          f"gpumem setting refused it; {SOFT_NOTE})")
            elif shared is not None:
                reason = "the shared group's budget refused it (the device has room)"
            elif free is not None:
                reason = (f"the device refused it: device, cache and callbacks exhausted "
                          f"({format_bytes(free)} free, not in one piece)")
            else:
                reason = "the device refused it: device, cache and callbacks exhausted"
            if shared is not None:
                # what the group's other members hold comes first, unless this manager's own
                # cap refused it (a margin on the device is short because of them)
                group = group_cause(shared, self._core.manager)
                own_cap = any(not c.startswith("min_free_bytes") for c in causes)
                reason = f"{reason}; {group}" if own_cap else f"{group}; {reason}"
            if not cfg.cpu_fallback_enabled:
                reason += "; CPU fallback is disabled"
            elif fallback_refused:
                reason += "; CPU fallback refused by malloc(fallback=False)"
        cached = reserved - in_use
        largest = pool.largest_free_block()
        fits = nbytes <= usable                  # else how the cache looks is beside the point
        if cached and fits:
            reason += (f"; {1 - largest / cached:.0%} of the cache is fragmented (outside the "
                       f"largest free block)")
        if device.supports_virtual_memory and fits:
            on = growth.expandable is not None
            reason += f"; expandable segments {'on' if on else 'off'}"
            # fragmentation is the cause when the bytes exist but not in one piece: in the
            # cache, or on the device (whose free memory is not one contiguous range)
            fragmented = cached >= nbytes > largest or (free is not None and free >= nbytes)
            if not on and fragmented:
                reason += (" (enough bytes are free but not in one piece: "
                           "MemoryConfig(segments='auto'), the default, lets segments grow in place)")
        err = OutOfMemoryError(nbytes, device=device.device_string, free=free, total=total,
                               in_use=in_use, cached=cached, limit=usable,
                               largest_free_block=largest, reason=reason)
        log.warning("%s", err)
        from gpumem.observe.history import on_oom
        on_oom(self._core.manager, err)       # err.history; the dump of GPUMEM_DUMP_ON_OOM
        return err

    def _refusal(self, nbytes: int) -> tuple[int | None, int, list[str]]:
        """``(device free, total, the hard limits that refused nbytes)``, read now."""
        growth, cfg = self.growth, self.config
        try:
            free, total = growth.device.mem_get_info()
        except DriverError:
            free, total = None, self._total
        hold = growth.hold if growth.hold < self._total else None
        causes = refusal_causes(nbytes, config=cfg, total=self._total,
                                reserve=device_reserve(cfg, growth.device, self._total),
                                hold=hold, reserved=growth.device_bytes(), free=free)
        return free, total, causes

    # --- CPU fallback ---------------------------------------------------------------------------
    def _fallback(self, nbytes: int, stream: int, tag: Any) -> FallbackBuffer:
        device_string = self.growth.device.device_string
        with self.growth.lock:
            # the ladder dropped the lock: a close() may have run since (its host is closed)
            self.check_open()
            if self.host is None:
                self.host = self._make_host()
            host = self.host
            if not self._fallback_warned:
                # before the host allocation: a filter that turns this warning into an error
                # then leaves nothing allocated. stacklevel 3: the caller of malloc (Cython
                # frames do not count)
                free, _, causes = self._refusal(nbytes)
                warnings.warn(
                    f"gpumem: {device_string}: {who_refused(nbytes, causes, free)}; "
                    f"{format_bytes(nbytes)} served "
                    f"from CPU memory (a FallbackBuffer). Later fallbacks are only logged. "
                    f"Refuse it with malloc(..., fallback=False) or "
                    f"MemoryConfig(cpu_fallback_enabled=False).",
                    CpuFallbackWarning, stacklevel=3)
                self._fallback_warned = True
        host_buf = host.malloc(nbytes, tag=tag)      # the host manager never falls back
        fb = FallbackBuffer(self._core.manager, self, host_buf, stream, tag)
        self.cpu_fallbacks += 1
        self.fallback_bytes += nbytes
        self.fallback_live += 1
        log.warning("%s: %s served from CPU memory (fallback #%d: the device or a hard "
                    "limit refused it)", device_string, format_bytes(nbytes), self.cpu_fallbacks)
        self._core.notify_alloc(fb)
        for recorder in list(self._recorders):
            recorder.note_fallback(fb, "a")
        return fb

    def fallback_released(self, fb: FallbackBuffer) -> None:
        """A FallbackBuffer of this manager is being freed."""
        self.fallback_bytes -= fb.nbytes
        self.fallback_live -= 1
        if not self._core.closed:
            self._core.notify_free(fb)
            for recorder in list(self._recorders):
                recorder.note_fallback(fb, "f")

    def validate_stream(self, stream: Any) -> None:
        """A stream argument of a FallbackBuffer: a handle the device knows."""
        self.streams.ensure(stream_handle(stream))
