"""The public face of sleep and wake on a MemoryManager: ``region``, ``sleep``, ``wake``,
``sleeping_tags`` (docs/sleep_and_wake.md). The work is done by the manager's
:class:`~gpumem.manager.tag_pools.TagPools` (made on first use) and
:class:`~gpumem.manager.sleep.SleepableSegments`.

:class:`SleepAndWake` is a mixin of MemoryManager: it reaches the manager only through the
attributes the Cython core declares (``_tag_pools``, ``_nregions``, ``device``) and the
``_check_open`` call, so it never imports the manager module.

Thread safety: every method may be called from any thread. ``region`` is per thread (a
context variable); sleep and wake of one tag are serialised by that tag pool's slow-path lock.
Touching a sleeping buffer meanwhile raises GpuMemoryError; a kernel the user launches on its
address meanwhile is the user's to avoid (as with any unmapped address).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Iterable

from gpumem.errors import GpuMemoryError
from gpumem.manager.tag_pools import TagPools, TagState

__all__ = ["SleepAndWake"]


class _AsleepSlowPath:
    """A sleeping tag pool's slow path: any request reaching it (its largest request is 0
    while asleep) is refused, naming the tag; the rest goes to the real slow path."""

    def __init__(self, real: Any, tag: Any) -> None:
        self._real = real
        self._tag = tag

    def malloc(self, nbytes: int, stream: int, tag: Any, fallback: bool = True) -> Any:
        raise GpuMemoryError(f"tag {self._tag!r} is asleep: wake({self._tag!r}) before "
                             f"allocating with it")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class SleepAndWake:
    """``region``/``sleep``/``wake`` of a MemoryManager (see the module docstring)."""

    _tag_pools: TagPools | None

    def _tag_pools_made(self) -> TagPools:
        pools = self._tag_pools
        if pools is None:
            with self._slow:                        # type: ignore[attr-defined]
                if self._tag_pools is None:
                    self._tag_pools = TagPools(self)   # type: ignore[arg-type]
                pools = self._tag_pools
        return pools

    def region(self, tag: Any) -> AbstractContextManager[None]:
        """``with mm.region("weights"): ...``: allocations made in this thread inside the
        block (malloc, arrays, and the torch, CuPy and Numba bridges) carry ``tag`` unless they
        name another, and ``tag`` becomes a sleep tag: its memory (inside regions or through
        ``malloc(..., tag=tag)``) comes from a pool of its own in virtual-memory pages, so
        :meth:`sleep` can give it back to the device. On a device without virtual memory
        (OpenCL, host) the block only tags allocations, and ``sleep`` raises
        UnsupportedOperationError."""
        self._check_open()                          # type: ignore[attr-defined]
        return self._tag_pools_made().region(tag)

    def sleep(self, tags: Any, *, backup: bool | Iterable[Any] = True) -> int:
        """Give the device memory of one tag or several (``tags``) back to the device: every
        live buffer and cached block of those tags. Buffers keep their addresses; touching
        one through gpumem (copies, memset, views, DLPack) raises GpuMemoryError naming the
        tag until :meth:`wake`; freeing one is allowed (its backup is dropped, its address
        released). ``backup``: True copies every tag's live buffers to (page-locked) host
        memory first, False discards their contents, or the subset of ``tags`` to copy.
        Returns the bytes released. A tag already asleep is left as it is.
        InvalidInputError names a tag never used with :meth:`region`;
        UnsupportedOperationError on a device without virtual memory."""
        self._check_open()                          # type: ignore[attr-defined]
        return self._tag_pools_made().sleep(tags, backup)

    def wake(self, tags: Any = None) -> int:
        """Map new device memory at the same addresses for the sleeping ``tags`` (None: all),
        restore what was backed up and free the host copies; the bytes mapped. Per tag all or
        nothing: when the driver, the limits or a shared group's budget (after asking the
        other members to hand cached memory back) refuse, OutOfMemoryError is raised and the
        tag stays asleep with its backup intact; a later wake can succeed."""
        self._check_open()                          # type: ignore[attr-defined]
        return self._tag_pools_made().wake(tags)

    def sleeping_tags(self) -> list[TagState]:
        """Each sleep tag that holds memory: ``{"tag", "asleep", "device_bytes",
        "in_use_bytes", "asleep_bytes", "backup_bytes"}`` (``gpumem info`` lists them)."""
        pools = self._tag_pools
        return [] if pools is None else pools.states()

    # --- a tag pool's side (TagPools calls these on the pools it owns) ------------------------
    @property
    def asleep_tag(self) -> Any:
        """For a tag pool whose memory sleeps: its tag; None otherwise."""
        return self._asleep_tag                    # type: ignore[attr-defined]

    def hold_requests(self, tag: Any) -> None:
        """Refuse every request of this manager with GpuMemoryError naming ``tag`` (a tag
        pool whose memory goes to sleep): its largest request becomes 0, so even a cache hit
        reaches the slow path, which refuses. Called with the slow-path lock held."""
        self._asleep_tag = tag
        self._set_slow_path(_AsleepSlowPath(self._miss, tag))   # type: ignore[attr-defined]
        self._set_limits(0, None)                  # type: ignore[attr-defined]

    def serve_requests(self) -> None:
        """Undo :meth:`hold_requests` (the tag pool woke, or its sleep failed)."""
        self._asleep_tag = None
        self._set_slow_path(self._miss)            # type: ignore[attr-defined]
        self._set_limits(self.usable_memory, self.config.max_pool_size)  # type: ignore

    # --- what the manager's stats, empty_cache and close add ---------------------------------
    def _tag_pool_counters(self, c: dict) -> tuple[int, int]:
        """Add the awake tag pools' figures to the manager's counters ``c``; ``(asleep_bytes,
        backup_bytes)``. A sleeping tag's bytes are in asleep_bytes only (not reserved, in
        use or cached: the device does not hold them)."""
        pools = self._tag_pools
        if pools is None:
            return 0, 0
        for pool in pools.pools():
            exp = pool.expandable_segments
            if pool.asleep_tag is not None:
                held = exp.unreleased_bytes
                c["reserved_bytes"] += held
                c["held_bytes"] += held
                continue
            pc = pool.pool.counters(consistent=True)
            for key in ("reserved_bytes", "in_use_bytes", "requested_bytes", "cached_bytes",
                        "pool_hits", "pool_misses", "num_allocs", "num_frees", "num_segments",
                        "segments_created", "segments_released", "active_blocks"):
                c[key] += pc[key]
            c["held_bytes"] += exp.held_bytes
            c["reserved_bytes"] += exp.held_bytes
            c["largest_free_block"] = max(c["largest_free_block"], pc["largest_free_block"])
            # peaks of pools reached at different times: their sum bounds the manager's
            peak_in_use, peak_reserved = pool.peaks()
            c["peak_in_use_bytes"] += peak_in_use
            c["peak_reserved_bytes"] += peak_reserved
        return pools.asleep_bytes(), pools.backup_bytes()
