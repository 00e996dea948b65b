"""``with manager.measure() as m:`` (gpumem.manager.measure): what changed inside a block and its peak.

Level: **real** (the real Cython pool and MemoryManager on gpumem_sim devices).
"""
from __future__ import annotations

import pytest

from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import ClosedManagerError, InvalidInputError, OutOfMemoryError
from gpumem.manager.measure import MeasuredStats
from gpumem.units import KiB, MiB

EXACT = dict(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False,
             track_allocations=False)


@pytest.fixture
def mm(sim_device):
    sim_device("1GiB")
    m = MemoryManager("sim:0", MemoryConfig(**EXACT))
    yield m
    m.close()


def test_counts_what_happened_inside_the_block(mm):
    keep = mm.malloc(3 * MiB)                          # before the block: not counted
    with mm.measure() as m:
        assert m.stats is None                         # set on exit
        bufs = [mm.malloc(4 * KiB) for _ in range(10)]
        for b in bufs[:6]:
            b.free()
    s = m.stats
    assert isinstance(s, MeasuredStats) and s.device == "sim:0"
    assert (s.num_allocs, s.num_frees, s.pool_misses, s.pool_hits) == (10, 6, 1, 9)
    assert s.pool_hits + s.pool_misses == s.num_allocs and s.hit_rate() == 0.9
    assert (s.segments_created, s.segments_released) == (1, 0)     # one small segment
    assert s.in_use_bytes_change == 4 * 4 * KiB
    small_segment = next(g["size"] for g in mm.pool.segments() if g["pool"] == "small")
    assert s.reserved_bytes_change == small_segment
    assert s.peak_in_use_bytes == 3 * MiB + 10 * 4 * KiB   # what was held at entry counts
    assert s.seconds >= 0 and "10 allocations (9 hits, 1 misses)" in str(s)
    assert s.as_dict()["hit_rate"] == 0.9
    for b in bufs[6:]:
        b.free()
    keep.free()


def test_block_peak_is_its_own_and_the_managers_peak_survives(mm):
    mm.malloc(60 * MiB).free()                         # manager peak: 60 MiB, before the block
    held_at_entry = mm.pool.reserved_bytes             # the 60 MiB segment, cached
    with mm.measure() as m:
        mm.malloc(MiB).free()
        assert mm.stats().peak_in_use_bytes == 60 * MiB       # also while the block is open
    assert m.stats.peak_in_use_bytes == MiB
    assert m.stats.peak_reserved_bytes == held_at_entry == 60 * MiB
    assert mm.stats().peak_in_use_bytes == 60 * MiB
    assert mm.stats().peak_reserved_bytes >= 60 * MiB
    mm.reset_peak_stats()                              # then a reset still restarts it
    assert mm.stats().peak_in_use_bytes == 0


def test_nested_and_overlapping_blocks_each_see_their_own_peak(mm):
    outer = mm.measure()
    with outer:
        mm.malloc(8 * MiB).free()
        with mm.measure() as inner:
            mm.malloc(2 * MiB).free()
        mm.malloc(4 * MiB).free()
    assert (outer.stats.peak_in_use_bytes, inner.stats.peak_in_use_bytes) == (8 * MiB, 2 * MiB)
    # overlapping, not nested (as two threads' blocks may be): a opens, b opens, a closes first
    a, b = mm.measure(), mm.measure()
    a.__enter__()
    mm.malloc(16 * MiB).free()
    b.__enter__()
    mm.malloc(2 * MiB).free()
    a.__exit__(None, None, None)
    mm.malloc(3 * MiB).free()
    b.__exit__(None, None, None)
    assert (a.stats.peak_in_use_bytes, b.stats.peak_in_use_bytes) == (16 * MiB, 3 * MiB)
    assert mm.stats().peak_in_use_bytes == 16 * MiB


def test_reset_peak_stats_inside_a_block_keeps_the_blocks_peak(mm):
    with mm.measure() as m:
        mm.malloc(8 * MiB).free()
        mm.reset_peak_stats()
        assert mm.stats().peak_in_use_bytes == 0
        mm.malloc(MiB).free()
    assert m.stats.peak_in_use_bytes == 8 * MiB and mm.stats().peak_in_use_bytes == MiB


def test_an_exception_inside_the_block_still_measures_and_propagates(mm):
    with pytest.raises(OutOfMemoryError):
        with mm.measure() as m:
            mm.malloc(MiB).free()
            mm.malloc(2 << 30)                         # more than the device: OOM
    assert m.stats.num_ooms == 1 and m.stats.num_allocs == 1


def test_cpu_fallbacks_are_counted(sim_device):
    sim_device("64MiB")
    cfg = MemoryConfig(**{**EXACT, "cpu_fallback_enabled": True, "gpu_memory_fraction": 0.5})
    with MemoryManager("sim:0", cfg) as mm:
        with mm.measure() as m:
            fb = mm.malloc(48 * MiB)                   # over usable memory: host memory
        assert m.stats.cpu_fallbacks == 1 and m.stats.num_allocs == 0
        fb.free()


def test_bad_use(mm):
    m = mm.measure()
    with m:
        pass
    with pytest.raises(InvalidInputError, match="entered already"):
        m.__enter__()
    mm.close()
    with pytest.raises(ClosedManagerError):
        mm.measure()


def test_multi_device_peak_still_counts_what_a_block_reset(mm):
    from gpumem import MultiDeviceManager
    mm.malloc(64 * MiB).free()
    with mm.measure():
        mm.malloc(MiB).free()
    with MultiDeviceManager([mm]) as multi:
        assert multi.total_memory_usage() == (0, 64 * MiB)
