"""Tag pools: memory a tag names, kept apart so that it can sleep (docs/sleep_and_wake.md).

``mm.region(tag)`` makes ``tag`` a *sleep tag* of the manager and, in that thread (a context
variable: threads and asyncio tasks each have their own), gives the tag to every allocation
that names none: ``malloc``, arrays, and the torch, CuPy and Numba bridges (whose own labels
``"torch"``, ``"cupy"`` and ``"numba"`` yield to the region's). From then on the tag's
allocations, inside a region or through ``malloc(..., tag=tag)``, come from the tag's own
pool: a second MemoryManager on the same device (its *tag pool*), whose memory lives in
expandable segments (:class:`~gpumem.manager.sleep.SleepableSegments`) whatever the parent's
segment policy, with no small pool (every request is served from pages it can unmap). Its
cached blocks serve only that tag, and no page holds two tags' bytes.

Why a pool per tag, not a tag check in the pool: the hit path (the Cython ``gm_alloc``, the
front caches) stays as it is. The parent's ``malloc`` pays one pointer test (``_tag_pools is
None``) until a region is first used, then only tagged requests and requests made while a
region is open anywhere (a C counter) come here; an untagged request outside regions goes
straight to the parent's pool. A tag pool's own hit path is the same Cython code.

A tag pool is a full manager: it has its own OOM ladder, trims, peers registration (the
parent out of memory asks it to release idle cache, and back), and, in a shared group, its own
member slot in the ledger, so bytes a sleep releases are free to the group's other members at
once and a wake claims them back through the existing hand-back. Its growth is also bounded
by the parent's ``usable_memory`` over the parent's pool and every tag pool together.

Buffers of a tag pool are Buffers (their ``manager`` is the tag pool); the parent's ``free``
accepts them. ``stats()``, ``empty_cache()`` and ``close()`` of the parent cover its tag pools.

Thread safety: ``_lock`` guards the tag tables and the region counter; sleep and wake of a tag
run under its tag pool's slow-path lock (the parent's is not taken: a tag's wake may ask the
parent, a peer, to release cache).
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

from gpumem.errors import (GpuMemoryError, InvalidInputError, OutOfMemoryError,
                           UnsupportedOperationError)
from gpumem.manager.sleep import SleepableSegments, WakeRefused
from gpumem.manager.sleep_backup import Backups
from gpumem.placement import peers
from gpumem.units import format_bytes

__all__ = ["TagPools", "BRIDGE_TAGS", "TagState"]

#: the labels the framework bridges give their allocations; a region's tag replaces them
BRIDGE_TAGS = frozenset({"torch", "cupy", "numba"})


class TagState(dict):
    """One tag as ``sleeping_tags()`` and ``gpumem info`` show it (a plain dict)."""


class _FamilyGrowth:
    """A tag pool's Growth as its SleepableSegments sees it: the tag pool's own, with a
    segment_allowed that also keeps the parent's pool and all its tag pools within the
    parent's usable memory."""

    def __init__(self, growth: Any, family_room: Callable[[int], bool]) -> None:
        self._growth = growth
        self._family_room = family_room

    def segment_allowed(self, seg_size: int, reserved: int, free: int, *,
                        ask_others: bool = True) -> bool:
        return self._family_room(seg_size) and self._growth.segment_allowed(
            seg_size, reserved, free, ask_others=ask_others)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._growth, name)


class TagPools:
    """The sleep tags of one manager and their pools (see the module docstring)."""

    def __init__(self, parent: Any) -> None:
        self._parent = weakref.ref(parent)
        self._device = parent.device
        self._lock = threading.Lock()
        self._region: contextvars.ContextVar[Any] = contextvars.ContextVar(
            f"gpumem_region_{id(self):x}", default=None)
        self._tags: set[Any] = set()                 # declared sleep tags
        self._pools: dict[Any, Any] = {}   # tag -> its pool (made on first use)
        self._backups: dict[Any, Backups] = {}       # tag -> backups of a sleeping tag
        self._via_python_before: bool | None = None

    # --- the parent's hot path sends tagged requests here ------------------------------------
    def route(self, nbytes: int, tag: Any) -> tuple[Any, Any]:
        """``(tag pool or None, tag)`` for a request of the parent: the region's tag replaces
        none or a bridge's label; None (the parent's own pool) for a tag that is not a sleep
        tag, or 0 bytes. GpuMemoryError when the tag sleeps."""
        if tag is None or (type(tag) is str and tag in BRIDGE_TAGS):
            tag = self._region.get() or tag
        pool = self._pool_for(tag) if nbytes and tag is not None else None
        if pool is not None and pool.asleep_tag is not None:
            raise GpuMemoryError(f"tag {tag!r} is asleep: wake({tag!r}) before allocating "
                                 f"with it")
        return pool, tag

    def owns(self, manager: Any) -> bool:
        """Whether ``manager`` is one of these tag pools (the parent's free() accepts their
        buffers)."""
        return any(p is manager for p in list(self._pools.values()))

    def _parent_mm(self) -> Any:
        parent = self._parent()
        if parent is None:
            raise GpuMemoryError("the manager of these tag pools is gone")
        return parent

    def _pool_for(self, tag: Any) -> Any:
        try:
            if tag not in self._tags:
                return None
        except TypeError:                  # an unhashable label cannot be a sleep tag
            return None
        pool = self._pools.get(tag)
        if pool is None:
            with self._lock:
                pool = self._pools.get(tag)
                if pool is None:
                    pool = self._pools[tag] = self._make_pool(tag)
        return pool

    def _make_pool(self, tag: Any) -> Any:
        parent = self._parent_mm()
        cfg = parent.config
        if cfg.segment_policy == "plain":
            cfg = cfg.replace(segments="auto", expandable_segments=None,
                              expandable_handle_size=None)
        # every request from pages (no small pool), never host memory, no cache cap (a trim
        # of slept pages must not run on a free)
        cfg = cfg.replace(small_size=0, cpu_fallback_enabled=False, max_pool_size=None)
        pool = type(parent)(parent.device, cfg)
        growth = pool._growth
        if growth.expandable is None:
            pool.close()
            raise UnsupportedOperationError(self._no_vm_reason())
        growth.expandable = SleepableSegments(_FamilyGrowth(growth, self._family_room))
        return pool

    def _family_room(self, nbytes: int) -> bool:
        """Whether the parent's pool and all its tag pools can hold ``nbytes`` more within
        the parent's usable memory."""
        parent = self._parent()
        if parent is None:
            return False
        return self.reserved_total(parent) + nbytes <= parent.usable_memory

    def reserved_total(self, parent: Any) -> int:
        """Bytes the parent's pool and its tag pools hold from the device now."""
        return parent.pool.reserved_bytes + sum(_device_bytes(p) for p in self.pools())

    def pools(self) -> list[Any]:
        return [p for p in list(self._pools.values()) if not p.closed]

    def _no_vm_reason(self) -> str:
        return (f"{self._device.device_string} has no virtual memory (the driver cannot map "
                f"memory at a chosen address), so a tag's memory cannot be given back while "
                f"its buffers keep their addresses; sleep and wake need a CUDA or sim device")

    # --- regions -----------------------------------------------------------------------------
    def declare(self, tag: Any) -> None:
        """Make ``tag`` a sleep tag (its later allocations come from its own pool)."""
        if tag is None:
            raise InvalidInputError("a sleep tag must not be None")
        try:
            hash(tag)
        except TypeError:
            raise InvalidInputError(f"a sleep tag must be hashable (a str, say), got "
                                    f"{type(tag).__name__} {tag!r}") from None
        if self._device.supports_virtual_memory:
            with self._lock:
                self._tags.add(tag)

    @contextlib.contextmanager
    def region(self, tag: Any) -> Iterator[None]:
        self.declare(tag)
        parent = self._parent_mm()
        token = self._region.set(tag)
        with self._lock:
            if parent._nregions == 0:
                # the torch bridge's nogil path cannot see regions: send it through malloc
                self._via_python_before = parent._via_python
                parent._via_python = True
            parent._nregions += 1
        try:
            yield
        finally:
            self._region.reset(token)
            with self._lock:
                parent._nregions -= 1
                if parent._nregions == 0:
                    parent._via_python = parent._hooks or parent._tags is not None
                    self._via_python_before = None

    # --- sleep and wake ----------------------------------------------------------------------
    def sleep(self, tags: Any, backup: Any = True) -> int:
        """See MemoryManager.sleep."""
        wanted = self._tag_list(tags, "tags")
        copy = self._backup_set(backup, wanted)
        released = 0
        for tag in wanted:
            pool = self._pools.get(tag)
            if pool is None or pool.closed or pool.asleep_tag is not None:
                continue
            released += self._sleep_one(tag, pool, tag in copy)
        return released

    def _sleep_one(self, tag: Any, pool: Any, backup: bool) -> int:
        exp: SleepableSegments = pool.expandable_segments
        with pool._slow:
            # refuse the tag's requests first: a cache hit must not hand out a block whose
            # pages are about to go (every request now reaches the slow path, which refuses)
            pool.hold_requests(tag)
            saved = Backups.empty()
            try:
                pool.collect_pending_frees(wait=True)
                pool.pool.flush_front_caches()
                self._device.synchronize()      # the bytes backed up are final
                if backup:
                    saved = Backups.take(pool, self._device)
                released = exp.sleep()
            except BaseException:
                saved.drop()
                pool.serve_requests()
                raise
            self._backups[tag] = saved
            pool._growth.reserved_changed()     # pressure, and the ledger: the bytes are free
        return released

    def wake(self, tags: Any = None) -> int:
        """See MemoryManager.wake."""
        if tags is None:
            wanted = [t for t, p in list(self._pools.items()) if p.asleep_tag is not None]
        else:
            wanted = self._tag_list(tags, "tags")
        mapped = 0
        for tag in wanted:
            pool = self._pools.get(tag)
            if pool is None or pool.closed or pool.asleep_tag is None:
                continue
            mapped += self._wake_one(tag, pool)
        return mapped

    def _wake_one(self, tag: Any, pool: Any) -> int:
        exp: SleepableSegments = pool.expandable_segments
        growth = pool._growth
        parent = self._parent_mm()

        def allowed(nbytes: int) -> bool:
            ok = False
            for attempt in range(2):
                reserved = _device_bytes(pool)
                if growth.shared is not None:
                    growth.shared.begin_miss()
                free = self._device.mem_get_info()[0]
                ok = exp._mm.segment_allowed(nbytes, reserved, free)
                if ok or attempt:
                    break
                # the parent's cache, the other tags' and other managers' may make room
                if not (parent.release_idle_cache(reason=f"waking tag {tag!r}")
                        + peers.release_peer_caches(pool)):
                    break
            return ok

        with pool._slow:
            try:
                mapped = exp.wake(allowed)
            except WakeRefused as exc:
                if growth.shared is not None:
                    growth.shared.sync()        # drop a claim the refusal left
                raise self._wake_oom(tag, pool, exc) from None
            self._backups.pop(tag, Backups.empty()).restore(pool, self._device)
            pool.serve_requests()
            growth.reserved_changed()
        return mapped

    def _wake_oom(self, tag: Any, pool: Any, exc: WakeRefused) -> OutOfMemoryError:
        free, total = self._device.mem_get_info()
        reason = (f"waking tag {tag!r} needs {format_bytes(exc.nbytes)}: {exc.reason}; the tag "
                  f"stays asleep with its backup, a later wake() can succeed")
        shared = pool._growth.shared
        if shared is not None and shared.active:
            reason += "; " + shared.describe()
        return OutOfMemoryError(exc.nbytes, device=self._device.device_string, free=free,
                                total=total, limit=self._parent_mm().usable_memory,
                                reason=reason)

    def _tag_list(self, tags: Any, what: str) -> list[Any]:
        """One tag or several as a list of declared sleep tags (InvalidInputError otherwise)."""
        if not self._device.supports_virtual_memory:
            raise UnsupportedOperationError(self._no_vm_reason())
        if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
            tags = [tags]
        out = list(dict.fromkeys(tags))
        if not out:
            raise InvalidInputError(f"{what} must name at least one tag")
        for tag in out:
            try:
                known = tag in self._tags
            except TypeError:
                known = False
            if not known:
                raise InvalidInputError(
                    f"tag {tag!r} is not a sleep tag of this manager: allocate its memory "
                    f"inside mm.region({tag!r}) first (known: {sorted(map(repr, self._tags))})")
        return out

    def _backup_set(self, backup: Any, wanted: list[Any]) -> set[Any]:
        if backup is True:
            return set(wanted)
        if backup is False:
            return set()
        if isinstance(backup, (str, bytes)) or not isinstance(backup, Iterable):
            raise InvalidInputError(f"backup must be True, False or the tags to back up, got "
                                    f"{type(backup).__name__} {backup!r}")
        chosen = set(backup)
        extra = chosen - set(wanted)
        if extra:
            raise InvalidInputError(f"backup names tags that are not being put to sleep: "
                                    f"{sorted(map(repr, extra))}")
        return chosen

    # --- figures -----------------------------------------------------------------------------
    def asleep_bytes(self) -> int:
        return sum(p._growth.expandable.asleep_bytes for p in self.pools()
                   if p.asleep_tag is not None)

    def backup_bytes(self) -> int:
        return sum(b.nbytes for b in list(self._backups.values()))

    def states(self) -> list[TagState]:
        """Each sleep tag with a pool: asleep or not, its bytes on the device, slept, backed
        up."""
        out = []
        for tag, pool in list(self._pools.items()):
            if pool.closed:
                continue
            exp = pool.expandable_segments
            backups = self._backups.get(tag)
            out.append(TagState(tag=tag, asleep=pool.asleep_tag is not None,
                                device_bytes=_device_bytes(pool),
                                in_use_bytes=pool.pool.in_use_bytes,
                                asleep_bytes=exp.asleep_bytes if exp.sleeping else 0,
                                backup_bytes=backups.nbytes if backups else 0))
        return out

    # --- the parent's cache control and close ------------------------------------------------
    def empty_cache(self) -> int:
        return sum(p.empty_cache() for p in self.pools())

    def close(self) -> None:
        for tag, backups in list(self._backups.items()):
            backups.drop()
        self._backups.clear()
        for pool in list(self._pools.values()):
            pool.close()


def _device_bytes(pool: Any) -> int:
    """What a tag pool holds from the device now (slept bytes excluded)."""
    exp = pool.expandable_segments
    return pool.pool.reserved_bytes + (exp.held_bytes if exp is not None else 0)
