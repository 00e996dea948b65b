"""How large an expandable segment's physical handles are, and when a miss compacts: the
segment policy (``MemoryConfig.segment_policy``; docs/segments.md).

``tight`` makes handles of ``MemoryConfig.tight_handle_size`` (one page by default) and always
compacts (pages moved into the gap, release before growing); ``fast`` makes one handle per miss,
rounded up to a plain large segment, and never compacts before the OOM ladder; ``auto`` is fast
while there is room and tight near the limits (:meth:`HandleSizing.cheap_step` is the rule).
:class:`~gpumem.manager.expandable.ExpandableSegments` asks it once per miss.

Thread safety: like its ExpandableSegments, used under the manager's ``_slow`` lock only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumem.manager.growth import Growth

__all__ = ["HandleSizing", "ROOMY_HANDLE_SHARE"]

#: ``segments="auto"``: a cheap growth's handle is at most this share of the room left. A
#: handle is moved or given back only whole, so one that a live block pins strands its whole
#: size; 1/32 keeps such a handle within 3 % of what is left, the margin auto may need on a
#: card beyond what the tight policy needs (issue 31's bound; a design bound, not fitted)
ROOMY_HANDLE_SHARE = 1 / 32


class HandleSizing:
    """The segment policy of one manager's expandable segments (see the module docstring)."""

    def __init__(self, growth: Growth, page: int) -> None:
        self._growth = growth
        cfg = growth.config
        self.page = page
        #: MemoryConfig.segment_policy: "auto", "tight" or "fast"
        self.policy = cfg.segment_policy
        #: the handles of the tight regime (MemoryConfig.tight_handle_size; whole pages)
        self.handle_size = max(cfg.tight_handle_size // page, 1) * page
        #: the cheap regime grows in multiples of a plain large segment (20 MiB by default,
        #: PyTorch's large page): as many growths as plain segments make cuMemAllocs
        self.quantum = _round_up(cfg.large_segment, page)
        self.cache_high = 0                            # the most cached at a miss (cheap_step)

    @property
    def tracks_bounds(self) -> bool:
        """Whether handles may span several pages (the pool is then given their bounds)."""
        return self.policy != "tight" or self.handle_size > self.page

    def cheap_step(self, need: int, request: int, room: int | None, free: int | None
                   ) -> int | None:
        """The bytes of the one handle a miss that maps ``need`` bytes makes when it is served
        the cheap way (no page moves, no release before growing; ``growth_step`` at a
        segment's end, ``need`` in a hole); None when it compacts instead (pages moved into
        the gap, one-page handles that can move and go back later). ``fast`` always cheap,
        ``tight`` never. ``auto`` cheap while both hold (docs/segments.md, "The rule"):

        - the room left after the growth could still hold the largest cache this manager has
          had (its workload's own measure of what its shapes leave free at once): until then
          the cache does not decide whether the workload fits, so squeezing it buys nothing;
        - the handle is at most ROOMY_HANDLE_SHARE of the room left: a handle moves and goes
          back only whole, so one that a live block pins strands at most its own size.
        """
        if self.policy == "tight":
            return None
        step = self.growth_step(need, request, room, free) if room is not None else need
        if self.policy == "fast":
            return step
        growth = self._growth
        pool = growth.pool
        cache = pool.reserved_bytes - pool.in_use_bytes
        if cache > self.cache_high:
            self.cache_high = cache
        left = min(growth.usable_memory - growth.device_bytes(),
                   free - growth.config.min_free_bytes)
        return step if left - step >= self.cache_high and step <= left * ROOMY_HANDLE_SHARE \
            else None

    def growth_step(self, new: int, request: int, room: int, free: int) -> int:
        """Bytes of the one handle a cheap miss makes at a segment's end (``new`` are needed,
        ``room`` fit in the reservation): at least what a plain segment would hold for the
        request (for one below ``large_threshold``, which plain segments share with others
        of its size), rounded up to the quantum (a plain large segment), so that growths are
        as few as plain segments' cuMemAllocs and the surplus is at most one quantum. ``new``
        when the limits would refuse the larger handle but not it."""
        pool = self._growth.pool
        shared = pool.segment_size(request)
        want = max(new, shared if shared > pool.round_size(request) else 0)
        bigger = min(_round_up(want, self.quantum), room)
        # rounding up is worth it only if the room is there now: no other process is asked
        if bigger > new and not self._growth.segment_allowed(
                bigger, self._growth.device_bytes(), free, ask_others=False):
            return new
        return max(bigger, new)

    def handle_sizes(self, nbytes: int, roomy: bool) -> list[int]:
        """The sizes of the handles that new memory of ``nbytes`` (whole pages) is made of:
        one when the miss is roomy, else handles of the tight regime's size."""
        if roomy:
            return [nbytes] if nbytes else []
        return [min(self.handle_size, nbytes - o) for o in range(0, nbytes, self.handle_size)]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
