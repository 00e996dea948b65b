"""Sleep and wake of one tag pool's expandable segments (docs/sleep_and_wake.md).

A tag pool (:mod:`gpumem.manager.tag_pools`) keeps all its memory in expandable segments:
reserved address ranges whose physical handles are mapped at fixed offsets. Sleeping gives
every physical handle back to the device and keeps the reservations, so every buffer keeps
its address; waking creates handles of the same sizes and maps them at the same offsets.
:class:`SleepableSegments` is :class:`~gpumem.manager.expandable.ExpandableSegments` with those
two calls and the rules that keep the pool consistent meanwhile:

- ``sleep``: the cache first goes back as a trim does (whole free handles), then the device is
  synchronized (queued work may still use the live bytes), every remaining mapping is unmapped
  (all or nothing: one the driver refuses to unmap puts back those already unmapped) and its
  handle released. The mappings stay in ``_Segment.maps`` with handle ``None``: the pool's view
  of its blocks and the mapping boundaries do not change, so the pool needs no new state.
- while asleep nothing may reuse the slept ranges: ``trim`` and ``trimmable`` skip them (they
  would carve free blocks whose pages are not mapped), ``grow`` refuses, and ``release`` of a
  segment whose every block was freed while asleep frees its reservation only.
- ``wake``: mappings that hold no live block any more (their buffers were freed while asleep)
  are not mapped again: the pool marks them unmapped (their addresses are released). The rest
  is asked of ``allowed(bytes)`` (the limits, the shared group's budget and its hand-back),
  created, then mapped; any refusal releases what this wake made and leaves the segments
  asleep exactly as before (all or nothing), raising the driver's or the limits' refusal.

``held_bytes`` reads what the device holds beyond the pool's reserved figure; while asleep the
pool still counts the slept bytes as reserved, so it is less by ``asleep_bytes`` (and may be
negative): the stats and the shared group's ledger (``pool.reserved_bytes + held_bytes``) then
show the slept bytes as free at once.

Thread safety: as ExpandableSegments: every call runs under the owning manager's slow-path
lock (``sleep`` and ``wake`` are called with it held).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from gpumem.errors import DriverError, DriverOutOfMemory
from gpumem.manager.expandable import ExpandableSegments, _Segment

if TYPE_CHECKING:
    from gpumem.manager.growth import Growth

__all__ = ["SleepableSegments", "WakeRefused"]


class WakeRefused(Exception):
    """``wake`` could not get the memory: ``reason`` says who refused (nothing changed)."""

    def __init__(self, nbytes: int, reason: str) -> None:
        super().__init__(reason)
        self.nbytes = nbytes
        self.reason = reason


class SleepableSegments(ExpandableSegments):
    """The expandable segments of a tag pool, which can sleep and wake (module docstring)."""

    def __init__(self, growth: Growth) -> None:
        super().__init__(growth)
        self.sleeping = False
        self.asleep_bytes = 0               # bytes of the slept mappings still to wake
        self.sleeps = 0                     # completed sleep() and wake() calls (figures)
        self.wakes = 0

    # --- sleep -------------------------------------------------------------------------------
    def sleep(self) -> int:
        """Give every physical handle back to the device, keeping the reservations; the bytes
        released (the cache trimmed first included). A driver that refuses to unmap leaves
        the segments awake (what was unmapped is mapped again) and raises."""
        if self.sleeping:
            return 0
        released = self.trim()
        live = [(seg, off, h, n) for seg in self._segments.values()
                for off, (h, n) in sorted(seg.maps.items())]
        if live:
            self._dev.synchronize()         # no queued work may touch what is unmapped
        unmapped: list[tuple[_Segment, int, int, int]] = []
        try:
            for seg, off, h, n in live:
                self._call(self._dev.vm_unmap, seg.address + off, n)
                unmapped.append((seg, off, h, n))
        except BaseException:
            for seg, off, h, n in unmapped:
                try:
                    self._call(self._dev.vm_map, seg.address + off, n, h)
                except DriverError:         # its bytes are lost: the handle goes back
                    seg.take(off)
                    self._out.release_handles([(h, n)])
            raise
        handles = []
        for seg, off, h, n in unmapped:
            seg.maps[off] = (None, n)       # asleep: boundaries and sizes kept for wake
            handles.append((h, n))
        # a handle the driver refuses to free is held (and counted) until a later retry
        released += self._out.release_handles(handles)
        self.asleep_bytes = sum(n for *_, n in unmapped)
        self.sleeping = True
        self.sleeps += 1
        return released

    # --- wake --------------------------------------------------------------------------------
    def wake(self, allowed: Callable[[int], bool]) -> int:
        """Map new handles where the slept ones were; the bytes mapped. ``allowed(nbytes)``
        decides whether the limits let the pool take them (it may ask others to hand memory
        back). Raises :class:`WakeRefused`, or the driver's error, with nothing changed."""
        if not self.sleeping:
            return 0
        self._drop_freed()
        todo = [(seg, off, n) for seg in self._segments.values()
                for off, (h, n) in sorted(seg.maps.items()) if h is None]
        need = sum(n for *_, n in todo)
        if need and not allowed(need):
            raise WakeRefused(need, "the limits refused it")
        created: list[tuple[_Segment, int, int, int]] = []     # (segment, offset, handle, n)
        mapped: list[tuple[int, int]] = []                     # (address, bytes) per mapping
        try:
            for seg, off, n in todo:
                created.append((seg, off, self._call(self._dev.vm_create, n), n))
            for seg, run in _runs(created):
                start = run[0][1]
                self._map_many(seg.address + start, [(h, n) for _, _, h, n in run])
                mapped.extend((seg.address + off, n) for _, off, _, n in run)
        except BaseException as exc:
            for address, n in mapped:
                try:
                    self._call(self._dev.vm_unmap, address, n)
                except DriverError:
                    pass                    # its handle is then refused below, and held
            self._out.release_handles([(h, n) for _, _, h, n in created])
            if isinstance(exc, DriverOutOfMemory):
                raise WakeRefused(need, f"the driver refused it ({exc})") from exc
            raise
        for seg, off, h, n in created:
            seg.maps[off] = (h, n)
        self.asleep_bytes = 0
        self.sleeping = False
        self.wakes += 1
        return need

    def _drop_freed(self) -> None:
        """Slept mappings that no live block touches any more (freed while asleep): the pool
        marks them unmapped and they are forgotten (no driver call: nothing is mapped)."""
        pool = self._mm.pool
        for seg in list(self._segments.values()):
            ranges = pool.carve_free_pages(seg.address, self.page, bounds=seg.bounds(),
                                           overshoot=True)
            for off, n in ranges:
                for o, m in seg.mappings_in(off, n):
                    handle, _ = seg.take(o)
                    if handle is not None:  # never: every mapping sleeps; keep it cached
                        self._refill([(seg, o, m)], seg.stream)
                    else:
                        self.asleep_bytes -= m
            if not seg.maps and pool.detach_if_unused(seg.address):
                self.release(seg.address)

    # --- what must not touch slept ranges ------------------------------------------------------
    def grow(self, nbytes: int, stream: int, tag: Any) -> Any:
        return None if self.sleeping else super().grow(nbytes, stream, tag)

    def trim(self, max_bytes: int | None = None, *, floor: dict[int, int] | None = None) -> int:
        if self.sleeping:
            return self.release_held()
        return super().trim(max_bytes, floor=floor)

    def trimmable(self) -> int:
        return 0 if self.sleeping else super().trimmable()

    def release(self, handle: int) -> int:
        """As ExpandableSegments.release; slept mappings have no handle left to give back."""
        seg = self._segments.get(handle)
        if seg is not None:
            for off, (h, n) in list(seg.maps.items()):
                if h is None:
                    seg.take(off)
                    self.asleep_bytes -= n
        return super().release(handle)

    @property
    def held_bytes(self) -> int:
        """Bytes the device holds beyond the pool's reserved figure: handles it refused to
        free, less the slept bytes (which the pool still counts as reserved)."""
        return super().held_bytes - self.asleep_bytes

    @property
    def unreleased_bytes(self) -> int:
        """The handles not given back yet (ExpandableSegments.held_bytes, slept bytes not
        taken off): what a sleeping tag pool still holds on the device."""
        return super().held_bytes


def _runs(created: list[tuple[_Segment, int, int, int]]
          ) -> list[tuple[_Segment, list[tuple[_Segment, int, int, int]]]]:
    """Side-by-side mappings of one segment grouped: each run is mapped by one vm_map_many (a
    map per handle and one access call for the range)."""
    out: list[tuple[_Segment, list[tuple[_Segment, int, int, int]]]] = []
    for item in created:
        seg, off, _, _ = item
        if out and out[-1][0] is seg:
            last = out[-1][1][-1]
            if last[1] + last[3] == off:
                out[-1][1].append(item)
                continue
        out.append((seg, [item]))
    return out
