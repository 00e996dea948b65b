"""Expandable segments: large-pool segments whose pages are mapped, unmapped and moved.

Used on a device with virtual memory (cuda, sim) unless ``MemoryConfig(segments="plain")``: a
large-pool miss does not ask the driver for a new segment. Each stream gets a reserved address
range (as large as the manager's usable memory: address space costs nothing) that the pool sees
as one segment; its memory is physical handles, each mapped at one offset (``_Segment.maps``).
The driver maps, unmaps and releases a handle whole, so the pool moves and trims whole handles
only: larger handles cost fewer driver calls, but a handle that a live block touches can
neither move nor go back. Inside a segment a range is live, free (mapped, cached) or unmapped
(a hole: no physical memory; the pool's unmapped state, pool_pages.pyx).

How large the handles are is the segment policy (``MemoryConfig.segment_policy``,
docs/segments.md): ``tight`` makes handles of ``tight_handle_size`` (one page by default) and
always compacts as below; ``fast`` makes one handle per miss and never moves
pages; ``auto``, the default, does what ``fast`` does while there is room and what ``tight``
does near the limits (:mod:`gpumem.manager.handle_sizing` holds the rule).

A miss (:meth:`ExpandableSegments.grow`) asks the pool where mapping the fewest pages makes
the request fit: into a hole joined with its free neighbours, or at the segment's end joined
with its free tail. When it compacts, the pages come first from the free whole pages elsewhere
in the stream's segments (**stitching**: whole free handles are unmapped there, leaving a hole, and mapped
where the request needs them; no new physical memory; at a segment's end a moved handle may
be larger than needed, the surplus becoming a free tail), and only the rest is created. All
handles of one miss are mapped by one ``vm_map_many`` (a cuMemMap per handle, one
cuMemSetAccess for the range). Memory only moves between segments of the one stream whose
heap holds its free block, and the device is synchronized first only when that stream still
has work queued (:meth:`_drain` says why). When a stream's reservation is used up and no hole
fits, it gets another reservation.

Memory goes back handle by handle, and only when asked: freed memory stays mapped and cached
until :meth:`ExpandableSegments.trim` (empty_cache, shrink, the cache cap, pressure responses
and the OOM ladder, through ``SegmentGrowth.release_cached``) unmaps and releases every handle
that lies wholly in free blocks, inside segments too (the same stream rule decides whether it
synchronizes first); a segment without live blocks is detached by the pool and released whole
(:meth:`release`). What an error keeps from going back stays counted and is retried
(:mod:`gpumem.manager.page_release`), and so are the pages a miss is moving, which the pool's
count leaves out while they move: every limit check sees them (``held_bytes``).

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
from array import array
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumem.errors import DriverError, DriverOutOfMemory, InvalidInputError
from gpumem.manager.handle_sizing import HandleSizing
from gpumem.manager.page_release import PageRelease

if TYPE_CHECKING:
    from gpumem.manager.growth import Growth

__all__ = ["ExpandableSegments", "STITCH_RATIO"]

# Per-page driver costs (the published A100 figures, gpumem_sim CUDA_DRIVER_COSTS_A100, 2 MiB
# pages, in us): making a page where a request needs it costs cuMemCreate + cuMemMap +
# cuMemSetAccess, moving one there costs cuMemUnmap + cuMemMap + cuMemSetAccess (a single page:
# no range to share the access call with). On the H200 measured on 2026-11-27 (the default
# CUDA_DRIVER_COSTS) a move costs more than a creation (64.2 against 50.1 us: cuMemCreate is
# 9 us there), so the derivation below has no positive answer and a stitch is bought for
# tightness, never for time; the threshold stays at the A100 value until issue #19 settles it.
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
    #: keep the mapping boundaries for the pool (not needed while every handle is one page:
    #: the pool's page grid is then the same)
    track_bounds: bool = False
    maps: dict[int, tuple[int, int]] = field(default_factory=dict)  # offset -> (handle, bytes)
    mapped: int = 0                 # bytes mapped (the sum over maps)
    _ends: dict[int, int] = field(default_factory=dict)   # boundary -> mappings starting/ending there
    _bounds: array = field(default_factory=lambda: array("Q"))   # its keys, ascending

    def add(self, offset: int, handle: int, nbytes: int) -> None:
        self.maps[offset] = (handle, nbytes)
        self.mapped += nbytes
        if self.track_bounds:
            self._bump(offset, 1)
            self._bump(offset + nbytes, 1)

    def take(self, offset: int) -> tuple[int, int]:
        handle, nbytes = self.maps.pop(offset)
        self.mapped -= nbytes
        if self.track_bounds:
            self._bump(offset, -1)
            self._bump(offset + nbytes, -1)
        return handle, nbytes

    def _bump(self, at: int, by: int) -> None:
        count = self._ends.get(at, 0) + by
        if count and at not in self._ends:
            insort(self._bounds, at)
        elif not count:
            self._bounds.pop(bisect_left(self._bounds, at))
        if count:
            self._ends[at] = count
        else:
            del self._ends[at]

    def bounds(self) -> array | None:
        """Where the mappings start and end, ascending (None: every page is one); the pool
        moves and trims whole mappings only."""
        return self._bounds if self.track_bounds else None

    def mappings_in(self, offset: int, size: int) -> list[tuple[int, int]]:
        """``[(offset, bytes), ...]`` of the whole mappings that tile [offset, offset + size)."""
        out, end = [], offset + size
        while offset < end:
            n = self.maps[offset][1]
            out.append((offset, n))
            offset += n
        return out


#: (segment, offset, bytes) of a mapping taken from where it was (to move or to release)
_Taken = tuple[_Segment, int, int]


class ExpandableSegments:
    """The expandable segments of one manager (see the module docstring)."""

    def __init__(self, growth: Growth) -> None:
        self._mm = growth                   # the manager's segment growth (its Growth calls)
        self._dev = growth.device
        self.page = self._dev.vm_granularity()
        #: how large the handles are and when to compact (MemoryConfig.segment_policy)
        self.sizing = HandleSizing(growth, self.page)
        self.roomy_growths = 0                         # misses served the cheap way
        self.tight_growths = 0                         # misses served compacting
        self._segments: dict[int, _Segment] = {}     # handle -> segment
        self._by_stream: dict[int, list[int]] = {}   # stream -> its segments' handles, oldest first
        self.driver_calls = 0                          # vm_* calls made (figures, tests)
        self.segment_events = 0                        # segments adopted or released whole
        self.stitched_bytes = 0                        # mapped memory moved instead of created
        self.stitch_syncs = 0                          # synchronize() before moves or trims
        #: what was not given back yet, and the pages a growth is moving (held_bytes)
        self._out = PageRelease(self._dev, self._call)

    # --- queries ---------------------------------------------------------------------------------
    def owns(self, handle: int) -> bool:
        return handle in self._segments

    def mapped_bytes(self) -> int:
        with self._mm.lock:
            return sum(s.mapped for s in self._segments.values())

    def layout(self) -> dict[int, tuple[int, int]]:
        """``{handle: (mapped bytes, reserved bytes)}`` for snapshots and the invariant check."""
        with self._mm.lock:
            return {h: (s.mapped, s.reserved) for h, s in self._segments.items()}

    def extents(self) -> dict[int, int]:
        """``{handle: address span in use}`` (the pool's segment size; a floor for
        :meth:`trim`)."""
        with self._mm.lock:
            return {s["handle"]: s["size"] for s in self._mm.pool.segments()
                    if s["handle"] in self._segments}

    def holds_empty(self) -> bool:
        """Whether a segment has no page mapped (all holes: trim() frees its reservation)."""
        return any(not s.maps for s in self._segments.values())

    def pages(self, handle: int) -> list[int]:
        """Offsets of the mapped pages of segment ``handle`` (tests, the invariant check)."""
        with self._mm.lock:
            seg = self._segments[handle]
            return sorted(o for off, (_, n) in seg.maps.items()
                          for o in range(off, off + n, self.page))

    def mappings(self, handle: int) -> list[tuple[int, int]]:
        """``[(offset, bytes), ...]`` of segment ``handle``'s mappings, one per physical handle
        (tests)."""
        with self._mm.lock:
            return sorted((off, n) for off, (_, n) in self._segments[handle].maps.items())

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
            mapped = (self._map_range(seg, offset, size, keep, stream, at_end, nbytes)
                      if size else 0)
            if mapped is None:
                return None
            if at_end and size:
                buf = mm.alloc_in_grown_segment(seg.address, mapped, nbytes, stream, tag)
                if buf is None:                     # a hit took the free tail: keep the pages
                    self._fill(seg, offset, mapped, stream)
            else:
                if size:
                    self._fill(seg, offset, mapped, stream)
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
            # only when host memory for a block record runs out: give the memory back
            self._out.unmap_release(seg, seg.mappings_in(offset, size))
            raise MemoryError("the pool could not record mapped pages")

    def _take_mappings(self, target: _Segment, nbytes: int, stream: int, keep: tuple[int, int],
                       room: int | None) -> list[_Taken]:
        """Whole free mappings of the stream's segments, marked unmapped in the pool, for a
        range of ``nbytes`` (not from the free blocks in ``keep``, which the planned fill
        joins). ``room``: None when the mappings must fit in ``nbytes`` (a hole); else they
        may pass it (the segment's end), the last one by at most ``room - nbytes`` bytes."""
        out: list[_Taken] = []
        got = 0
        # first mappings that split no free block, then those worth the bytes they strand
        for ratio in (0, STITCH_RATIO):
            for handle in self._by_stream.get(stream, ()):
                if got >= nbytes:
                    break                       # enough; the room check below still applies
                seg = self._segments[handle]
                ranges = self._mm.pool.carve_free_pages(
                    handle, self.page, nbytes - got, stream=stream,
                    keep=keep if seg is target else (0, 0), ratio=ratio,
                    bounds=seg.bounds(), overshoot=room is not None)
                for off, n in ranges:
                    for o, m in seg.mappings_in(off, n):
                        out.append((seg, o, m))
                        got += m
        if room is not None and got > room:
            # past the reservation's end: the largest surplus goes back to the pool
            while out and got - out[-1][2] >= nbytes:
                seg, o, m = out.pop()
                self._refill([(seg, o, m)], stream)
                got -= m
            if got > room:
                self._refill(out, stream)
                out = []
        return out

    def _map_range(self, seg: _Segment, offset: int, size: int, keep: tuple[int, int],
                   stream: int, at_end: bool, request: int) -> int | None:
        """Map at least ``size`` bytes at ``offset`` of ``seg`` for a ``request``-byte miss:
        free mappings moved from elsewhere first, then new handles for the rest. Returns the
        bytes mapped (more than ``size`` only at the end, when a moved mapping was larger than
        needed or a per-growth handle was rounded up), or None (nothing changed) when the
        limits or the driver refuse; other errors propagate after the rollback."""
        pool = self._mm.pool
        room = seg.reserved - offset if at_end else None
        free = self._dev.mem_get_info()[0] if self.sizing.policy != "tight" else None
        step = self.sizing.cheap_step(size, request, room, free)
        roomy = step is not None
        # roomy: no page moves (a move costs the driver more than a new handle, H200 table)
        sources = [] if roomy else self._take_mappings(seg, size, stream, keep, room)
        moved = sum(n for _, _, n in sources)
        # the carve lowered pool.reserved_bytes, but the device still holds these pages and
        # the manager holds them again once they are mapped here: they count (held_bytes)
        self._out.moving = moved
        try:
            return self._map_taken(seg, offset, size, stream, sources, moved, step, free)
        finally:
            self._out.moving = 0

    def _map_taken(self, seg: _Segment, offset: int, size: int, stream: int,
                   sources: list[_Taken], moved: int, step: int | None,
                   free: int | None) -> int | None:
        """_map_range once the mappings to move are taken: check the limits against what the
        manager holds after the step (what it holds now, the moved pages included, plus the
        new handles), then map."""
        pool = self._mm.pool
        roomy = step is not None
        new = max(size - moved, 0)
        if (new and not roomy and self._mm.config.release_before_grow
                and self._mm.device_bytes() + new > pool.peak_reserved_bytes):
            # past the high-water mark: idle small-pool segments go back to the device first
            # (the large pool cannot use them); release_before_grow's rule across the pools
            if self._mm.release_cached(new, reason="release before expandable growth",
                                       small=True):
                free = None                 # read again: the release made room
        if new:
            if free is None:
                free = self._dev.mem_get_info()[0]
            if roomy:
                new = step                  # nothing moved: the step computed for `size`
            if not self._mm.segment_allowed(new, self._mm.device_bytes(), free):
                self._refill(sources, stream)
                return None
        if roomy:
            self.roomy_growths += 1
        else:
            self.tight_growths += 1
        loose: list[tuple[int, int, _Taken | None]] = []    # (handle, bytes, origin)
        done = 0
        try:
            if sources:
                self._drain((stream,))
            for src, off, n in sources:
                self._call(self._dev.vm_unmap, src.address + off, n)
                handle, _ = src.take(off)
                loose.append((handle, n, (src, off, n)))
                done += 1
            for n in self.sizing.handle_sizes(new, roomy):
                loose.append((self._call(self._dev.vm_create, n), n, None))
            # one call maps every handle of the range (moved ones first, then the new one)
            # and grants access to the range at once; on failure none of them is mapped
            self._map_many(seg.address + offset, [(h, n) for h, n, _ in loose])
        except BaseException as exc:
            self._roll_back(loose, sources[done:], stream)
            if isinstance(exc, DriverOutOfMemory):
                return None
            raise
        at = offset
        for handle, n, _ in loose:
            seg.add(at, handle, n)
            at += n
        self.stitched_bytes += moved
        return moved + new

    def _roll_back(self, loose: list[tuple[int, int, _Taken | None]], untouched: list[_Taken],
                   stream: int) -> None:
        """Undo a failed _map_range (nothing of it is mapped at the target: vm_map_many is all
        or nothing): moved mappings go back where they were (released if that is refused too);
        the new handle is released; carved mappings never unmapped are free blocks again."""
        back = list(untouched)
        unplaced = []
        for handle, n, origin in loose:
            if origin is not None:
                src, off, _ = origin
                try:
                    self._call(self._dev.vm_map, src.address + off, n, handle)
                except Exception:                   # noqa: BLE001 (a rollback goes on)
                    pass                            # released below: it stays a hole
                else:
                    src.add(off, handle, n)
                    back.append(origin)
                    continue
            unplaced.append((handle, n))
        try:
            self._out.release_handles(unplaced)
        finally:
            self._refill(back, stream)

    def _refill(self, taken: list[_Taken], stream: int) -> None:
        """Carved mappings that are still (or again) mapped become free blocks again."""
        for src, off, n in taken:
            self._fill(src, off, n, stream)

    def _grow_new(self, nbytes: int, stream: int, tag: Any) -> Any:
        """grow() for a stream without room: reserve a segment and map its first pages (one
        handle)."""
        mm = self._mm
        extra = _round_up(mm.pool.round_size(nbytes), self.page)
        free, _ = self._dev.mem_get_info()
        if not mm.segment_allowed(extra, mm.device_bytes(), free):
            return None
        size = _round_up(max(mm.hold, extra), self.page)
        step = self.sizing.cheap_step(extra, nbytes, size, free)
        roomy = step is not None
        if roomy:
            extra = step
            self.roomy_growths += 1
        else:
            self.tight_growths += 1
        try:
            address = self._call(self._dev.vm_reserve, size)
        except DriverOutOfMemory:
            return None
        seg = _Segment(address, size, stream,
                       track_bounds=self.sizing.tracks_bounds)
        created: list[tuple[int, int]] = []
        try:
            for n in self.sizing.handle_sizes(extra, roomy):
                created.append((self._call(self._dev.vm_create, n), n))
            self._map_many(address, created)
        except BaseException as exc:
            try:
                self._out.release_handles(created)      # none of them is mapped
            finally:
                self._unreserve(seg)
            if isinstance(exc, DriverOutOfMemory):
                return None
            raise
        at = 0
        for handle, n in created:
            seg.add(at, handle, n)
            at += n
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
        """Undo a new segment the pool never saw: its mappings, then its reservation."""
        self._out.give_back(seg)

    def _call(self, fn: Any, *args: Any) -> Any:
        self.driver_calls += 1
        return fn(*args)

    def _map_many(self, address: int, handles: list[tuple[int, int]]) -> None:
        """Map ``(handle, bytes)`` pairs side by side from ``address``: a cuMemMap each and
        one cuMemSetAccess for the range (all or nothing)."""
        self.driver_calls += len(handles) + 1
        self._dev.vm_map_many(address, handles)

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

    # --- giving memory back ----------------------------------------------------------------------
    def trimmable(self) -> int:
        """Bytes :meth:`trim` would return now (no change, no driver call). Never waits: it
        runs on free() (even from a Buffer's destructor), so while another thread holds the
        manager's lock it answers 0 and a later free() enforces the cap."""
        if not self._mm.lock.acquire(blocking=False):
            return 0
        try:
            return sum(self._mm.pool.free_page_bytes(h, self.page, s.bounds())
                       for h, s in self._segments.items())
        finally:
            self._mm.lock.release()

    def trim(self, max_bytes: int | None = None, *, floor: dict[int, int] | None = None) -> int:
        """Unmap and release the mappings that lie wholly in free blocks (inside segments too)
        until at least ``max_bytes`` are returned (all when None); with ``floor`` (handle ->
        offset) none below it. The bytes returned. A driver that refuses to unmap or free a
        handle warns (as a refused segment free does): what it kept stays cached or held for
        a later retry."""
        released = self._out.release_held()
        drained = False
        pool = self._mm.pool
        for seg in list(self._segments.values()):
            if max_bytes is not None and released >= max_bytes:
                break
            budget = () if max_bytes is None else (max_bytes - released,)
            ranges = pool.carve_free_pages(seg.address, self.page, *budget,
                                           min_offset=(floor or {}).get(seg.address, 0),
                                           bounds=seg.bounds(), overshoot=True)
            taken = [m for off, n in ranges for m in seg.mappings_in(off, n)]
            if not taken:
                if not seg.maps and pool.detach_if_unused(seg.address):
                    self.release(seg.address)     # all holes (its pages moved): address only
                continue
            if not drained:
                try:
                    # the carved blocks may sit in any stream's heap
                    self._drain(pool.streams_with_free(_NO_STREAM) + [seg.stream])
                except BaseException:
                    self._refill([(seg, o, n) for o, n in taken], seg.stream)
                    raise
                drained = True
            unmapped = []
            for i, (offset, n) in enumerate(taken):
                try:
                    self._call(self._dev.vm_unmap, seg.address + offset, n)
                except BaseException as exc:
                    # no queued work uses them: any stream may have the memory back
                    self._refill([(seg, o, m) for o, m in taken[i:]], seg.stream)
                    released += self._out.release_handles(unmapped)
                    if not isinstance(exc, DriverError):
                        raise
                    warnings.warn(f"gpumem: {self._dev.device_string} refused to unmap a "
                                  f"mapping ({exc}); it stays cached", RuntimeWarning)
                    return released
                unmapped.append(seg.take(offset))
            released += self._out.release_handles(unmapped)
            if not seg.maps and pool.detach_if_unused(seg.address):
                self.release(seg.address)
        return released

    def release_held(self) -> int:
        """Retry what was not given back (:meth:`PageRelease.release_held`); the bytes freed."""
        return self._out.release_held()

    @property
    def held_pages(self) -> int:
        """Handles not given back yet (retried by the next trim or close())."""
        return self._out.held_pages

    @property
    def held_bytes(self) -> int:
        """Bytes the device holds for this manager that the pool does not count
        (MemoryStats.held_bytes; :attr:`PageRelease.held_bytes`)."""
        return self._out.held_bytes

    def release(self, handle: int) -> int:
        """A segment without live blocks that the pool detached: unmap and release its
        mappings, free its reservation. Returns the bytes freed. What fails stays counted
        (held_bytes) and is retried by the next trim or close(): a handle the driver refuses
        to free is held; a segment whose mappings or reservation could not all be given back
        is kept for the retry. A driver refusal warns; another error is raised after."""
        seg = self._segments.pop(handle)
        self.segment_events += 1
        handles = self._by_stream.get(seg.stream, [])
        if handle in handles:
            handles.remove(handle)
            if not handles:
                del self._by_stream[seg.stream]
        return self._out.give_back(seg)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
