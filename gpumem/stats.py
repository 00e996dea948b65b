"""MemoryStats: a snapshot of a manager's counters."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from gpumem.units import format_bytes

__all__ = ["MemoryStats"]


@dataclass(frozen=True)
class MemoryStats:
    """Counters of one manager at one moment.

    Invariant (tested): ``total_allocated_bytes == in_use_bytes + pooled_bytes``, where
    ``in_use_bytes`` counts live blocks at their *rounded* size; the rounding itself is
    ``in_use_bytes - requested_bytes``. CPU-fallback buffers are not device memory and are
    counted apart (``fallback_bytes``).
    """

    device: str
    total_allocated_bytes: int      # held from the device in segments ("reserved")
    in_use_bytes: int               # live blocks, rounded sizes
    requested_bytes: int            # live blocks, as requested
    pooled_bytes: int               # cached free bytes, ready for reuse
    peak_bytes: int                 # peak in_use_bytes since creation / reset_peak_stats()
    peak_reserved_bytes: int
    largest_free_block: int
    pool_hits: int
    pool_misses: int
    cpu_fallbacks: int
    fallback_bytes: int
    active_buffers: int
    num_allocs: int
    num_frees: int
    num_segments: int
    segments_created: int
    segments_released: int
    num_ooms: int
    # freed blocks waiting for other streams (Buffer.record_stream): counted in in_use_bytes,
    # not in active_buffers
    pending_free_bytes: int = 0

    def hit_rate(self) -> float:
        """Share of device allocations served from the cache (0.0 when none yet)."""
        total = self.pool_hits + self.pool_misses
        return self.pool_hits / total if total else 0.0

    def fragmentation_ratio(self) -> float:
        """1 - largest free block / cached bytes: 0 when the cache is one piece (or empty),
        near 1 when it is shredded into pieces too small for big requests."""
        if self.pooled_bytes == 0:
            return 0.0
        return 1.0 - self.largest_free_block / self.pooled_bytes

    @property
    def rounding_bytes(self) -> int:
        return self.in_use_bytes - self.requested_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate()
        d["fragmentation_ratio"] = self.fragmentation_ratio()
        return d

    def __str__(self) -> str:
        fb = format_bytes
        return (f"{self.device}: reserved {fb(self.total_allocated_bytes)} in "
                f"{self.num_segments} segment(s), in use {fb(self.in_use_bytes)} "
                f"({self.active_buffers} buffers), cached {fb(self.pooled_bytes)}, "
                f"peak {fb(self.peak_bytes)}; hits {self.pool_hits}, misses {self.pool_misses} "
                f"({self.hit_rate():.1%}), fragmentation {self.fragmentation_ratio():.1%}, "
                f"CPU fallbacks {self.cpu_fallbacks}, OOMs {self.num_ooms}")
