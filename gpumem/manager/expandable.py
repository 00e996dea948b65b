"""Expandable segments: large-pool segments whose pages are mapped, unmapped and moved.

On by default on a device with virtual memory (cuda, sim; ``MemoryConfig(
expandable_segments=False)`` or ``GPUMEM_EXPANDABLE_SEGMENTS=0`` turns it off), a large-pool miss
does not ask the driver for a new segment. Each stream gets a reserved address range (as large
as the manager's usable memory: address space costs nothing) that the pool sees as one segment;
every page (the device's VM granularity) has its own physical handle, so single pages can be
unmapped and moved (the driver maps and unmaps whole handles only: a handle of several pages
could move only when all of it is free, which measured 1.08-1.17 on traces where pages must
move, docs/expandable_segments.md). Inside a segment a range is live, free (mapped, cached) or
unmapped (a hole: no physical memory; the pool's unmapped block state, pool_pages.pyx).

A miss (:meth:`ExpandableSegments.grow`) asks the pool where mapping the fewest pages makes
the request fit: into a hole joined with its free neighbours, or at the segment's end joined
with its free tail. The pages come first from the free whole pages elsewhere in the stream's
segments (**stitching**: they are unmapped there, leaving a hole, and mapped where the request
needs them; no new physical memory), and only the rest are created. All pages of one miss are
mapped by one ``vm_map_many`` (a cuMemMap per page, one cuMemSetAccess for the range). Pages only
move between segments of the one stream whose heap holds their free block, and the device is
synchronized first only when that stream still has work queued (:meth:`_drain` says why). When
a stream's reservation is used up and no hole fits, it gets another reservation.

Memory goes back page by page, and only when asked: freed pages stay mapped and cached until
:meth:`ExpandableSegments.trim` (empty_cache, shrink, the cache cap, pressure responses and the
OOM ladder, through ``SegmentGrowth.release_cached``) unmaps and releases every free whole
page, inside segments too (the same stream rule decides whether it synchronizes first); a
segment without live blocks is detached by the pool and released whole (:meth:`release`).

Failures roll back completely: when a page cannot be created, unmapped or mapped, the pages of
this miss go back where they came from (or are released when that is refused too) and the pool
gets back its free pages, so the pool, its counters and the device are as before (or hold less
memory); a non-OOM driver error propagates after the rollback, an OOM returns None.

Thread safety: an :class:`ExpandableSegments` belongs to one MemoryManager and its state is
guarded by that manager's ``_slow`` lock (an RLock): growth, trims and releases run with it held
(the miss path, the release paths, close()), and the queries (:meth:`layout`,
:meth:`mapped_bytes`, :meth:`trimmable`, which snapshots and a ``free()`` above the cache cap
call from any thread) take it. Only holders of ``_slow`` change the pool's unmapped state; the
pool's C lock is never held while calling the driver, so a cache hit (which takes only the pool's
lock) can take a free block meanwhile: the pages mapped for a miss then stay as cached free
memory and the miss is planned again.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumem.errors import DriverError, DriverOutOfMemory, InvalidInputError

if TYPE_CHECKING:
    from gpumem.manager.growth import Growth

__all__ = ["ExpandableSegments", "STITCH_RATIO"]

# Per-page driver costs (gpumem_sim.driver_costs.CUDA_DRIVER_COSTS, A100, 2 MiB pages, in us):
# making a page where a request needs it costs cuMemCreate + cuMemMap + cuMemSetAccess, moving
# one there costs cuMemUnmap + cuMemMap + cuMemSetAccess (a single page: no range to share the
# access call with).
_CREATE_US = 193.32 + 1.45 + 35.99
_MOVE_US = 25.63 + 1.45 + 35.99

#: A free block between live ones (neither end on a page boundary) gives its w bytes of whole
#: pages to a stitch only when w >= STITCH_RATIO * s, s being the free bytes left stranded
#: around them. Blocks with an end on a page boundary strand nothing and always give. The
#: derivation, in driver time per byte: moving w instead of creating it saves
#: w * (create - move) now. The cut leaves a hole between two small free pieces, so the block
#: is whole again only after w is moved back (w * move) and meanwhile its s stranded bytes
#: may have to be made anew elsewhere (s * create). Moving pays when
#: w * (create - move) >= w * move + s * create, that is w / s >= create / (create - 2 move):
#: 2.21 with the table above. docs/expandable_segments.md shows the figures for other values.
STITCH_RATIO = _CREATE_US / (_CREATE_US - 2 * _MOVE_US)

#: plans tried for one miss before it is left to the OOM ladder (a concurrent hit took the
#: free neighbours each time)
_ATTEMPTS = 3

#: no stream: streams_with_free() then lists every stream that caches free blocks
_NO_STREAM = (1 << 64) - 1


@dataclass(eq=False)
class _Segment:
    address: int                    # the reservation; also the pool's segment handle and base
    reserved: int                   # bytes of address space
    stream: int
    pages: dict[int, int] = field(default_factory=dict)   # offset -> handle of a mapped page


class ExpandableSegments:
    """The expandable segments of one manager (see the module docstring)."""

    def __init__(self, growth: Growth) -> None:
        self._mm = growth                   # the manager's segment growth (its Growth calls)
        self._dev = growth.device
        self.page = self._dev.vm_granularity()
        self._segments: dict[int, _Segment] = {}     # handle -> segment
        self._by_stream: dict[int, list[int]] = {}   # stream -> its segments' handles, oldest first
        self.driver_calls = 0                          # vm_* calls made (figures, tests)
        self.segment_events = 0                        # segments adopted or released whole
        self.stitched_bytes = 0                        # pages moved instead of created
        self.stitch_syncs = 0                          # synchronize() before moves or trims
        self._held: list[int] = []                     # unmapped pages the driver would not free

    # --- queries ---------------------------------------------------------------------------------
    def owns(self, handle: int) -> bool:
        return handle in self._segments

    def mapped_bytes(self) -> int:
        with self._mm.lock:
            return sum(len(s.pages) for s in self._segments.values()) * self.page

    def layout(self) -> dict[int, tuple[int, int]]:
        """``{handle: (mapped bytes, reserved bytes)}`` for snapshots and the invariant check."""
        with self._mm.lock:
            return {h: (len(s.pages) * self.page, s.reserved) for h, s in self._segments.items()}

    def extents(self) -> dict[int, int]:
        """``{handle: address span in use}`` (the pool's segment size; a floor for
        :meth:`trim`)."""
        with self._mm.lock:
            return {s["handle"]: s["size"] for s in self._mm.pool.segments()
                    if s["handle"] in self._segments}

    def holds_empty(self) -> bool:
        """Whether a segment has no page mapped (all holes: trim() frees its reservation)."""
        return any(not s.pages for s in self._segments.values())

    def pages(self, handle: int) -> list[int]:
        """Offsets of the mapped pages of segment ``handle`` (tests, the invariant check)."""
        with self._mm.lock:
            return sorted(self._segments[handle].pages)

    # --- growth ----------------------------------------------------------------------------------
    def grow(self, nbytes: int, stream: int, tag: Any) -> Any:
        """A Buffer of ``nbytes`` for a large-pool miss, or None when the limits or the driver
        refuse (nothing changed then). Non-OOM driver errors propagate, after the rollback."""
        mm = self._mm
        for _ in range(_ATTEMPTS):
            plan = self._plan(nbytes, stream)
            if plan is None:                        # no segment, or every reservation used up
                return self._grow_new(nbytes, stream, tag)
            seg, offset, size, keep, at_end = plan
            if size and not self._map_range(seg, offset, size, keep, stream):
                return None
            if at_end and size:
                buf = mm.alloc_in_grown_segment(seg.address, size, nbytes, stream, tag)
                if buf is None:                     # a hit took the free tail: keep the pages
                    self._fill(seg, offset, size, stream)
            else:
                if size:
                    self._fill(seg, offset, size, stream)
                buf = mm.alloc_cached(nbytes, stream, tag)
            if buf is not None:
                return buf
        return None

    def _plan(self, nbytes: int, stream: int) -> tuple[_Segment, int, int, tuple[int, int],
                                                          bool] | None:
        """``(segment, offset, bytes to map, keep, at_end)``: where in the stream's segments
        mapping the fewest pages fits the request (pool.plan_fill)."""
        best = None
        for handle in self._by_stream.get(stream, ()):
            seg = self._segments[handle]
            plan = self._mm.pool.plan_fill(handle, stream, nbytes, self.page, seg.reserved)
            if plan is not None and (best is None or plan[1] < best[2]):
                best = (seg, plan[0], plan[1], (plan[2], plan[3]), plan[4])
        return best

    def _fill(self, seg: _Segment, offset: int, size: int, stream: int) -> None:
        """The pool takes mapped [offset, offset + size) as a free block of ``stream``."""
        if not self._mm.pool.fill_unmapped(seg.address, offset, size, stream):
            # only when host memory for a block record runs out: give the pages back
            self._unmap_release(seg, range(offset, offset + size, self.page))
            raise MemoryError("the pool could not record mapped pages")

    def _take_pages(self, target: _Segment, count: int, stream: int,
                    keep: tuple[int, int]) -> list[tuple[_Segment, int]]:
        """Up to ``count`` free whole pages of the stream's segments, marked unmapped in the pool
        (not from the free blocks in ``keep``, which the planned fill joins)."""
        out: list[tuple[_Segment, int]] = []
        # first pages that split no free block, then pages worth the bytes they strand
        for ratio in (0, STITCH_RATIO):
            for handle in self._by_stream.get(stream, ()):
                if len(out) >= count:
                    return out
                seg = self._segments[handle]
                ranges = self._mm.pool.carve_free_pages(
                    handle, self.page, (count - len(out)) * self.page, stream=stream,
                    keep=keep if seg is target else (0, 0), ratio=ratio)
                out.extend((seg, o) for off, n in ranges for o in range(off, off + n, self.page))
        return out

    def _map_range(self, seg: _Segment, offset: int, size: int, keep: tuple[int, int],
                   stream: int) -> bool:
        """Map pages at [offset, offset + size) of ``seg``: moved ones first, then new ones.
        False (nothing changed) when the limits or the driver refuse; other errors propagate
        after the rollback."""
        pool = self._mm.pool
        count = size // self.page
        sources = self._take_pages(seg, count, stream, keep)
        new = (count - len(sources)) * self.page
        if (new and self._mm.config.release_before_grow
                and pool.reserved_bytes + new > pool.peak_reserved_bytes):
            # past the high-water mark: idle small-pool segments go back to the device first
            # (the large pool cannot use them); release_before_grow's rule across the pools
            self._mm.release_cached(new, reason="release before expandable growth", small=True)
        if new and not self._mm.segment_allowed(new, pool.reserved_bytes,
                                                 self._dev.mem_get_info()[0]):
            self._refill(sources, stream)
            return False
        loose: list[tuple[int, tuple[_Segment, int] | None]] = []    # (handle, origin)
        done = 0
        try:
            if sources:
                self._drain((stream,))
            for src, off in sources:
                self._call(self._dev.vm_unmap, src.address + off, self.page)
                loose.append((src.pages.pop(off), (src, off)))
                done += 1
            while len(loose) < count:
                loose.append((self._call(self._dev.vm_create, self.page), None))
            # one call maps every page of the range (moved ones first, then new ones) and
            # grants access to the range at once; on failure none of them is mapped
            self._map_many(seg.address + offset, [handle for handle, _ in loose])
        except BaseException as exc:
            self._roll_back(loose, sources[done:], stream)
            if isinstance(exc, DriverOutOfMemory):
                return False
            raise
        seg.pages.update(zip(range(offset, offset + size, self.page),
                             (handle for handle, _ in loose)))
        self.stitched_bytes += len(sources) * self.page
        return True

    def _roll_back(self, loose: list[tuple[int, Any]], untouched: list[tuple[_Segment, int]],
                   stream: int) -> None:
        """Undo a failed _map_range (nothing of it is mapped at the target: vm_map_many is all
        or nothing): moved pages go back where they were (released if that is refused too);
        new ones are released; carved pages never unmapped are free blocks again."""
        back = list(untouched)
        unplaced = []
        for handle, origin in loose:
            if origin is not None:
                src, off = origin
                try:
                    self._call(self._dev.vm_map, src.address + off, self.page, handle)
                except DriverError:
                    pass                            # released below: it stays a hole
                else:
                    src.pages[off] = handle
                    back.append(origin)
                    continue
            unplaced.append(handle)
        self._release_pages(unplaced)
        self._refill(back, stream)

    def _refill(self, pages: list[tuple[_Segment, int]], stream: int) -> None:
        """Carved pages that are still (or again) mapped become free blocks again."""
        for src, off in pages:
            self._fill(src, off, self.page, stream)

    def _grow_new(self, nbytes: int, stream: int, tag: Any) -> Any:
        """grow() for a stream without room: reserve a segment and map its first pages."""
        mm = self._mm
        extra = _round_up(mm.pool.round_size(nbytes), self.page)
        free, _ = self._dev.mem_get_info()
        if not mm.segment_allowed(extra, mm.pool.reserved_bytes, free):
            return None
        size = _round_up(max(mm.usable_memory, extra), self.page)
        try:
            address = self._call(self._dev.vm_reserve, size)
        except DriverOutOfMemory:
            return None
        seg = _Segment(address, size, stream)
        created: list[int] = []
        try:
            for _ in range(0, extra, self.page):
                created.append(self._call(self._dev.vm_create, self.page))
            self._map_many(address, created)
        except BaseException as exc:
            self._release_pages(created)           # none of them is mapped
            self._unreserve(seg)
            if isinstance(exc, DriverOutOfMemory):
                return None
            raise
        seg.pages.update(zip(range(0, extra, self.page), created))
        try:
            buf = mm.alloc_in_new_segment(address, address, extra, nbytes, stream, tag)
        except MemoryError:                # the pool did not adopt the segment
            self._unreserve(seg)
            raise
        self._segments[address] = seg
        self._by_stream.setdefault(stream, []).append(address)
        self.segment_events += 1
        return buf

    def _unreserve(self, seg: _Segment) -> None:
        """Undo a new segment the pool never saw: its pages, then its reservation."""
        self._unmap_release(seg, sorted(seg.pages))
        self._call(self._dev.vm_free, seg.address, seg.reserved)

    def _call(self, fn: Any, *args: Any) -> Any:
        self.driver_calls += 1
        return fn(*args)

    def _map_many(self, address: int, handles: list[int]) -> None:
        """Map ``handles`` (one page each) side by side from ``address``: a cuMemMap each and
        one cuMemSetAccess for the range (all or nothing)."""
        self.driver_calls += len(handles) + 1
        self._dev.vm_map_many(address, [(h, self.page) for h in handles])

    def _drain(self, streams: Any) -> None:
        """Make sure no queued work can still touch free memory cached for ``streams`` before
        it is unmapped. The rule (stream order): a free block in a stream's heap was freed on
        that stream, or handed to it once its first owner was idle (reclaim_idle) or its
        cross-stream uses had finished (deferred frees), so the only work that may still use
        its bytes is work queued on that stream before the free. cuMemUnmap is not
        stream-ordered: unmapping is safe once each such stream is idle. So ask the device (a
        query per stream) and synchronize only when one is busy, dead or unknown to it."""
        for s in streams:
            if self._mm.streams.is_dead(s):
                break
            try:
                if not self._dev.stream_idle(s):
                    break
            except (DriverError, InvalidInputError):   # destroyed behind the manager's back
                break
        else:
            return
        self._dev.synchronize()
        self.stitch_syncs += 1

    def _unmap_release(self, seg: _Segment, offsets: Any) -> int:
        """Unmap and free the pages at ``offsets``; the bytes freed (see _release_pages)."""
        unmapped: list[int] = []
        try:
            for offset in offsets:
                self._call(self._dev.vm_unmap, seg.address + offset, self.page)
                unmapped.append(seg.pages.pop(offset))
        finally:
            freed = self._release_pages(unmapped)
        return freed

    # --- giving memory back ----------------------------------------------------------------------
    def trimmable(self) -> int:
        """Bytes :meth:`trim` would return now (no change, no driver call). Never waits: it
        runs on free() (even from a Buffer's destructor), so while another thread holds the
        manager's lock it answers 0 and a later free() enforces the cap."""
        if not self._mm.lock.acquire(blocking=False):
            return 0
        try:
            return sum(self._mm.pool.free_page_bytes(h, self.page) for h in self._segments)
        finally:
            self._mm.lock.release()

    def trim(self, max_bytes: int | None = None, *, floor: dict[int, int] | None = None) -> int:
        """Unmap and release free whole pages (inside segments too) until ``max_bytes`` are
        returned (all when None); with ``floor`` (handle -> offset) no page below it. The
        bytes returned. A driver that refuses to unmap or free a page warns (as a refused
        segment free does): the pages it kept stay cached or held for a later retry."""
        released = self.release_held()
        drained = False
        pool = self._mm.pool
        for seg in list(self._segments.values()):
            if max_bytes is not None and released >= max_bytes:
                break
            budget = () if max_bytes is None else (_round_up(max_bytes - released, self.page),)
            ranges = pool.carve_free_pages(seg.address, self.page, *budget,
                                           min_offset=(floor or {}).get(seg.address, 0))
            offsets = [o for off, n in ranges for o in range(off, off + n, self.page)]
            if not offsets:
                if not seg.pages and pool.detach_if_unused(seg.address):
                    self.release(seg.address)     # all holes (its pages moved): address only
                continue
            if not drained:
                try:
                    # the carved blocks may sit in any stream's heap
                    self._drain(pool.streams_with_free(_NO_STREAM) + [seg.stream])
                except BaseException:
                    self._refill([(seg, o) for o in offsets], seg.stream)
                    raise
                drained = True
            unmapped = []
            for i, offset in enumerate(offsets):
                try:
                    self._call(self._dev.vm_unmap, seg.address + offset, self.page)
                except BaseException as exc:
                    # no queued work uses them: any stream may have the pages back
                    self._refill([(seg, o) for o in offsets[i:]], seg.stream)
                    released += self._release_pages(unmapped)
                    if not isinstance(exc, DriverError):
                        raise
                    warnings.warn(f"gpumem: {self._dev.device_string} refused to unmap a page "
                                  f"({exc}); it stays cached", RuntimeWarning)
                    return released
                unmapped.append(seg.pages.pop(offset))
            released += self._release_pages(unmapped)
            if not seg.pages and pool.detach_if_unused(seg.address):
                self.release(seg.address)
        return released

    def _release_pages(self, handles: list[int]) -> int:
        """vm_release each unmapped page; the bytes released. A page the driver refuses to
        free is held (unmapped, still allocated) and freed again by the next trim or close()."""
        refused = []
        error: DriverError | None = None
        for handle in handles:
            try:
                self._call(self._dev.vm_release, handle)
            except DriverError as exc:
                refused.append(handle)
                error = exc
        if refused:
            self._held.extend(refused)
            warnings.warn(f"gpumem: {self._dev.device_string} refused to free "
                          f"{len(refused)} page handle(s) ({error}); they stay allocated and "
                          f"are freed again by the next trim or close()", RuntimeWarning)
        return (len(handles) - len(refused)) * self.page

    def release_held(self) -> int:
        """Free the pages the driver refused to free before; the bytes freed now (the ones it
        refuses again stay held, without a new warning)."""
        held, self._held = self._held, []
        freed = 0
        for i, handle in enumerate(held):
            try:
                self._call(self._dev.vm_release, handle)
            except DriverError:
                self._held.append(handle)
            else:
                freed += self.page
        return freed

    @property
    def held_pages(self) -> int:
        """Pages unmapped but not yet freed: the driver refused to free them (retried later)."""
        return len(self._held)

    def release(self, handle: int) -> int:
        """A segment without live blocks that the pool detached: unmap and release its pages,
        free its reservation. Returns the bytes freed. A driver refusal warns: a page it
        refuses to free is held for a retry; one it refuses to unmap, and the reservation
        then, are lost to this manager (the driver still holds them)."""
        seg = self._segments.pop(handle)
        self.segment_events += 1
        handles = self._by_stream.get(seg.stream, [])
        if handle in handles:
            handles.remove(handle)
            if not handles:
                del self._by_stream[seg.stream]
        freed = 0
        try:
            freed = self._unmap_release(seg, sorted(seg.pages))
            self._call(self._dev.vm_free, seg.address, seg.reserved)
        except DriverError as exc:
            warnings.warn(f"gpumem: {self._dev.device_string} refused to unmap or free an "
                          f"expandable segment ({exc})", RuntimeWarning)
        return freed


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
