"""MemoryManager on a simulated device: cache control (empty_cache, shrink, max_pool_size,
max_pooled_per_bucket), statistics, RAII, close(), memory limits (usable_memory,
min_free_bytes), the out-of-memory ladder, CPU fallback, driver faults, and thread safety."""
from __future__ import annotations

import gc
import random
import threading
import warnings

import numpy as np
import pytest

import gpumem
from gpumem import (Buffer, ClosedManagerError, DoubleFreeError, DriverError, FallbackBuffer,
                    MemoryConfig, MemoryManager, OutOfMemoryError)
from invariants import check, run_threads, snapshot_state

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def freed_sizes(dev) -> list[int]:
    return [c.nbytes for c in dev.calls if c.op == "free" and c.outcome == "ok"]


# --- empty_cache and shrink ---------------------------------------------------------------------
def test_empty_cache_returns_exact_bytes_to_the_device(make_manager):
    manager = make_manager(expandable_segments=False)  # plain segments: whole-segment release
    dev = manager.device
    keep = manager.malloc(4096)                          # keeps one small segment busy
    gone = [manager.malloc(n) for n in (MiB + 512, 25 * MiB, 40 * MiB)]
    extra = manager.malloc(MiB)                          # same small segment as keep
    reserved = manager.stats().reserved_bytes
    busy_segment = keep.segment_location()[0]
    for b in gone + [extra]:
        b.free()
    expected = sum(s["size"] for s in manager.pool.segments() if s["handle"] != busy_segment)
    dev.clear_calls()
    released = manager.empty_cache()
    assert released == expected
    assert sorted(freed_sizes(dev)) == [19 * (MiB + 512), 25 * MiB, 40 * MiB]
    st = manager.stats()
    assert st.reserved_bytes == reserved - released == 2 * MiB
    assert dev.live_bytes == 2 * MiB and dev.live_segments == 1
    assert st.segments_released == 3
    check(manager, [keep])
    # nothing left to release: no driver call
    dev.clear_calls()
    assert manager.empty_cache() == 0
    assert freed_sizes(dev) == []
    keep.free()
    assert manager.empty_cache() == 2 * MiB
    assert dev.live_bytes == 0
    check(manager, [])


def test_empty_cache_synchronizes_before_freeing(make_manager):
    manager = make_manager(expandable_segments=False)  # plain segments: whole-segment release
    dev = manager.device
    s = dev.create_stream()
    manager.malloc(12 * MiB, stream=s).free()
    dev.submit(s)
    dev.clear_calls()
    manager.empty_cache()
    ops = [c.op for c in dev.calls]
    assert ops == ["synchronize", "free"]
    assert dev.stream_idle(s)


def test_shrink_to_target(make_manager):
    manager = make_manager(expandable_segments=False)  # plain segments: whole-segment release
    dev = manager.device
    bufs = [manager.malloc(n) for n in (12 * MiB, 14 * MiB, 16 * MiB)]
    for b in bufs:
        b.free()
    assert manager.stats().cached_bytes == 42 * MiB
    assert manager.shrink(50 * MiB) == 0                 # already below the target
    assert dev.live_bytes == 42 * MiB
    released = manager.shrink(20 * MiB)                  # largest first: 16 then 14
    assert released == 30 * MiB
    assert manager.stats().cached_bytes == 12 * MiB <= 20 * MiB
    assert dev.live_bytes == 12 * MiB
    check(manager, [])
    assert manager.shrink() == 12 * MiB
    assert dev.live_bytes == 0
    check(manager, [])


def test_shrink_keeps_busy_segments(manager):
    a = manager.malloc(4096)
    b = manager.malloc(20 * MiB)          # one plain large segment, one auto growth
    b.free()
    assert manager.shrink(0) == 20 * MiB
    assert manager.stats().cached_bytes == 2 * MiB - 4096   # the rest of a's segment
    check(manager, [a])


@pytest.mark.parametrize("bad", [-1, 1.5, "1 MiBs", None, True, 2**64])
def test_shrink_rejects_bad_targets(manager, bad):
    manager.malloc(12 * MiB).free()
    before = snapshot_state(manager)
    with pytest.raises(gpumem.InvalidInputError):
        manager.shrink(bad)
    assert snapshot_state(manager) == before


# --- max_pool_size and max_pooled_per_bucket --------------------------------------------------------
def test_max_pool_size_caps_cached_bytes_after_every_free(make_manager):
    cap = 30 * MiB
    # plain segments: freed blocks inside one segment stay
    mm = make_manager(max_pool_size=cap, expandable_segments=False)
    bufs = [mm.malloc(12 * MiB) for _ in range(6)]
    random.Random(1).shuffle(bufs)
    while bufs:
        bufs.pop().free()
        st = mm.stats()
        assert st.cached_bytes <= cap, st
        check(mm, bufs)
    assert mm.stats().cached_bytes > 0                   # the cap is not "cache nothing"
    assert mm.device.live_bytes == mm.stats().reserved_bytes


def test_set_max_pool_size_trims_at_once(manager):
    for b in [manager.malloc(20 * MiB) for _ in range(4)]:
        b.free()
    assert manager.stats().cached_bytes >= 40 * MiB
    manager.set_max_pool_size(20 * MiB)
    assert manager.stats().cached_bytes <= 20 * MiB
    check(manager, [])
    manager.set_max_pool_size(None)
    for b in [manager.malloc(20 * MiB) for _ in range(4)]:
        b.free()
    assert manager.stats().cached_bytes >= 40 * MiB
    with pytest.raises(gpumem.InvalidInputError):
        manager.set_max_pool_size(-1)
    with pytest.raises(gpumem.InvalidInputError):
        manager.set_max_pool_size(2.5)


def test_set_max_pool_size_takes_size_strings(manager):
    """real (sim): set_max_pool_size("20MiB") works as the docs show it; shrink("0B") too."""
    for b in [manager.malloc(12 * MiB) for _ in range(4)]:
        b.free()
    manager.set_max_pool_size("20MiB")
    assert manager.stats().cached_bytes <= 20 * MiB
    manager.set_max_pool_size(None)
    assert manager.shrink("0B") >= 0 and manager.stats().cached_bytes == 0
    check(manager, [])


@pytest.mark.parametrize("bad", [2**64, 2**64 + 1, 2**70, "20 EiB"])
def test_set_max_pool_size_out_of_range_changes_nothing(manager, bad):
    """real (sim): issue 9 bug 8: set_max_pool_size(2**64) raised OverflowError after
    changing the cap; now an InvalidInputError naming max_pool_size, cap and cache unchanged."""
    manager.set_max_pool_size(40 * MiB)
    for b in [manager.malloc(12 * MiB) for _ in range(3)]:
        b.free()
    before = snapshot_state(manager)
    with pytest.raises(gpumem.InvalidInputError, match="max_pool_size"):
        manager.set_max_pool_size(bad)
    assert snapshot_state(manager) == before
    assert manager._max_pool_size == 40 * MiB
    manager.malloc(12 * MiB).free()      # the old cap still applies after a free
    assert manager.stats().cached_bytes <= 40 * MiB


def test_free_above_the_cap_does_not_synchronize_when_nothing_is_releasable(make_manager):
    """Cached bytes above max_pool_size that sit in partly used segments cannot be released;
    free() must then not pay a device-wide synchronize (cuCtxSynchronize on CUDA) each time."""
    mm = make_manager(max_pool_size=MiB)
    dev = mm.device
    keep = mm.malloc(4096)                               # 2 MiB segment, ~2 MiB cached > cap
    syncs = dev.synchronize_calls
    for _ in range(100):
        mm.malloc(4096).free()
    assert mm.stats().cached_bytes > MiB                 # nothing could be released...
    assert dev.synchronize_calls == syncs, (
        f"{dev.synchronize_calls - syncs} device synchronizations for 100 frees that "
        f"released nothing")
    check(mm, [keep])


def test_max_pooled_per_bucket_limits_free_segments_of_one_size(make_manager):
    # plain segments: segments per size
    mm = make_manager(max_pooled_per_bucket=2, release_before_grow=False, expandable_segments=False)
    dev = mm.device
    bufs = [mm.malloc(12 * MiB) for _ in range(5)]
    for b in bufs:
        b.free()
    assert sum(1 for s in mm.pool.segments() if s["size"] == 12 * MiB) == 5
    other = mm.malloc(50 * MiB)                          # the pool grows: excess is released
    sizes = [s["size"] for s in mm.pool.segments()]
    assert sizes.count(12 * MiB) == 2
    assert dev.live_bytes == 24 * MiB + 50 * MiB
    check(mm, [other])
    # other size classes are counted apart
    more = [mm.malloc(30 * MiB) for _ in range(3)]
    for b in more:
        b.free()
    mm.malloc(60 * MiB).free()
    sizes = [s["size"] for s in mm.pool.segments()]
    assert sizes.count(30 * MiB) == 2 and sizes.count(12 * MiB) == 2
    check(mm, [other])


def test_release_before_grow_returns_idle_segments(make_manager):
    # plain segments: whole-segment release; release_before_grow=True (default)
    mm = make_manager(expandable_segments=False)
    dev = mm.device
    idle = [mm.malloc(12 * MiB), mm.malloc(12 * MiB)]
    for x in idle:
        x.free()
    b = mm.malloc(20 * MiB)                              # a miss; 24 MiB idle >= the growth
    assert [s["size"] for s in mm.pool.segments()] == [20 * MiB]
    assert dev.live_bytes == 20 * MiB
    check(mm, [b])


def test_small_pool_growth_keeps_surplus_large_segments(make_manager):
    """max_pooled_per_bucket is enforced when the large pool grows; a small-pool growth does
    not release the surplus (a warm training step would allocate it again: driver churn)."""
    # plain segments: segments per size
    mm = make_manager(max_pooled_per_bucket=2, release_before_grow=False, expandable_segments=False)
    for b in [mm.malloc(12 * MiB) for _ in range(5)]:
        b.free()
    small = mm.malloc(4096)                              # a new small segment
    assert [s["size"] for s in mm.pool.segments()].count(12 * MiB) == 5
    other = mm.malloc(50 * MiB)                          # the large pool grows: trimmed
    assert [s["size"] for s in mm.pool.segments()].count(12 * MiB) == 2
    check(mm, [small, other])


def test_release_before_grow_of_the_large_pool_keeps_idle_small_segments(make_manager):
    # plain segments: exact segment sizes (expandable growth returns idle small segments first,
    # by design: tests/manager/test_expandable_stitch.py)
    mm = make_manager(expandable_segments=False)         # release_before_grow=True (default)
    idle = [mm.malloc(MiB) for _ in range(8)] + [mm.malloc(12 * MiB)]
    for x in idle:
        x.free()
    assert sorted(s["size"] for s in mm.pool.segments()) == [2 * MiB] * 4 + [12 * MiB]
    b = mm.malloc(20 * MiB)       # past the mark; 20 MiB idle in all, 12 MiB of it large
    assert sorted(s["size"] for s in mm.pool.segments()) == [2 * MiB] * 4 + [20 * MiB]
    check(mm, [b])


# --- statistics ---------------------------------------------------------------------------------------
def test_stats_hits_misses_and_hit_rate(manager):
    st = manager.stats()
    assert (st.pool_hits, st.pool_misses, st.hit_rate()) == (0, 0, 0.0)
    a = manager.malloc(4096)
    for _ in range(3):
        manager.malloc(4096).free()
    st = manager.stats()
    assert (st.pool_hits, st.pool_misses) == (3, 1)
    assert st.hit_rate() == 0.75
    assert (st.num_allocs, st.num_frees, st.active_buffers) == (4, 3, 1)
    assert st.num_segments == 1 == st.segments_created
    assert st.as_dict()["hit_rate"] == 0.75
    assert "sim:0" in str(st) and st.device == "sim:0"
    check(manager, [a])


def test_stats_peak_and_reset(manager):
    bufs = [manager.malloc(20 * MiB) for _ in range(3)]
    bufs.pop().free()
    bufs.pop().free()
    st = manager.stats()
    assert st.peak_in_use_bytes == 60 * MiB and st.in_use_bytes == 20 * MiB
    assert st.peak_reserved_bytes == 60 * MiB
    manager.empty_cache()
    manager.reset_peak_stats()
    st = manager.stats()
    assert st.peak_in_use_bytes == st.in_use_bytes == 20 * MiB
    assert st.peak_reserved_bytes == st.reserved_bytes == 20 * MiB
    more = manager.malloc(4096)
    assert manager.stats().peak_in_use_bytes == 20 * MiB + 4096
    check(manager, bufs + [more])


def test_stats_fragmentation_ratio(manager):
    quarter = 512 * KiB
    q = [manager.malloc(quarter) for _ in range(4)]      # fills one 2 MiB small segment
    assert manager.stats().cached_bytes == 0
    assert manager.stats().fragmentation_ratio() == 0.0
    q[0].free()
    q[2].free()
    st = manager.stats()
    assert st.cached_bytes == 2 * quarter and st.largest_free_block == quarter
    assert st.fragmentation_ratio() == 0.5
    q[1].free()                                          # merges into one 1.5 MiB block
    st = manager.stats()
    assert st.largest_free_block == 3 * quarter and st.fragmentation_ratio() == 0.0
    check(manager, [q[3]])


def test_stats_invariant_under_mixed_work(manager):
    rng = random.Random(5)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).free()
        else:
            live.append(manager.malloc(rng.choice([0, 1, 700, 4096, 300_000, 3 * MiB, 11 * MiB])))
    check(manager, live)
    st = manager.stats()
    assert st.reserved_bytes == st.in_use_bytes + st.cached_bytes
    assert st.active_buffers == len(live)


# --- RAII ------------------------------------------------------------------------------------------
def test_del_returns_the_block(manager):
    b = manager.malloc(4096)
    ptr = b.ptr
    assert manager.stats().active_buffers == 1
    del b
    gc.collect()
    st = manager.stats()
    assert st.active_buffers == 0 and st.in_use_bytes == 0 and st.num_frees == 1
    assert manager.malloc(4096).ptr == ptr
    check(manager, None)


def test_buffer_dropped_in_a_loop_is_recycled(manager):
    for _ in range(1000):
        manager.malloc(8192)
    st = manager.stats()
    assert st.active_buffers == 0 and st.pool_misses == 1 and st.num_frees == 1000
    check(manager, [])


def test_with_block_frees_on_exit(manager):
    with manager.malloc(1 << 16) as b:
        assert b.alive and manager.stats().active_buffers == 1
    assert not b.alive
    assert manager.stats().active_buffers == 0
    with pytest.raises(DoubleFreeError):
        b.free()
    with pytest.raises(RuntimeError):
        with manager.malloc(100) as c:
            raise RuntimeError("boom")
    assert not c.alive and manager.stats().active_buffers == 0
    with manager.malloc(100) as d:
        d.free()                                         # freeing inside the block is fine
    assert not d.alive
    check(manager, [])


def test_buffers_are_made_only_by_malloc():
    with pytest.raises(TypeError):
        Buffer()


def test_manager_as_context_manager_closes(sim_device):
    dev = sim_device("1GiB")
    with MemoryManager("sim:0", MemoryConfig(min_free_bytes=0)) as mm:
        mm.malloc(12 * MiB)
        b = mm.malloc(100)
        assert dev.live_bytes > 0
    assert mm.closed and dev.live_bytes == 0 and not b.alive


# --- close ----------------------------------------------------------------------------------------
def test_close_frees_every_segment_and_disables_the_manager(make_manager):
    manager = make_manager(expandable_segments=False)  # plain segments: one segment per request
    dev = manager.device
    live = [manager.malloc(n) for n in (100, MiB + 3, 25 * MiB)]
    manager.malloc(40 * MiB).free()
    assert dev.live_segments == 4 == len(manager.pool.segments())
    manager.close()
    assert manager.closed
    assert dev.live_bytes == 0 and dev.live_segments == 0
    assert all(not b.alive for b in live)
    with pytest.raises(ClosedManagerError):
        manager.malloc(100)
    with pytest.raises(ClosedManagerError):
        manager.malloc(0)
    with pytest.raises(ClosedManagerError):
        live[0].free()
    with pytest.raises(ClosedManagerError):
        manager.free(live[1])
    with pytest.raises(ClosedManagerError):
        manager.empty_cache()
    with pytest.raises(ClosedManagerError):
        manager.shrink(0)
    calls = dev.free_calls
    manager.close()                                      # idempotent
    assert dev.free_calls == calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del live                                         # dropping dead buffers never raises
        gc.collect()
    assert isinstance(ClosedManagerError("x"), gpumem.InvalidInputError)


# --- limits ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction, reserve, expected", [
    (1.0, 0, 1 * GiB), (0.5, 100 * MiB, 512 * MiB), (0.5, 700 * MiB, 324 * MiB),
    (0.9, None, int(0.9 * GiB)), (0.25, 0, 256 * MiB), (1.0, 1 * GiB, 0)])
def test_usable_memory(sim_device, make_manager, fraction, reserve, expected):
    sim_device("1GiB")
    mm = make_manager(gpu_memory_fraction=fraction, reserve_bytes=reserve)
    assert mm.total_memory == GiB
    assert mm.usable_memory == expected == max(0, min(int(GiB * fraction), GiB - (reserve or 0)))


def test_reserved_never_exceeds_usable_memory(sim_device, make_manager):
    dev = sim_device("1GiB")
    mm = make_manager(gpu_memory_fraction=0.25, auto_release_at_high=False,
                      auto_cleanup_at_critical=False)
    bufs = []
    with pytest.raises(OutOfMemoryError) as info:
        while True:
            bufs.append(mm.malloc(30 * MiB))
            assert mm.stats().reserved_bytes <= mm.usable_memory
    assert len(bufs) == 8                                # 8 * 30 MiB <= 256 MiB < 9 * 30 MiB
    assert dev.failed_allocs == 0                        # the limit held before the driver
    assert info.value.limit == 256 * MiB
    small = mm.malloc(10 * MiB)                          # what still fits is served
    check(mm, bufs + [small])


def test_request_above_usable_memory_fails_without_driver_call(sim_device, make_manager):
    dev = sim_device("1GiB")
    mm = make_manager(gpu_memory_fraction=0.5)
    live = mm.malloc(4096)
    mm.malloc(40 * MiB).free()                           # cached: must stay cached
    calls = dev.alloc_calls
    before = snapshot_state(mm)
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(600 * MiB)
    assert dev.alloc_calls == calls and dev.free_calls == 0
    assert "usable memory" in str(info.value)
    assert snapshot_state(mm) == before
    assert mm.stats().num_ooms == 1
    check(mm, [live])


def test_min_free_bytes_is_enforced_before_the_driver_is_asked(sim_device, make_manager):
    dev = sim_device("1GiB", other_process_bytes="900MiB")       # 124 MiB free
    # plain segments: counts alloc_segment calls
    mm = make_manager(min_free_bytes=64 * MiB, expandable_segments=False)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)                             # would leave 24 MiB free
    assert dev.alloc_calls == 0
    a = mm.malloc(50 * MiB)                              # leaves 74 MiB
    assert dev.alloc_calls == 1
    with pytest.raises(OutOfMemoryError):
        mm.malloc(20 * MiB)                              # would leave 54 MiB
    assert dev.alloc_calls == 1
    free, _ = dev.mem_get_info()
    assert free >= 64 * MiB
    check(mm, [a])


def test_min_free_bytes_falls_back_to_an_exact_segment(sim_device, make_manager):
    dev = sim_device("1GiB", other_process_bytes=GiB - 65 * MiB)   # 65 MiB free
    mm = make_manager(min_free_bytes=64 * MiB)
    b = mm.malloc(4096)                                  # a 2 MiB segment would break the floor
    assert [s.nbytes for s in dev.segments()] == [4096]
    assert dev.mem_get_info()[0] >= 64 * MiB
    check(mm, [b])


def test_other_processes_taking_memory_later_are_respected(sim_device, make_manager):
    dev = sim_device("1GiB")
    mm = make_manager(min_free_bytes=100 * MiB)
    a = mm.malloc(300 * MiB)
    dev.set_other_process_bytes(600 * MiB)               # 124 MiB free now
    calls = dev.alloc_calls
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(30 * MiB)
    assert dev.alloc_calls == calls
    assert info.value.free == 124 * MiB
    check(mm, [a])


# --- the out-of-memory ladder ----------------------------------------------------------------------
def test_oom_ladder_releases_the_cache_and_retries(sim_device, make_manager):
    dev = sim_device("64MiB")
    mm = make_manager(release_before_grow=False)
    mm.malloc(40 * MiB).free()
    assert dev.live_bytes == 40 * MiB
    b = mm.malloc(50 * MiB)                              # fits only once the 40 MiB are returned
    assert dev.live_bytes == 50 * MiB
    assert mm.stats().num_ooms == 0
    check(mm, [b])


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_driver_refusal_releases_cache_then_retries(sim_device, make_manager, expandable):
    """A refused growth gives the cache back and retries; a refused retry is an OOM that
    leaves nothing reserved. Plain segments are refused by alloc_segment, expandable ones by
    page creation (sim's inject_vm), whose retry follows the unmapping of the cached tail
    (level real)."""
    dev = sim_device("1GiB")
    mm = make_manager(release_before_grow=False, expandable_segments=expandable)
    mm.malloc(12 * MiB).free()
    grow, give_back = ("vm_create", "vm_unmap") if expandable else ("alloc", "free")
    if expandable:
        dev.inject_vm(create_after=0)                    # the next page is refused
    else:
        dev.inject(fail_after=0)                         # the next allocation is refused
    dev.clear_calls()
    with pytest.raises(OutOfMemoryError):
        mm.malloc(30 * MiB)
    ops = [(c.op, c.outcome) for c in dev.calls]
    tries = [i for i, op in enumerate(ops) if op[0] == grow]
    assert ops[0] == (grow, "injected_oom")
    assert [ops[i] for i in tries] == [(grow, "injected_oom")] * 2
    assert (give_back, "ok") in ops[tries[0]:tries[1]]   # the cache was given back to retry
    assert mm.stats().reserved_bytes == 0
    dev.clear_faults()
    dev.inject_vm(create_after=None)
    b = mm.malloc(30 * MiB)
    check(mm, [b])


def test_oom_callback_may_free_and_the_request_is_retried(sim_device, make_manager):
    dev = sim_device("100MiB")
    mm = make_manager()
    hog = [mm.malloc(60 * MiB)]
    seen = []

    @mm.on_oom
    def free_hog(manager, nbytes):
        seen.append((manager, nbytes))
        hog.pop().free()

    b = mm.malloc(50 * MiB)
    assert seen == [(mm, 50 * MiB)]
    assert not hog and b.alive
    assert dev.live_bytes == 60 * MiB                    # served from the freed 60 MiB block
    check(mm, [b])
    with pytest.raises(gpumem.InvalidInputError):
        mm.on_oom(42)


def test_oom_error_describes_the_state(sim_device, make_manager):
    sim_device("256MiB")
    mm = make_manager()
    a = mm.malloc(100 * MiB)
    mm.malloc(4096).free()
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(200 * MiB)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, gpumem.GpuMemoryError)
    assert e.requested == 200 * MiB and e.total == 256 * MiB and e.device == "sim:0"
    assert e.in_use == 100 * MiB
    assert e.limit == mm.usable_memory
    assert mm.stats().num_ooms == 1
    check(mm, [a])


def test_non_oom_driver_error_is_not_mistaken_for_pressure(sim_device, make_manager):
    dev = sim_device("1GiB", fail_after=0, fail_kind="error")
    mm = make_manager(cpu_fallback_enabled=True)
    before = snapshot_state(mm)
    with pytest.raises(DriverError) as info:
        mm.malloc(4096)
    assert not isinstance(info.value, MemoryError)
    assert dev.alloc_calls == 1                       # raised at once: no ladder, no retry
    assert snapshot_state(mm) == before
    assert mm.stats().cpu_fallbacks == 0
    check(mm, [])


def test_refused_free_keeps_the_segment_cached(sim_device, make_manager):
    dev = sim_device("1GiB", fail_free=1)
    mm = make_manager(expandable_segments=False)  # plain segments: fail_free faults free_segment
    mm.malloc(12 * MiB).free()
    with pytest.warns(RuntimeWarning):
        assert mm.empty_cache() == 0
    assert mm.stats().reserved_bytes == 12 * MiB
    check(mm, [])
    b = mm.malloc(12 * MiB)                              # the restored segment serves again
    assert mm.stats().pool_misses == 1
    b.free()
    assert mm.empty_cache() == 12 * MiB
    assert dev.live_bytes == 0
    check(mm, [])


# --- CPU fallback --------------------------------------------------------------------------------------
def test_cpu_fallback_serves_what_the_device_cannot(sim_device, make_manager):
    sim_device("64MiB", back_memory=True)
    mm = make_manager(cpu_fallback_enabled=True)
    a = mm.malloc(48 * MiB)
    fb = mm.malloc(32 * MiB)
    assert isinstance(fb, FallbackBuffer) and fb.location == "cpu" and fb.alive
    assert a.location == "device"
    st = mm.stats()
    assert st.cpu_fallbacks == 1 and st.fallback_bytes == 32 * MiB
    assert st.active_buffers == 2
    data = np.arange(32 * MiB, dtype=np.uint8) * 7
    fb.copy_from_host(data)
    assert np.array_equal(fb.copy_to_host(), data)
    check(mm, [a, fb])
    a.free()
    moved = fb.migrate_to_device()
    assert moved.location == "device" and not fb.alive
    assert np.array_equal(moved.copy_to_host(), data)
    assert mm.stats().fallback_bytes == 0
    check(mm, [moved])
    with pytest.raises(OutOfMemoryError):
        mm.malloc(65 * MiB)                              # bigger than the device: never served


def test_fallback_buffer_free_and_with(sim_device, make_manager):
    sim_device("16MiB")
    mm = make_manager(cpu_fallback_enabled=True)
    hold = mm.malloc(12 * MiB)
    with mm.malloc(8 * MiB - 1) as fb:
        pass
    assert isinstance(fb, FallbackBuffer) and not fb.alive
    fb2 = mm.malloc(10 * MiB)
    mm.free(fb2)
    with pytest.raises(DoubleFreeError):
        fb2.free()
    st = mm.stats()
    assert st.active_buffers == 1 and st.fallback_bytes == 0 and st.cpu_fallbacks == 2
    check(mm, [hold])


# --- thread safety -----------------------------------------------------------------------------------
def test_threads_malloc_and_free_concurrently(manager):
    dev = manager.device
    streams = [0, 0, dev.create_stream(), dev.create_stream()]
    n_ops = 4000                                         # about 2000 malloc/free pairs
    start = threading.Barrier(4)

    def work(tid: int) -> None:
        rng = random.Random(tid)
        live: list[tuple[object, bytes]] = []
        start.wait()
        for i in range(n_ops):
            if live and (rng.random() < 0.5 or len(live) > 20):
                buf, tag = live.pop(rng.randrange(len(live)))
                assert bytes(buf.copy_to_host()[:8]) == tag, "block overwritten by another"
                buf.free()
            else:
                n = rng.choice([8, 100, 4096, 50_000, 700_000, 3 * MiB])
                buf = manager.malloc(n, stream=streams[tid])
                tag = (tid * 1_000_000 + i).to_bytes(8, "little")
                buf.copy_from_host(tag)
                live.append((buf, tag))
        for buf, tag in live:
            assert bytes(buf.copy_to_host()[:8]) == tag
            buf.free()

    errors = run_threads(work, range(4))
    assert not errors, errors
    st = manager.stats()
    assert st.num_allocs == st.num_frees and st.active_buffers == 0 and st.in_use_bytes == 0
    check(manager, [])
    manager.empty_cache()
    assert dev.live_bytes == 0
    check(manager, [])


def test_hot_path_methods_keep_their_signatures():
    """real: malloc/free are plain method descriptors (no CyFunction dispatch on the hot path);
    help() and inspect still show their parameters, keyword-only ones included."""
    import inspect
    from gpumem import Buffer, MemoryManager
    sig = inspect.signature(MemoryManager.malloc)
    params = sig.parameters
    assert list(params)[1:] == ["nbytes", "stream", "tag", "fallback"]
    assert params["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["fallback"].default is True
    assert list(inspect.signature(MemoryManager.free).parameters)[1:] == ["buffer"]
    assert list(inspect.signature(Buffer.free).parameters) == ["self"]
    assert "Buffer of at least nbytes" in MemoryManager.malloc.__doc__


def test_malloc_keywords_work_through_the_descriptor(manager):
    """real (sim): keyword arguments and a bound method kept aside behave as before."""
    import functools
    malloc = functools.partial(manager.malloc, stream=0, tag="t", fallback=False)
    buf = malloc(4096)
    assert (buf.nbytes, buf.stream, buf.tag) == (4096, 0, "t")
    with pytest.raises(TypeError):
        manager.malloc(4096, 0)                 # stream is keyword-only
    with pytest.raises(TypeError):
        manager.malloc(nbytes=1, bogus=2)
    manager.free(buf)
    assert not buf.alive
