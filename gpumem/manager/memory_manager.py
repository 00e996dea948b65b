"""MemoryManager: one device, one caching pool, and everything around the hot path.

The hot path (a cache hit, a free) is `ManagerCore.malloc/free` in Cython. A MemoryManager is
composed of parts, each owning its state and reached through its declared methods:

- ``_streams`` (:class:`~gpumem.manager.stream_book.StreamBook`): the streams the pool serves;
- ``_growth`` (:class:`~gpumem.manager.growth.SegmentGrowth`): segments from the driver and
  back, plain and expandable, for misses and batches, and the cache cap;
- ``_pressure`` (:class:`~gpumem.manager.pressure.PressureWatch`): the pressure level and its
  responses;
- ``_miss`` (:class:`~gpumem.manager.miss_path.MissPath`): the OOM ladder and CPU fallback; the
  Cython core calls it off the hot path (its slow path).

The parts reach the core through a ``CoreAccess`` that holds the manager weakly, so no part
keeps its manager alive. This module holds the public API, limits, statistics and the
bookkeeping tracking and history recording attach to.

Thread safety (the whole contract: docs/concurrency.md): every public method may be called from
any thread. ``_slow`` (an RLock, owned by the manager, shared with its parts as their ``lock``)
serialises the miss path, stream bookkeeping, segment growth, reconfigure() and close(); the hot
path takes only the pool's C lock (it reads the limits reconfigure() sets as single C words).
Destroyed streams are learnt from the device's listener and refused from then on.

Tracking and history recording keep per-buffer state only for tagged buffers: ``_tags`` (id ->
tag, owned by the manager) gets one dict store from the alloc path under the GIL, and the core's
``_prune_tags`` only deletes ids of freed buffers, so a store racing it is never lost. The list
of running recorders (``_recorders``) is guarded by ``_slow``; the address log (``_wrap``'s C
stores) is written and replaced only with the GIL held.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from gpumem._core.buffer import Buffer
from gpumem._core.manager_core import ManagerCore
from gpumem._core.pool import CachingPool
from gpumem.backends import HOST_DEVICE, Device, default_device, open_device
from gpumem.config import MAX_BYTES, MemoryConfig
from gpumem.errors import ClosedManagerError, InvalidInputError
from gpumem.manager.growth import SegmentGrowth
from gpumem.manager.interfaces import OomCallback
from gpumem.manager.limits import hard_min_free, hold_limit
from gpumem.manager.live_config import check_live_change, usable_bytes
from gpumem.manager.measure import PeakWindows
from gpumem.manager import neighbour
from gpumem.manager.miss_path import MissPath
from gpumem.manager.pressure import MemoryPressure, PressureCallback, PressureWatch
from gpumem.manager.sleep_api import SleepAndWake
from gpumem.manager.stream_book import StreamBook
from gpumem.placement import peers
from gpumem.stats import MemoryStats
from gpumem.units import format_bytes, parse_size

if TYPE_CHECKING:
    from gpumem.manager.batch import BufferBatch
    from gpumem.manager.expandable import ExpandableSegments
    from gpumem.manager.fallback import FallbackBuffer
    from gpumem.manager.measure import Measurement
    from gpumem.observe.history import HistoryRecorder

__all__ = ["MemoryManager", "OomCallback"]

log = logging.getLogger("gpumem")

#: with expandable segments, large blocks are split when at least this much would remain
#: (1 MiB otherwise): on the shared traces it lowers peak reserved/live by up to 0.02
EXPANDABLE_SPLIT_MIN = 64 << 10


def _byte_count(value: Any, what: str) -> int:
    """A byte count in [0, MAX_BYTES] from an int (numpy integers accepted) or a string such
    as ``"1GiB"``, else a specific error naming `what`."""
    if isinstance(value, str):
        value = parse_size(value, what=what)
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidInputError(f"{what} must be an int >= 0 or a size string such as '1GiB', "
                                f"got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0:
        raise InvalidInputError(f"{what} must be >= 0, got {value}")
    if value > MAX_BYTES:
        raise InvalidInputError(f"{what} must be <= 2**62 (4 EiB), got {value}")
    return value


def _add_callback(callbacks: list, callback: Any, usage: str) -> Any:
    """Append a callable to a part's list (InvalidInputError saying `usage` otherwise)."""
    if not callable(callback):
        raise InvalidInputError(usage)
    callbacks.append(callback)
    return callback


#: the CPU-fallback host manager's config: no fallback of its own, no tracker, all the memory
_HOST_CONFIG = dict(cpu_fallback_enabled=False, min_free_bytes=0, track_allocations=False,
                    gpu_memory_fraction=1.0)


def _host_maker(parent: "MemoryManager") -> Callable[[], "MemoryManager"]:
    """What the miss path calls on a manager's first CPU fallback: the host manager, keeping
    tags if the parent's tracker wants them. Holds the parent weakly (a part never keeps its
    manager alive)."""
    ref = weakref.ref(parent)

    def make() -> "MemoryManager":
        host = MemoryManager(HOST_DEVICE, MemoryConfig(**_HOST_CONFIG))
        owner = ref()
        if owner is not None:
            owner._keep_buffer_state(host)      # the tracker wants its tags too
        return host
    return make


class MemoryManager(SleepAndWake, ManagerCore):
    """Allocates device memory through a caching pool.

    >>> mm = MemoryManager("sim:0")
    >>> with mm.malloc(1 << 20, tag="weights") as buf:
    ...     buf.nbytes
    1048576
    """

    def __init__(self, device: str | Device | None = None,
                 config: MemoryConfig | None = None) -> None:
        """``device``: a device string (``"cuda:0"``, ``"opencl:0"``, ``"cpu"``, ``"sim:0"``,
        ``"sim:80GiB"``) or an opened Device; None: ``gpumem.backends.default_device()`` (a
        real accelerator, never an uninstalled simulated device)."""
        if device is None:
            device = default_device()
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
        expandable = config.segment_policy != "plain" and dev.supports_virtual_memory
        pool = CachingPool(
            granularity=max(config.granularity, props.alignment),
            small_size=config.small_size, small_segment=config.small_segment,
            large_segment=config.large_segment, large_threshold=config.large_threshold,
            large_round=config.large_round,
            # max_split_size keeps big cached segments whole; an expandable segment returns
            # its surplus page by page instead, and unsplittable holes in it would only grow it
            max_split_size=None if expandable else config.max_split_size,
            # in one growing segment a remainder too small to split stays inside the block
            # for good: split down to EXPANDABLE_SPLIT_MIN (slivers merge back on free)
            large_split_min=(min(config.large_split_min, EXPANDABLE_SPLIT_MIN) if expandable
                             else config.large_split_min),
            oversize_slack=config.oversize_slack)
        self._core_init(pool, dev, dev.device_string)
        self._config = config       # the one the parts hold too (reconfigure pushes a new one)
        self.total_memory = total
        usable = usable_bytes(config, total, dev.recommended_reserve(total))
        self._slow = threading.RLock()
        self._recorders: list[HistoryRecorder] = []    # running; guarded by _slow
        self._last_recorder: Any = None                 # weakref to the last one stopped
        self._history_before_recording: int | None = None
        self._tags = None
        self._tags_limit = 4096
        self._address_capacity = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._peaks = PeakWindows(pool)     # the manager's peaks across measure() blocks
        # the parts (see the module docstring); they hold the core weakly
        core = self._core_access()
        self._streams = StreamBook(core, pool, dev, self._slow)
        self._pressure = PressureWatch(pool, config, usable, dev.device_string)
        self._growth = SegmentGrowth(core, pool, dev, config, usable, self._slow,
                                     self._streams, self._pressure, expandable=expandable)
        self._miss = MissPath(core, self._growth, self._streams, config, total,
                              _host_maker(self), self._recorders)
        self._set_slow_path(self._miss)
        self._push_limits(config, usable)
        if config.shared_group is not None:       # a budget shared with other processes
            from gpumem.placement.shared_budget import SharedBudget   # placement: layer above
            self._growth.shared = SharedBudget(self._growth, dev, config, total)
        self.tracker = None
        self._set_tracking(config)
        dev.add_stream_listener(self._streams.on_stream_destroyed)
        peers.register(self)
        if not dev.holds_host_memory:
            neighbour.watch(self)               # cache back when others need the device

    # --- configuration ----------------------------------------------------------------------
    @property
    def config(self) -> MemoryConfig:
        """The config this manager runs with. Assigning a MemoryConfig reconfigures the
        manager as :meth:`reconfigure` does (same checks, same effect)."""
        return self._config

    @config.setter
    def config(self, new: MemoryConfig) -> None:
        self._apply_config(new)

    def reconfigure(self, **changes: Any) -> MemoryConfig:
        """Change MemoryConfig fields of this live manager, e.g.
        ``mm.reconfigure(cpu_fallback_enabled=False, gpu_memory_fraction=0.5)``; returns the
        new config. Every part acts on it at once (limits, cache cap, tracker, pressure) or on
        its next call (fallback, growth). Fields the pool or its segments were built with
        (segment sizes, expandable segments: gpumem.manager.live_config.FIXED_FIELDS) are
        refused with InvalidInputError, as are unknown fields and invalid values; a refused
        change changes nothing."""
        self._apply_config(self._config.replace(**changes))
        return self._config

    def _apply_config(self, new: MemoryConfig) -> None:
        with self._slow:
            self._check_open()
            check_live_change(self._config, new)
            usable = usable_bytes(new, self.total_memory,
                                  self.device.recommended_reserve(self.total_memory))
            old, self._config = self._config, new
            # every part that acts on the config holds it as `config`: one push reaches them
            for part in (self._growth, self._miss, self._pressure):
                part.config = new
            self._growth.max_pool_size = new.max_pool_size
            self._push_limits(new, usable)
            if (old.track_allocations, old.track_stacks) != (new.track_allocations,
                                                             new.track_stacks):
                self._set_tracking(new)
            self._growth.trim_cache()
            over = self.pool.reserved_bytes - usable
            if over > 0:                      # a narrower limit: give back what the cache can
                # (a soft one bounds the cache; a hard one the cache cannot meet is met as
                # buffers are freed: growth stops at it)
                self._growth.release_cached(over, reason="reconfigure")
            self._growth.reserved_changed()   # the level under the new limit and thresholds

    def _set_tracking(self, config: MemoryConfig) -> None:
        """Make the tracker `config` asks for (dropping the one running, if any)."""
        old = self.tracker
        if old is not None:
            self.tracker = None
            if old in self._observers:
                self.remove_observer(old)
            self._keep_buffer_state()
        if config.track_allocations:
            from gpumem.observe.tracking import AllocationTracker
            self.tracker = AllocationTracker(self, capture_stacks=config.track_stacks)
            if self.tracker.reads_pool:
                self._keep_buffer_state()       # tags only: the pool knows the rest
            else:
                self.add_observer(self.tracker)   # stacks: captured per buffer

    # --- properties -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def _push_limits(self, config: MemoryConfig, usable: int) -> None:
        """Tell the parts and the core the soft scale and the hard limits of ``config``."""
        hold = hold_limit(config, self.total_memory)
        self._growth.set_limits(usable, self.total_memory if hold is None else hold,
                                hard_min_free(config))
        self._pressure.usable_memory = usable
        # the core refuses at once (no driver call) only what a hard limit or the device
        # could never hold
        self._set_limits(self.total_memory if hold is None else hold, config.max_pool_size)

    @property
    def usable_memory(self) -> int:
        """``min(total * gpu_memory_fraction, total - reserve)``: the soft limit (the cache is
        trimmed past it, pressure is CRITICAL above it), or the hard cap when the user set
        one of these (docs/pressure_and_oom.md)."""
        return self._growth.usable_memory

    @usable_memory.setter
    def usable_memory(self, nbytes: int) -> None:
        # an assigned usable memory is the caller's own limit: hard, like a configured one
        self._growth.set_limits(nbytes, nbytes, self._growth.min_free_hard)
        self._pressure.usable_memory = nbytes
        self._set_limits(nbytes, self._config.max_pool_size)

    @property
    def hold_limit(self) -> int:
        """The most bytes this manager may hold from the device: a hard limit the user set
        (gpu_memory_fraction, reserve_bytes, usable_memory assigned), else the device's total
        memory."""
        return self._growth.hold

    @property
    def expandable_segments(self) -> ExpandableSegments | None:
        """The manager's expandable segments (``MemoryConfig.expandable_segments`` on a device
        with virtual memory), None when it uses plain segments."""
        return self._growth.expandable

    # tests and tools written before the manager was composed read this name
    _expandable = expandable_segments

    @property
    def fallback_manager(self) -> MemoryManager | None:
        """The host-memory manager serving this manager's CPU fallbacks; None before the
        first fallback."""
        return self._miss.host

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
        self._set_observers(self._observers + (observer,))
        self._via_python = True

    def remove_observer(self, observer: Any) -> None:
        """Stop calling `observer` (one added by :meth:`add_observer`); InvalidInputError if
        it is not registered."""
        if observer not in self._observers:
            raise InvalidInputError(f"{observer!r} is not an observer of this manager")
        observers = list(self._observers)
        observers.remove(observer)
        self._set_observers(observers)
        self._via_python = self._hooks or self._tags is not None or self._nregions > 0

    # --- per-buffer state for history and tracking (no Python on the hot path) ---------------
    def _start_recording(self, recorder: "HistoryRecorder") -> None:
        """HistoryRecorder(manager) calls this: the pool's history must hold the recorder's
        max_entries (growing it forgets the events recorded so far), and tags and addresses
        are kept while it runs."""
        with self._slow:
            self._check_open()
            capacity = self.pool.history_capacity
            if capacity < recorder.max_entries:
                if self._history_before_recording is None:
                    self._history_before_recording = capacity
                self.pool.set_history(recorder.max_entries)
            self._recorders.append(recorder)
            self._keep_buffer_state()

    def _stop_recording(self, recorder: "HistoryRecorder") -> None:
        """The recorder has copied its events: stop keeping state for it; the last one gives
        the pool back its own history size."""
        with self._slow:
            if recorder in self._recorders:
                self._recorders.remove(recorder)
                # export_memory_viz after stop() exports its events (weak: no events kept alive)
                self._last_recorder = weakref.ref(recorder)
            if not self._recorders and self._history_before_recording is not None:
                if not self._closed:
                    self.pool.set_history(self._history_before_recording)
                self._history_before_recording = None
            self._keep_buffer_state()

    def _keep_buffer_state(self, host: MemoryManager | None = None) -> None:
        """Keep tags while a recorder runs or the tracker reads the pool (the CPU-fallback
        host manager's for the tracker: ``host``, or the one made already), and addresses while
        a recorder runs; _slow held."""
        tracked = self.tracker is not None and self.tracker.reads_pool
        host = host if host is not None else self._miss.host
        for mm, want_tags in ((self, tracked or bool(self._recorders)), (host, tracked)):
            if mm is not None and want_tags != (mm._tags is not None):
                mm._tags = {} if want_tags else None
                # the torch allocator's nogil path cannot tag its buffers: send it through malloc
                mm._via_python = mm._hooks or want_tags or mm._nregions > 0
        addresses = max((r.max_entries for r in self._recorders), default=0)
        # the newest tags a running recorder may still show survive pruning
        self._tags_keep = addresses
        if addresses > self._address_capacity or not addresses:
            self._set_address_log(addresses)
            self._address_capacity = addresses

    def on_oom(self, callback: OomCallback) -> OomCallback:
        """Register ``callback(manager, nbytes)``, run when a request cannot be served; it
        may free buffers, and the request is retried once after all callbacks ran."""
        return _add_callback(self._miss.oom_callbacks, callback, "on_oom takes a "
                             "callable(manager, nbytes)")

    # --- cache control ------------------------------------------------------------------------------
    def empty_cache(self) -> int:
        """Return every wholly free cached segment to the driver; the bytes returned."""
        self._check_open()
        self.collect_pending_frees()
        tagged = self._tag_pools.empty_cache() if self._tag_pools is not None else 0
        return tagged + self._growth.release_cached(reason="empty_cache")

    def shrink(self, target_cached_bytes: int | str = 0) -> int:
        """Release wholly free segments until at most target bytes (an int or a size string
        such as ``"256MiB"``) stay cached; the bytes released."""
        self._check_open()
        target_cached_bytes = _byte_count(target_cached_bytes, "target_cached_bytes")
        cached = self.pool.reserved_bytes - self.pool.in_use_bytes
        if cached <= target_cached_bytes:
            return 0
        return self._growth.release_cached(cached - target_cached_bytes, reason="shrink")

    def set_max_pool_size(self, nbytes: int | str | None) -> None:
        """Cap the cached (free) bytes at `nbytes` (an int or a size string such as ``"1GiB"``);
        None removes the cap. Trims at once. A bad value raises InvalidInputError and changes
        nothing."""
        if nbytes is not None:
            nbytes = _byte_count(nbytes, "max_pool_size")
        self.reconfigure(max_pool_size=nbytes)      # config, cap and limits: one source

    @property
    def _max_pool_size(self) -> int | None:
        # the torch allocator reads the cap (gpumem/integrations/_torch_alloc.pyx)
        return self._growth.max_pool_size

    def reset_peak_stats(self) -> None:
        """Start the peak counters (``peak_in_use_bytes``, ``peak_reserved_bytes`` in :meth:`stats`)
        again from the current in-use and reserved bytes (open measure() blocks keep theirs)."""
        self._peaks.reset()

    # --- statistics ----------------------------------------------------------------------------------
    def stats(self) -> MemoryStats:
        """A consistent snapshot of the counters: bytes reserved from the device, in use and
        cached, peaks, hits and misses, segments, OOMs and CPU fallbacks (see MemoryStats).
        After close() the manager holds nothing, and the held figures say 0."""
        c = self.pool.counters(consistent=True)
        # measure() blocks reset the pool's peak counters: the manager's peaks come from here
        c["peak_in_use_bytes"], c["peak_reserved_bytes"] = self._peaks.peaks(
            c["peak_in_use_bytes"], c["peak_reserved_bytes"])
        # pages the driver refused to free: the device holds them, the pool no longer does
        expandable = self._growth.expandable
        c["held_bytes"] = expandable.held_bytes if expandable is not None else 0
        c["reserved_bytes"] += c["held_bytes"]
        asleep, backup = self._tag_pool_counters(c)     # sleep tags' pools (sleep_api.py)
        c["peak_reserved_bytes"] = max(c["peak_reserved_bytes"], c["reserved_bytes"])
        if self._closed:
            for held in ("reserved_bytes", "in_use_bytes", "cached_bytes", "requested_bytes",
                         "active_blocks", "num_segments", "largest_free_block", "held_bytes"):
                c[held] = 0
        return MemoryStats(
            device=self.device_string,
            reserved_bytes=c["reserved_bytes"],
            in_use_bytes=c["in_use_bytes"],
            requested_bytes=c["requested_bytes"],
            cached_bytes=c["cached_bytes"],
            peak_in_use_bytes=c["peak_in_use_bytes"],
            peak_reserved_bytes=c["peak_reserved_bytes"],
            largest_free_block=c["largest_free_block"],
            pool_hits=c["pool_hits"],
            pool_misses=c["pool_misses"],
            cpu_fallbacks=self._miss.cpu_fallbacks,
            fallback_bytes=self._miss.fallback_bytes,
            active_buffers=(0 if self._closed else
                            c["active_blocks"] - self.pending_free_count
                            + self._miss.fallback_live),
            num_allocs=c["num_allocs"],
            num_frees=c["num_frees"],
            num_segments=c["num_segments"],
            segments_created=c["segments_created"],
            segments_released=c["segments_released"],
            num_ooms=self._miss.num_ooms,
            pending_free_bytes=0 if self._closed else self.pending_free_bytes,
            held_bytes=c["held_bytes"],
            fallback_buffers=0 if self._closed else self._miss.fallback_live,
            asleep_bytes=0 if self._closed else asleep,
            backup_bytes=0 if self._closed else backup,
        )

    # --- pressure ----------------------------------------------------------------------------------
    def pressure_ratio(self) -> float:
        """Bytes held from the device over usable memory, in [0, 1]."""
        return self._pressure.ratio()

    def pressure(self) -> MemoryPressure:
        """The pressure level (LOW, MEDIUM, HIGH, CRITICAL) of :meth:`pressure_ratio` against
        ``config.pressure_thresholds``."""
        return self._pressure.current()

    def on_pressure(self, callback: PressureCallback) -> PressureCallback:
        """Register ``callback(old_level, new_level, ratio)``, called on each level change."""
        return _add_callback(self._pressure.callbacks, callback, "on_pressure takes a "
                             "callable(old, new, ratio)")

    def emergency_cleanup(self) -> int:
        """Release every wholly free segment now (the CRITICAL response); bytes released."""
        self._check_open()
        return self._growth.release_cached(reason="emergency cleanup")

    def _oom_error(self, nbytes: int) -> Exception:
        # the CuPy and Numba bridges raise it for a request only host memory could serve
        return self._miss.oom_error(nbytes)

    def release_idle_cache(self, reason: str = "") -> int:
        """Release every wholly free cached segment now, unless this manager is busy in its
        slow path (a miss, close()): then 0 at once, it never waits (a peer manager out of
        memory on the same device asks this). The bytes released; 0 once closed."""
        if not self._slow.acquire(blocking=False):
            return 0
        try:
            return 0 if self._closed else self._growth.release_cached(reason=reason)
        finally:
            self._slow.release()

    # --- RAII helpers and batches -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedManagerError(f"the manager for {self.device_string} is closed")

    def batch(self) -> "BufferBatch":
        """A BufferBatch: buffers allocated through it are all freed when the block exits."""
        from gpumem.manager.batch import BufferBatch
        self._check_open()
        return BufferBatch(self)

    def allocate_batch(self, sizes: Iterable[int], *, stream: int | None = None,
                       tag: Any = None) -> list[Buffer | FallbackBuffer]:
        """Allocate many buffers at once, placed in as few segments as possible (see
        gpumem.manager.batch.allocate_batch)."""
        from gpumem.manager.batch import allocate_in_segments
        self._check_open()
        return allocate_in_segments(self._miss, self.malloc, sizes, stream, tag)

    def warmup(self, sizes: Sequence[int], counts: Sequence[int] | int = 1, *,
               stream: Any = None) -> int:
        """Pre-populate the cache so later requests of these sizes are hits; bytes reserved
        (see gpumem.manager.batch.warmup)."""
        from gpumem.manager.batch import warm_up
        self._check_open()
        return warm_up(self._miss, sizes, counts, stream)

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
    def measure(self) -> "Measurement":
        """``with mm.measure() as m: ...`` then ``m.stats``: what changed inside the block
        (num_allocs, num_frees, pool_hits, pool_misses, bytes) and its peaks (see
        gpumem.manager.measure)."""
        from gpumem.manager.measure import Measurement
        self._check_open()
        return Measurement(self, self._peaks, self._miss)

    def peaks(self) -> tuple[int, int]:
        """``(peak in-use bytes, peak reserved bytes)`` since creation or
        :meth:`reset_peak_stats` (measure() blocks do not reset them)."""
        c = self.pool.counters()
        return self._peaks.peaks(c["peak_in_use_bytes"], c["peak_reserved_bytes"])

    def memory_summary(self, *, top_tags: int = 5) -> str:
        """A table a person reads at a glance: reserved, in use, cached, peaks, fallback,
        hits/misses, segments by pool and size class, largest free block, pressure, and the
        top tags by bytes when tracking is on (see gpumem.observe.summary)."""
        from gpumem.observe.summary import memory_summary
        return memory_summary(self, top_tags=top_tags)

    def snapshot(self) -> dict:
        """Segments and blocks as a plain, JSON-ready dict (see gpumem.observe.snapshot)."""
        from gpumem.observe.snapshot import take_snapshot
        self._check_open()
        return take_snapshot(self)

    def record_history(self, max_entries: int = 1_000_000) -> "HistoryRecorder":
        """Start recording alloc/free events into a ring buffer; returns the recorder (its
        ``write(path)`` saves a trace in the gpumem/data/traces format)."""
        from gpumem.observe.history import HistoryRecorder
        self._check_open()
        return HistoryRecorder(self, max_entries=max_entries)

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
            for recorder in list(self._recorders):
                recorder.stop()                 # its events stay readable after close
            if self.tracker is not None:
                try:
                    self.tracker.report_leaks(at="close()")
                except Exception as exc:  # a report must never keep the memory held
                    warnings.warn(f"gpumem: the leak report of {self.device_string} failed "
                                  f"while closing: {exc!r}", RuntimeWarning)
            self._mark_closed()
            neighbour.unwatch(self)
            if self._tag_pools is not None:
                self._tag_pools.close()         # they leave a shared group (card) first
            # A device closed first (its context released at interpreter exit) took its
            # memory with it: nothing is left to return.
            if not getattr(self.device, "closed", False):
                try:
                    self.collect_pending_frees(wait=True)       # releases their events
                except Exception as exc:  # close() always goes on to return the segments
                    warnings.warn(f"gpumem: synchronize failed while closing: {exc}",
                                  RuntimeWarning)
                self._growth.return_everything()
            if self._growth.shared is not None:
                self._growth.shared.leave()         # after the memory went back (a sim card)
            if self._miss.host is not None:
                self._miss.host.close()
            if self._executor is not None:
                self._executor.shutdown(wait=False)

    def _after_fork_in_child(self) -> None:
        """In a forked child only the forking thread exists: the malloc_async worker and any
        lock another thread held are gone. Start them afresh (the executor lazily)."""
        self._slow = threading.RLock()
        self._streams.lock = self._growth.lock = self._slow
        self._executor = None
        self._reset_collector()

    def __del__(self) -> None:
        # Never block in a destructor: close only if the slow-path lock is free right now
        # (an unreachable manager's lock is free unless a peer's OOM rung holds it).
        try:
            slow = self.__dict__.get("_slow")
            if slow is None or not slow.acquire(blocking=False):
                return
            try:
                self.close()
            finally:
                slow.release()
        except Exception:
            pass  # destructors never raise
