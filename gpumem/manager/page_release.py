"""Giving the physical handles of expandable segments back to the driver, exception-safe.

:class:`PageRelease` unmaps and releases the handles of one manager's expandable segments
(:mod:`gpumem.manager.expandable`) and keeps count of what it could not give back, so that no
handle is ever outside the accounting, whatever a driver call raises (a driver's refusal, or an
error from elsewhere, such as a shared card's ledger lock timing out, issue 39):

- ``held``: unmapped handles not freed (the driver refused, or a call raised before saying);
- ``orphans``: segments the pool detached whose mappings or reservation could not all be
  given back; both are retried by :meth:`PageRelease.release_held` (each trim, and close());
- ``moving``: bytes of the pages a growth took out of the pool's count to move them (set by
  the growth while it runs; the device holds them throughout).

``held_bytes`` sums them: the device holds these bytes for the manager, the pool does not count
them (MemoryStats.held_bytes; ``SegmentGrowth.device_bytes`` adds them to the pool's
reserved bytes for every limit check). An error other than the driver's refusal is raised
once every handle of the call was tried and counted; a refusal warns.

Thread safety: used under the manager's ``_slow`` lock only, like its ExpandableSegments.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from gpumem.errors import DriverError

__all__ = ["PageRelease"]


class PageRelease:
    """What one manager's expandable segments could not give back yet (module docstring)."""

    def __init__(self, device: Any, call: Callable[..., Any]) -> None:
        self._dev = device
        self._call = call                         # counts the driver calls (ExpandableSegments)
        self.held: list[tuple[int, int]] = []     # (handle, bytes): unmapped, not freed
        self.orphans: list[Any] = []              # detached segments not wholly given back
        self.moving = 0                           # bytes a running growth is moving

    def unmap_release(self, seg: Any, mappings: list[tuple[int, int]]) -> int:
        """Unmap and free the mappings ``[(offset, bytes), ...]``; the bytes freed (see
        release_handles)."""
        unmapped: list[tuple[int, int]] = []
        try:
            for offset, n in mappings:
                self._call(self._dev.vm_unmap, seg.address + offset, n)
                unmapped.append(seg.take(offset))
        finally:
            freed = self.release_handles(unmapped)
        return freed

    def release_handles(self, handles: list[tuple[int, int]]) -> int:
        """vm_release each unmapped ``(handle, bytes)``; the bytes released. A handle the
        driver refuses to free is held (unmapped, still allocated) and freed again by the next
        trim or close(). Exception-safe: whatever a release raises, every handle is tried and
        each one not freed is held; an error other than the driver's refusal is raised once
        they all are accounted."""
        refused = []
        freed = 0
        error: BaseException | None = None
        for handle, n in handles:
            try:
                self._call(self._dev.vm_release, handle)
            except BaseException as exc:
                refused.append((handle, n))        # not known to be freed: held, retried
                if error is None or isinstance(error, DriverError):
                    error = exc
            else:
                freed += n
        if refused:
            self.held.extend(refused)
            if not isinstance(error, DriverError):
                raise error                         # type: ignore[misc]
            warnings.warn(f"gpumem: {self._dev.device_string} refused to free "
                          f"{len(refused)} page handle(s) ({error}); they stay allocated and "
                          f"are freed again by the next trim or close()", RuntimeWarning)
        return freed

    def release_held(self) -> int:
        """Free the handles the driver refused to free before, and give back what is left of
        segments whose release failed part-way; the bytes freed now. What fails again stays
        held (a driver refusal without a new warning; another error is raised once every
        handle was tried)."""
        held, self.held = self.held, []
        orphans, self.orphans = self.orphans, []
        freed = 0
        error: BaseException | None = None
        for handle, n in held:
            try:
                self._call(self._dev.vm_release, handle)
            except BaseException as exc:
                self.held.append((handle, n))
                if not isinstance(exc, DriverError) and error is None:
                    error = exc
            else:
                freed += n
        for seg in orphans:
            try:
                freed += self.give_back(seg, warn=False)
            except BaseException as exc:            # an orphan again
                if error is None:
                    error = exc
        if error is not None:
            raise error
        return freed

    @property
    def held_pages(self) -> int:
        """Handles not given back yet, retried later: unmapped ones the driver refused to
        free, and those of segments whose release failed part-way (their reservation counts
        as one)."""
        return len(self.held) + sum(len(s.maps) or 1 for s in self.orphans)

    @property
    def held_bytes(self) -> int:
        """Bytes the device holds for this manager that the pool does not count
        (MemoryStats.held_bytes): the held handles, and, while a growth runs, the pages it is
        moving (taken out of the pool's count until they are mapped at their target)."""
        return (sum(n for _, n in self.held) + sum(s.mapped for s in self.orphans)
                + self.moving)

    def give_back(self, seg: Any, *, warn: bool = True) -> int:
        """Unmap and release ``seg``'s mappings, then free its reservation; the bytes freed.
        On any error what is left of ``seg`` joins the orphans that release_held retries: a
        driver refusal warns (when ``warn``), another error is raised."""
        freed = 0
        error: BaseException | None = None
        try:
            freed = self.unmap_release(seg, sorted((o, n) for o, (_, n) in seg.maps.items()))
        except BaseException as exc:
            error = exc
        kept = True
        if not seg.maps:        # all unmapped (their handles freed or held): the range goes
            try:
                self._call(self._dev.vm_free, seg.address, seg.reserved)
                kept = False
            except BaseException as exc:
                error = error or exc
        if error is not None:
            if kept:
                self.orphans.append(seg)
            if not isinstance(error, DriverError):
                raise error
            if warn and kept:
                warnings.warn(f"gpumem: {self._dev.device_string} refused to unmap or free an "
                              f"expandable segment ({error}); it is given back again by the "
                              f"next trim or close()", RuntimeWarning)
        return freed
