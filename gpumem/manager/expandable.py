"""Expandable segments: large-pool segments whose pages are mapped, unmapped and moved.

With ``MemoryConfig(expandable_segments=True)`` on a device with virtual memory (cuda, sim), a
large-pool miss does not ask the driver for a new segment. Each stream gets a reserved address
range (as large as the manager's usable memory: address space costs nothing) that the pool sees
as one segment; every page (the device's VM granularity) has its own physical handle, so single
pages can be unmapped and moved. Inside a segment a range is live, free (mapped, cached) or
unmapped (a hole: no physical memory; the pool's unmapped block state, pool_pages.pyx).

A miss (:meth:`ExpandableSegments.grow`) asks the pool where mapping the fewest pages makes
the request fit: into a hole joined with its free neighbours, or at the segment's end joined
with its free tail. The pages come first from the free whole pages elsewhere in the stream's
segments (**stitching**: they are unmapped there, leaving a hole, and mapped where the request
needs them; no new physical memory), and only the rest are created. Moving a page costs a
``device.synchronize()`` first (once per stitching miss): the page may still be in use by work
queued on the stream that freed its block. Pages only move between segments of the one stream
whose heap holds their free block. When a stream's reservation is used up and no hole fits, it
gets another reservation (another segment).

Memory goes back page by page: :meth:`ExpandableSegments.trim` (empty_cache, shrink, the cache
cap, pressure responses and the OOM ladder, through ``SegmentGrowth.release_cached``) unmaps
and releases every free whole page, inside segments too, after one ``device.synchronize()``; a
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

from gpumem.errors import DriverError, DriverOutOfMemory

if TYPE_CHECKING:
    from gpumem.manager.growth import Growth

__all__ = ["ExpandableSegments", "STITCH_RATIO"]

#: a free block between live ones gives its whole pages to a stitch only when they are at
#: least this many times the free bytes left stranded around them (1.75 + 1.25 MiB around
#: three 2 MiB pages of a 9 MiB block: no). Stranding more costs more new pages later than
#: it saves now. Measured on the shared traces (default and constrained presets, trims from
#: the top): 2 raises gpt2_generate from 1.018 to 1.045; 2.25 raises resnet50_train
#: constrained to 1.026; 2.75 and 3 leave resnet50_train at 1.022; 4 and higher raise
#: bert_varlen_infer to 1.034-1.038. 2.5 keeps every trace at or under 1.02.
STITCH_RATIO = 2.5

#: plans tried for one miss before it is left to the OOM ladder (a concurrent hit took the
#: free neighbours each time)
_ATTEMPTS = 3


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
        self.stitch_syncs = 0                          # device.synchronize() calls for moves

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
        free, _ = self._dev.mem_get_info()          # before this miss maps anything
        for _ in range(_ATTEMPTS):
            plan = self._plan(nbytes, stream)
            if plan is None:                        # no segment, or every reservation used up
                return self._grow_new(nbytes, stream, tag)
            seg, offset, size, keep, at_end = plan
            if size and not self._map_range(seg, offset, size, keep, stream, free):
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
                   stream: int, free: int) -> bool:
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
        if new and not self._mm.segment_allowed(new, pool.reserved_bytes, free):
            self._refill(sources, stream)
            return False
        loose: list[tuple[int, tuple[_Segment, int] | None]] = []    # (handle, origin)
        placed: list[tuple[int, int, tuple[_Segment, int] | None]] = []  # mapped in seg
        done = 0
        try:
            if sources:
                self._dev.synchronize()             # the stream's queued work may use them
                self.stitch_syncs += 1
            for src, off in sources:
                self._call(self._dev.vm_unmap, src.address + off, self.page)
                loose.append((src.pages.pop(off), (src, off)))
                done += 1
            for target in range(offset, offset + size, self.page):
                if loose:
                    handle, origin = loose.pop()
                else:
                    handle, origin = self._call(self._dev.vm_create, self.page), None
                try:
                    self._call(self._dev.vm_map, seg.address + target, self.page, handle)
                except BaseException:
                    loose.append((handle, origin))
                    raise
                seg.pages[target] = handle
                placed.append((target, handle, origin))
        except BaseException as exc:
            self._roll_back(seg, placed, loose, sources[done:], stream)
            if isinstance(exc, DriverOutOfMemory):
                return False
            raise
        self.stitched_bytes += len(sources) * self.page
        return True

    def _roll_back(self, seg: _Segment, placed: list[tuple[int, int, Any]],
                   loose: list[tuple[int, Any]], untouched: list[tuple[_Segment, int]],
                   stream: int) -> None:
        """Undo a failed _map_range: pages mapped at the target come off again; moved pages go
        back where they were (released if that is refused too); new ones are released; carved
        pages never unmapped are free blocks again."""
        for target, handle, origin in placed:
            del seg.pages[target]
            self._call(self._dev.vm_unmap, seg.address + target, self.page)
            loose.append((handle, origin))
        back = list(untouched)
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
            self._call(self._dev.vm_release, handle)
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
        try:
            for offset in range(0, extra, self.page):
                handle = self._call(self._dev.vm_create, self.page)
                try:
                    self._call(self._dev.vm_map, address + offset, self.page, handle)
                except BaseException:
                    self._call(self._dev.vm_release, handle)
                    raise
                seg.pages[offset] = handle
        except BaseException as exc:
            self._unreserve(seg)
            if isinstance(exc, DriverOutOfMemory):
                return None
            raise
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

    def _unmap_release(self, seg: _Segment, offsets: Any) -> None:
        for offset in offsets:
            self._call(self._dev.vm_unmap, seg.address + offset, self.page)
            self._call(self._dev.vm_release, seg.pages.pop(offset))

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
        bytes returned."""
        released = 0
        synced = False
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
            if not synced:
                try:
                    self._dev.synchronize()       # no pending work may touch what is unmapped
                except BaseException:
                    self._refill([(seg, o) for o in offsets], seg.stream)
                    raise
                synced = True
            for i, offset in enumerate(offsets):
                try:
                    self._call(self._dev.vm_unmap, seg.address + offset, self.page)
                except BaseException:
                    # the device is idle: any stream may have the pages back
                    self._refill([(seg, o) for o in offsets[i:]], seg.stream)
                    raise
                handle = seg.pages.pop(offset)
                released += self.page
                try:
                    self._call(self._dev.vm_release, handle)
                except DriverError as exc:
                    warnings.warn(f"gpumem: {self._dev.device_string} refused to release a "
                                  f"page ({exc}); the driver keeps it", RuntimeWarning)
            if not seg.pages and pool.detach_if_unused(seg.address):
                self.release(seg.address)
        return released

    def release(self, handle: int) -> int:
        """A segment without live blocks that the pool detached: unmap and release its pages,
        free its reservation. Returns the bytes that were mapped. A driver refusal warns: the
        pages it kept are lost to this manager (the driver still holds them)."""
        seg = self._segments.pop(handle)
        self.segment_events += 1
        handles = self._by_stream.get(seg.stream, [])
        if handle in handles:
            handles.remove(handle)
            if not handles:
                del self._by_stream[seg.stream]
        mapped = len(seg.pages) * self.page
        try:
            self._unmap_release(seg, sorted(seg.pages))
            self._call(self._dev.vm_free, seg.address, seg.reserved)
        except DriverError as exc:
            warnings.warn(f"gpumem: {self._dev.device_string} refused to unmap or free an "
                          f"expandable segment ({exc})", RuntimeWarning)
        return mapped


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
