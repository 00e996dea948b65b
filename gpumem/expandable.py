"""Expandable segments: large-pool segments that grow in place by mapping pages at their end.

With ``MemoryConfig(expandable_segments=True)`` on a device with virtual memory (cuda, sim), a
large-pool miss does not ask the driver for a new segment. Each stream gets one reserved address
range (as large as the manager's usable memory: address space costs nothing); the pool sees it as
a segment whose size is the part mapped so far. A miss maps just enough pages (of the device's VM
granularity; one page handle per chunk of up to ``MAX_CHUNK_PAGES`` pages, so a big growth
costs two driver calls per chunk, not per page) to extend the segment's free tail to
the request, and the pool carves the request from that tail. Requests that a free block in the middle could serve never
reach here: the pool's best-fit serves them, as for plain segments.

Memory goes back in chunks: :meth:`ExpandableSegments.trim` cuts every segment's free tail back
to a chunk boundary and unmaps and releases the chunks past it (empty_cache, shrink, the cache cap,
pressure responses and the OOM ladder all come through the manager's ``_release_cached``); a
segment that is wholly free is released whole (its pages, then its reservation).

Failures roll back completely: when a page cannot be created or mapped, or the pool refuses the
growth, the pages made for this growth are unmapped and released before the error (or None,
for the OOM ladder) is returned, so the pool, its counters and the device are as before.

Thread safety: an :class:`ExpandableSegments` belongs to one MemoryManager and its state is
guarded by that manager's ``_slow`` lock (an RLock): growth, trims and releases run with it held
(the miss path, the release paths, close()), and the queries (:meth:`layout`,
:meth:`mapped_bytes`, :meth:`trimmable`, which snapshots and a ``free()`` above the cache cap
call from any thread) take it. The pool's C lock is never held while calling the driver, so a
cache hit (which takes only the pool's lock) can take a free tail while a growth maps pages
for it: :meth:`grow` then maps pages that hold the request alone and asks the pool again.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumem.errors import DriverError, DriverOutOfMemory

if TYPE_CHECKING:
    from gpumem.manager import MemoryManager

__all__ = ["ExpandableSegments", "MAX_CHUNK_PAGES"]

#: A growth maps its pages as handles of at most this many pages: fewer driver calls (gpt2_train:
#: 3,369 -> 633 with 2 MiB pages) against a coarser trim (a tail goes back in whole chunks).
MAX_CHUNK_PAGES = 16


@dataclass
class _Segment:
    address: int                    # the reservation; also the pool's segment handle and base
    reserved: int                   # bytes of address space
    stream: int
    chunks: list[tuple[int, int]] = field(default_factory=list)   # (page handle, bytes), in
    mapped: int = 0                                                # address order from 0


class ExpandableSegments:
    """The expandable segments of one manager (see the module docstring)."""

    def __init__(self, manager: MemoryManager) -> None:
        self._mm = manager
        self._dev = manager.device
        self.page = self._dev.vm_granularity()
        self.chunk = self.page * MAX_CHUNK_PAGES
        self._segments: dict[int, _Segment] = {}     # handle -> segment
        self._by_stream: dict[int, int] = {}          # stream -> handle
        self.driver_calls = 0                          # vm_* calls made (figures, tests)
        self.segment_events = 0                        # segments adopted or released whole

    # --- queries ---------------------------------------------------------------------------------
    def owns(self, handle: int) -> bool:
        return handle in self._segments

    def mapped_bytes(self) -> int:
        with self._mm._slow:
            return sum(s.mapped for s in self._segments.values())

    def layout(self) -> dict[int, tuple[int, int]]:
        """``{handle: (mapped bytes, reserved bytes)}`` for snapshots and the invariant check."""
        with self._mm._slow:
            return {h: (s.mapped, s.reserved) for h, s in self._segments.items()}

    # --- growth ----------------------------------------------------------------------------------
    def grow(self, nbytes: int, stream: int, tag: Any) -> Any:
        """A Buffer of ``nbytes`` from this stream's segment grown at its end, or None when the
        limits or the driver refuse (nothing changed then). Non-OOM driver errors propagate,
        after the rollback."""
        pool = self._mm.pool
        handle = self._by_stream.get(stream)
        if handle is None:
            return self._grow_new(nbytes, stream, tag)
        seg = self._segments[handle]
        rounded = pool.round_size(nbytes)
        free, _ = self._dev.mem_get_info()          # before this growth maps anything
        # The free tail is read once, without the pool lock held across the driver calls, and
        # a cache hit on this stream (the hot path takes the pool lock only) can take part of
        # it meanwhile: the pool then refuses. The second pass maps pages that hold the
        # request alone, which the pool accepts whatever became of the tail.
        tail = pool.tail_free_bytes(handle, stream)
        start = seg.mapped
        for extra in dict.fromkeys((_round_up(max(rounded - tail, 0), self.page),
                                    _round_up(rounded, self.page))):
            if (not self._mm._segment_allowed(extra, pool.reserved_bytes, free)
                    or start + extra > seg.reserved):   # the reservation is usable memory
                break
            try:
                self._map(seg, start + extra - seg.mapped)
            except DriverOutOfMemory:
                break
            except BaseException:
                self._unmap_to(seg, start)
                raise
            # a MemoryError here comes after the pool adopted the pages as a free tail
            buf = self._mm._alloc_in_grown_segment(handle, extra, nbytes, stream, tag)
            if buf is not None:
                return buf
        self._unmap_to(seg, start)
        return None

    def _grow_new(self, nbytes: int, stream: int, tag: Any) -> Any:
        """grow() for a stream without a segment: reserve one and map its first pages."""
        mm = self._mm
        extra = _round_up(mm.pool.round_size(nbytes), self.page)
        free, _ = self._dev.mem_get_info()
        if not mm._segment_allowed(extra, mm.pool.reserved_bytes, free):
            return None
        size = _round_up(max(mm.usable_memory, extra), self.page)
        try:
            address = self._call(self._dev.vm_reserve, size)
        except DriverOutOfMemory:
            return None
        seg = _Segment(address, size, stream)
        try:
            self._map(seg, extra)
        except BaseException as exc:
            self._unreserve(seg)
            if isinstance(exc, DriverOutOfMemory):
                return None
            raise
        try:
            buf = mm._alloc_in_new_segment(address, address, extra, nbytes, stream, tag)
        except MemoryError:                # the pool did not adopt the segment
            self._unreserve(seg)
            raise
        self._segments[address] = seg
        self._by_stream[stream] = address
        self.segment_events += 1
        return buf

    def _unreserve(self, seg: _Segment) -> None:
        """Undo a new segment the pool never saw: its pages, then its reservation."""
        self._unmap_to(seg, 0)
        self._call(self._dev.vm_free, seg.address, seg.reserved)

    def _call(self, fn: Any, *args: Any) -> Any:
        self.driver_calls += 1
        return fn(*args)

    def _map(self, seg: _Segment, nbytes: int) -> None:
        """Map ``nbytes`` more at the segment's end, in chunks; on failure the chunks mapped so
        far stay in seg.chunks (the caller unmaps them) and the handle being mapped is
        released."""
        while nbytes:
            n = min(nbytes, self.chunk)
            h = self._call(self._dev.vm_create, n)
            try:
                self._call(self._dev.vm_map, seg.address + seg.mapped, n, h)
            except BaseException:
                self._call(self._dev.vm_release, h)
                raise
            seg.chunks.append((h, n))
            seg.mapped += n
            nbytes -= n

    def _unmap_to(self, seg: _Segment, keep: int) -> None:
        """Unmap and release chunks from the end until ``keep`` bytes (a chunk boundary) stay."""
        while seg.mapped > keep:
            h, n = seg.chunks[-1]
            self._call(self._dev.vm_unmap, seg.address + seg.mapped - n, n)
            seg.chunks.pop()
            seg.mapped -= n
            self._call(self._dev.vm_release, h)

    def _cut(self, seg: _Segment) -> int:
        """The smallest chunk boundary past which the segment is free (its size if none)."""
        start = self._mm.pool.free_tail_offset(seg.address)
        end = seg.mapped
        for _, n in reversed(seg.chunks):
            if end - n < start or end - n == 0:
                break
            end -= n
        return end

    # --- giving memory back ----------------------------------------------------------------------
    def trimmable(self) -> int:
        """Bytes :meth:`trim` would return now (no change, no driver call). Never waits: it
        runs on free() (even from a Buffer's destructor), so while another thread holds the
        manager's lock it answers 0 and a later free() enforces the cap."""
        if not self._mm._slow.acquire(blocking=False):
            return 0
        try:
            return sum(s.mapped - self._cut(s) for s in self._segments.values())
        finally:
            self._mm._slow.release()

    def trim(self, max_bytes: int | None = None, *, floor: dict[int, int] | None = None) -> int:
        """Cut free tails back to chunk boundaries, unmapping and releasing the chunks past
        them, until ``max_bytes`` are returned (all when None); with ``floor`` (handle -> bytes,
        a chunk boundary) no segment is cut below it. The bytes returned."""
        released = 0
        synced = False
        for seg in list(self._segments.values()):
            if max_bytes is not None and released >= max_bytes:
                break
            cut = max(self._cut(seg), (floor or {}).get(seg.address, 0))
            if cut >= seg.mapped or self._mm.pool.trim_segment_tail(seg.address, cut) != cut:
                continue                      # nothing free past a boundary, or a hit took it
            if not synced:
                self._dev.synchronize()       # no pending work may touch what is unmapped
                synced = True
            released += seg.mapped - cut
            self._unmap_to(seg, cut)
        return released

    def release(self, handle: int) -> int:
        """A wholly free segment the pool detached: unmap and release its pages, free its
        reservation. Returns the bytes that were mapped. A driver refusal warns: the pages
        it kept are lost to this manager (the driver still holds them)."""
        seg = self._segments.pop(handle)
        self.segment_events += 1
        if self._by_stream.get(seg.stream) == handle:
            del self._by_stream[seg.stream]
        mapped = seg.mapped
        try:
            self._unmap_to(seg, 0)
            self._call(self._dev.vm_free, seg.address, seg.reserved)
        except DriverError as exc:
            warnings.warn(f"gpumem: {self._dev.device_string} refused to unmap or free an "
                          f"expandable segment ({exc})", RuntimeWarning)
        return mapped


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
