"""A best-fit allocator of address ranges inside one window (the simulated device's address space).

It is deliberately a plain, obviously-correct structure (two sorted lists, linear best-fit scan):
the sim is a test double, and its address space must fragment the way a device without virtual
memory management does, so that a pool under test meets honest "no contiguous range" failures.
"""
from __future__ import annotations

import bisect

__all__ = ["RangeAllocator"]


class RangeAllocator:
    """Free ranges of ``[0, size)`` as offsets; ``alloc`` carves best-fit, ``free`` coalesces.

    Not thread-safe by itself: the owning :class:`~gpumem_sim.device.SimDevice` holds its lock.
    """

    __slots__ = ("size", "_starts", "_lengths")

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0] if size > 0 else []
        self._lengths: list[int] = [size] if size > 0 else []

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes`` (the smallest one that fits, lowest address on a
        tie), or ``None`` when no contiguous range is large enough."""
        best = -1
        best_len = 0
        for i, length in enumerate(self._lengths):
            if length >= nbytes and (best < 0 or length < best_len):
                best, best_len = i, length
                if length == nbytes:
                    break
        if best < 0:
            return None
        start = self._starts[best]
        if best_len == nbytes:
            del self._starts[best]
            del self._lengths[best]
        else:
            self._starts[best] = start + nbytes
            self._lengths[best] = best_len - nbytes
        return start

    def free(self, start: int, nbytes: int) -> None:
        """Give ``[start, start + nbytes)`` back, merging it with free neighbours."""
        i = bisect.bisect_left(self._starts, start)
        # Overlap with a free neighbour means a double free inside the simulator: a bug here.
        if i < len(self._starts) and self._starts[i] < start + nbytes:
            raise AssertionError(f"range [{start}, {start + nbytes}) overlaps a free range")
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start:
            raise AssertionError(f"range [{start}, {start + nbytes}) overlaps a free range")
        merge_prev = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_next = i < len(self._starts) and start + nbytes == self._starts[i]
        if merge_prev and merge_next:
            self._lengths[i - 1] += nbytes + self._lengths[i]
            del self._starts[i]
            del self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += nbytes
        elif merge_next:
            self._starts[i] = start
            self._lengths[i] += nbytes
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, nbytes)

    def largest(self) -> int:
        """Length of the largest free range (0 when full)."""
        return max(self._lengths, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every free range, in address order."""
        return list(zip(self._starts, self._lengths))
