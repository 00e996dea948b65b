"""BufferBatch (RAII), allocate_batch (few segments, all-or-nothing), warmup, malloc_async.

The backend-agnostic tests also run on real backends named in ``GPUMEM_TEST_BACKENDS`` (by
default only ``sim``); the ones that count driver calls or inject faults use the simulated
device.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np
import pytest

import gpumem_sim
from gpumem import Buffer, FallbackBuffer, MemoryConfig, MemoryManager
from gpumem.manager.batch import BufferBatch, allocate_batch, warmup
from gpumem.errors import (ClosedManagerError, DoubleFreeError, ForeignBufferError,
                           InvalidInputError, OutOfMemoryError)
from gpumem_sim import SimDevice
from invariants import backend_device, selected_backends, sim_manager

KiB = 1 << 10
MiB = 1 << 20


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


@pytest.fixture(params=selected_backends(default=("sim",)))
def manager(request):
    """A fresh manager on each selected backend (sim: 4 GiB with host-backed bytes)."""
    dev = backend_device(request.param, "4GiB", back_memory=True)
    mm = MemoryManager(dev, MemoryConfig(min_free_bytes=0, cpu_fallback_enabled=False))
    yield mm
    mm.close()


def sim(capacity: int = 1000 * MiB, **kw) -> tuple[SimDevice, MemoryManager]:
    """``sim_manager`` (EXACT config) on a host-backed SimDevice, 1000 MiB unless told."""
    return sim_manager(capacity, back_memory=True, **kw)


def state(mm: MemoryManager) -> dict:
    """Everything a failed call must leave unchanged (monotonic event counters aside)."""
    d = dataclasses.asdict(mm.stats())
    for k in ("num_allocs", "num_frees", "pool_hits", "pool_misses", "segments_created",
              "segments_released", "num_ooms", "peak_in_use_bytes", "peak_reserved_bytes"):
        d.pop(k)
    d["segments"] = sorted(s["handle"] for s in mm.pool.segments())
    return d


def segment_of(buf: Buffer) -> int:
    return buf.segment_location()[0]


# --- BufferBatch ---------------------------------------------------------------------------------
def test_batch_frees_everything_on_exit(manager):
    with manager.batch() as batch:
        a = batch.malloc(MiB)
        b = batch.malloc(3 * MiB, tag="x")
        c = batch.add(manager.malloc(512))
        assert len(batch) == 3 and list(batch) == [a, b, c]
        assert b.tag == "x"
        assert manager.stats().active_buffers == 3
    assert not (a.alive or b.alive or c.alive)
    assert len(batch) == 0
    assert manager.stats().active_buffers == 0


def test_batch_skips_buffers_freed_by_the_user(manager):
    batch = BufferBatch(manager)
    a = batch.malloc(MiB)
    b = batch.malloc(MiB)
    a.free()
    assert len(batch) == 2                              # held, even if freed early
    assert batch.free_all() == 1
    assert not b.alive
    assert batch.free_all() == 0


def test_batch_frees_on_exception(manager):
    with pytest.raises(RuntimeError):
        with manager.batch() as batch:
            a = batch.malloc(MiB)
            raise RuntimeError("user code failed")
    assert not a.alive and manager.stats().active_buffers == 0


def test_batch_after_manager_closed_is_quiet():
    _, mm = sim()
    with mm.batch() as batch:
        batch.malloc(MiB)
        mm.close()
    with pytest.raises(ClosedManagerError):
        mm.batch()


def test_batch_add_checks():
    dev, mm = sim()
    gpumem_sim.install(dev, SimDevice(64 * MiB))
    other = MemoryManager("sim:1", MemoryConfig(min_free_bytes=0))
    batch = mm.batch()
    with pytest.raises(TypeError):
        batch.add(b"bytes")
    with pytest.raises(ForeignBufferError):
        batch.add(other.malloc(KiB))
    dead = mm.malloc(KiB)
    dead.free()
    with pytest.raises(InvalidInputError, match="freed"):
        batch.add(dead)
    assert len(batch) == 0
    with pytest.raises(InvalidInputError):
        BufferBatch("not a manager")


def test_batch_holds_fallback_buffers():
    dev, mm = sim(cpu_fallback_enabled=True)
    dev.inject(fail_after=0)
    with mm.batch() as batch:
        fb = batch.malloc(MiB)
        assert isinstance(fb, FallbackBuffer)
    assert not fb.alive and mm.stats().fallback_bytes == 0


def test_batch_allocate_holds_all(manager):
    with manager.batch() as batch:
        bufs = batch.allocate([KiB, 2 * MiB, 3 * MiB])
        assert len(batch) == 3
    assert not any(b.alive for b in bufs)


# --- allocate_batch -------------------------------------------------------------------------------
def test_allocate_batch_uses_one_segment_per_pool(manager):
    sizes = [3 * MiB, 5 * MiB + 7, 2 * MiB, 100 * KiB, 200 * KiB, 12 * MiB, 0, 1]
    segs_before = len(manager.pool.segments())
    bufs = manager.allocate_batch(sizes, tag="w")
    assert [b.nbytes for b in bufs] == sizes
    assert all(type(b) is Buffer and b.tag == "w" and b.alive for b in bufs)
    segments = manager.pool.segments()
    assert len(segments) - segs_before == 2            # one small-pool, one large-pool segment
    small = {segment_of(b) for b, n in zip(bufs, sizes) if n <= manager.pool.small_size}
    large = {segment_of(b) for b, n in zip(bufs, sizes) if n > manager.pool.small_size}
    assert len(small) == 1 and len(large) == 1 and small != large
    by_handle = {s["handle"]: s for s in segments}
    (lh,) = large
    assert by_handle[lh]["pool"] == "large"
    assert by_handle[lh]["size"] == sum(manager.pool.round_size(n) for n in sizes
                                        if n > manager.pool.small_size)
    ids = {blk["id"] for blk in by_handle[lh]["blocks"] if blk["state"] == "allocated"}
    assert ids == {b.id for b, n in zip(bufs, sizes) if n > manager.pool.small_size}
    manager.pool.check_invariants()
    for b in bufs:
        b.free()


def test_allocate_batch_blocks_do_not_overlap():
    dev, mm = sim()
    sizes = [MiB + 1, 4 * MiB, 300 * KiB, 7 * MiB, 1000, 2 * MiB]
    bufs = mm.allocate_batch(sizes)
    for i, b in enumerate(bufs):
        b.memset(i + 1)
    for i, b in enumerate(bufs):
        assert np.all(b.copy_to_host() == i + 1)
    assert dev.alloc_calls == 2


def test_allocate_batch_serves_the_cache_first():
    dev, mm = sim()
    a, b = mm.malloc(8 * MiB), mm.malloc(6 * MiB)      # one 16 MiB segment... and another
    a.free()
    b.free()
    calls = dev.alloc_calls
    bufs = mm.allocate_batch([6 * MiB, 8 * MiB])       # both hits
    assert dev.alloc_calls == calls
    more = mm.allocate_batch([4 * MiB, 5 * MiB, 30 * MiB])
    assert dev.alloc_calls == calls + 1                # the misses share one new segment
    assert len({segment_of(x) for x in more if x.nbytes != 4 * MiB}) <= 2
    mm.pool.check_invariants()
    assert all(x.alive for x in bufs + more)


def test_allocate_batch_empty_and_single():
    dev, mm = sim()
    assert mm.allocate_batch([]) == []
    assert dev.alloc_calls == 0
    (buf,) = mm.allocate_batch((n for n in [5 * MiB]))  # any iterable
    assert buf.nbytes == 5 * MiB


@pytest.mark.parametrize("sizes, exc, word", [
    ([MiB, -1, MiB], InvalidInputError, r"sizes\[1\]"),
    ([MiB, 2 * MiB, -5], InvalidInputError, r"sizes\[2\]"),
    ([MiB, 1.5], TypeError, r"sizes\[1\]"),
    ([True], TypeError, r"sizes\[0\]"),
    ([MiB, "1MiB"], TypeError, r"sizes\[1\]"),
    ([None], TypeError, r"sizes\[0\]"),
])
def test_allocate_batch_bad_sizes_allocate_nothing(sizes, exc, word):
    dev, mm = sim()
    keep = mm.malloc(MiB)
    before = state(mm), dev.alloc_calls
    with pytest.raises(exc, match=word):
        mm.allocate_batch(sizes)
    assert (state(mm), dev.alloc_calls) == before
    assert keep.alive


def test_allocate_batch_non_iterable():
    _, mm = sim()
    with pytest.raises(TypeError):
        mm.allocate_batch(5)
    with pytest.raises(TypeError):
        mm.allocate_batch("123")


def test_allocate_batch_bad_stream_allocates_nothing():
    dev, mm = sim()
    with pytest.raises(InvalidInputError):
        mm.allocate_batch([MiB], stream=12345)
    assert dev.alloc_calls == 0 and mm.stats().active_buffers == 0


def test_allocate_batch_on_a_stream():
    dev, mm = sim()
    s = dev.create_stream()
    bufs = mm.allocate_batch([MiB, 4 * MiB], stream=s)
    assert all(b.stream == s for b in bufs)


def test_allocate_batch_on_closed_manager():
    _, mm = sim()
    mm.close()
    with pytest.raises(ClosedManagerError):
        mm.allocate_batch([MiB])


def test_allocate_batch_too_big_fails_and_changes_nothing():
    dev, mm = sim(1000 * MiB)
    keep = mm.malloc(300 * MiB)
    mm.malloc(100 * MiB).free()                         # something cached
    before = state(mm), dev.live_bytes
    with pytest.raises(OutOfMemoryError):
        mm.allocate_batch([200 * MiB, 300 * MiB, 300 * MiB, 2 * MiB, KiB])
    assert (state(mm), dev.live_bytes) == before
    mm.pool.check_invariants()
    assert keep.alive


def test_allocate_batch_driver_failure_midway_is_undone():
    # plain segments: fail_after faults alloc_segment
    dev, mm = sim(1000 * MiB, expandable_segments=False)
    keep = mm.malloc(100 * MiB)
    before = state(mm), dev.live_bytes
    dev.inject(fail_after=1)               # the small-pool segment is granted, the large refused
    with pytest.raises(OutOfMemoryError):
        mm.allocate_batch([KiB, 2 * KiB, 40 * MiB, 50 * MiB])
    assert dev.alloc_calls > 2
    assert (state(mm), dev.live_bytes) == before        # the granted segment went back
    assert dev.free_calls == 1
    mm.pool.check_invariants()
    dev.clear_faults()
    assert len(mm.allocate_batch([KiB, 40 * MiB])) == 2 and keep.alive


def test_allocate_batch_respects_limits_before_the_driver():
    # plain segments: the driver-call sequence
    dev, mm = sim(1000 * MiB, gpu_memory_fraction=0.5, expandable_segments=False)
    with pytest.raises(OutOfMemoryError):
        mm.allocate_batch([300 * MiB, 300 * MiB])       # 600 > 500 usable
    # the combined 600 MiB segment is refused without asking the driver; one by one, the
    # first 300 MiB is granted and the second refused by the limit; then all is undone
    assert [(c.op, c.nbytes // MiB) for c in dev.calls] == [("alloc", 300), ("free", 300)]
    assert mm.stats().active_buffers == 0 and dev.live_bytes == 0


def test_allocate_batch_min_free_bytes():
    dev, mm = sim(1000 * MiB, min_free_bytes=500 * MiB)
    bufs = mm.allocate_batch([250 * MiB, 250 * MiB])    # exactly 500 MiB left
    assert dev.alloc_calls == 1
    with pytest.raises(OutOfMemoryError):
        mm.allocate_batch([10 * MiB])
    assert dev.alloc_calls == 1 and all(b.alive for b in bufs)


def test_allocate_batch_falls_back_to_one_by_one_when_combined_segment_refused():
    """The combined segment does not fit in the fragmented driver address space, but the
    requests fit one by one."""
    dev, mm = sim(1000 * MiB, expandable_segments=False)  # plain segments: one segment per request
    held = [mm.malloc(100 * MiB) for _ in range(10)]
    held[1].free()
    held[5].free()
    mm.empty_cache()                                    # two separate 100 MiB holes
    bufs = mm.allocate_batch([90 * MiB, 90 * MiB])
    assert len({segment_of(b) for b in bufs}) == 2
    assert all(b.alive for b in bufs)
    mm.pool.check_invariants()


def test_allocate_batch_with_cpu_fallback():
    dev, mm = sim(1000 * MiB, cpu_fallback_enabled=True)
    keep = mm.malloc(800 * MiB)
    bufs = mm.allocate_batch([100 * MiB, 150 * MiB])
    assert [isinstance(b, FallbackBuffer) for b in bufs].count(True) >= 1
    assert mm.stats().active_buffers == 3 and keep.alive


def test_allocate_batch_max_split_size_groups():
    # plain segments: expandable ignores max_split_size
    dev, mm = sim(1000 * MiB, max_split_size=8 * MiB, expandable_segments=False)
    sizes = [3 * MiB] * 5 + [10 * MiB]
    bufs = mm.allocate_batch(sizes)
    assert [b.nbytes for b in bufs] == sizes
    groups = {}
    for b in bufs[:5]:
        groups.setdefault(segment_of(b), []).append(b)
    assert sorted(len(g) for g in groups.values()) == [1, 2, 2]   # each group below 8 MiB
    assert segment_of(bufs[5]) not in groups                       # oversize: its own segment
    assert dev.alloc_calls == 4
    mm.pool.check_invariants()


def test_allocate_batch_max_split_size_small_pool():
    dev, mm = sim(1000 * MiB, max_split_size=2 * MiB)
    bufs = mm.allocate_batch([512 * KiB] * 6)
    assert len({segment_of(b) for b in bufs}) == 2      # 3 x 512 KiB per group, below 2 MiB
    assert dev.alloc_calls == 2
    mm.pool.check_invariants()
    for b in bufs:
        b.free()
    misses = mm.stats().pool_misses
    again = [mm.malloc(512 * KiB) for _ in range(6)]
    assert mm.stats().pool_misses == misses and len(again) == 6


def test_warmup_of_impossible_size_is_a_clean_oom():
    _, mm = sim(1000 * MiB)
    with pytest.raises(OutOfMemoryError):
        mm.warmup([1 << 70])
    assert mm.stats().reserved_bytes == 0


def test_allocate_batch_is_used_by_the_manager_method():
    _, mm = sim()
    bufs = allocate_batch(mm, [MiB, 2 * MiB])
    assert len(bufs) == 2


def test_allocate_batch_updates_pressure():
    _, mm = sim(1000 * MiB)
    events = []
    mm.on_pressure(lambda old, new, ratio: events.append(new.name))
    bufs = mm.allocate_batch([100 * MiB] * 7)
    assert events == ["MEDIUM"] and len(bufs) == 7


# --- warmup ---------------------------------------------------------------------------------------
def test_warmup_makes_later_mallocs_hits(manager):
    sizes, counts = [MiB, 3 * MiB, 200 * KiB], [2, 3, 4]
    reserved = manager.warmup(sizes, counts)
    st = manager.stats()
    assert reserved == st.reserved_bytes > 0
    assert st.active_buffers == 0 and st.cached_bytes == reserved
    bufs = [manager.malloc(n) for n, c in zip(sizes, counts) for _ in range(c)]
    assert manager.stats().pool_misses == st.pool_misses
    assert manager.stats().reserved_bytes == reserved
    for b in bufs:
        b.free()


def test_warmup_int_count_and_repeat():
    dev, mm = sim()
    first = mm.warmup([2 * MiB, 5 * MiB], 4)
    assert first == mm.stats().reserved_bytes
    assert dev.alloc_calls == 1
    assert mm.warmup([2 * MiB, 5 * MiB], 4) == 0        # the cache holds them already
    assert dev.alloc_calls == 1
    misses = mm.stats().pool_misses
    bufs = [mm.malloc(2 * MiB) for _ in range(4)] + [mm.malloc(5 * MiB) for _ in range(4)]
    assert mm.stats().pool_misses == misses
    assert warmup(mm, [], 3) == 0
    del bufs


def test_warmup_bad_input():
    dev, mm = sim()
    with pytest.raises(InvalidInputError, match="counts"):
        mm.warmup([MiB, 2 * MiB], [1])
    with pytest.raises(InvalidInputError, match=r"counts\[1\]"):
        mm.warmup([MiB, 2 * MiB], [1, -1])
    with pytest.raises(InvalidInputError, match=r"sizes\[0\]"):
        mm.warmup([-MiB], 1)
    with pytest.raises(TypeError):
        mm.warmup([MiB], True)
    with pytest.raises(TypeError):
        mm.warmup([MiB], 1.0)
    assert dev.alloc_calls == 0


def test_warmup_is_device_only_and_all_or_nothing():
    dev, mm = sim(1000 * MiB, cpu_fallback_enabled=True)
    before = state(mm)
    with pytest.raises(OutOfMemoryError):
        mm.warmup([300 * MiB], 4)
    assert state(mm) == before and mm.stats().cpu_fallbacks == 0
    assert dev.live_bytes == 0


# --- malloc_async ---------------------------------------------------------------------------------
def test_malloc_async_returns_a_future_with_a_buffer():
    _, mm = sim()
    fut = mm.malloc_async(MiB, tag="async")
    assert isinstance(fut, concurrent.futures.Future)
    buf = fut.result(timeout=10)
    assert type(buf) is Buffer and buf.nbytes == MiB and buf.tag == "async" and buf.alive
    buf.free()


def test_malloc_async_errors():
    _, mm = sim(1000 * MiB)
    with pytest.raises(InvalidInputError):
        mm.malloc_async(-1)                             # at once, in the caller
    fut = mm.malloc_async(2000 * MiB)
    with pytest.raises(OutOfMemoryError):
        fut.result(timeout=10)
    mm.close()
    with pytest.raises(ClosedManagerError):
        mm.malloc_async(MiB)


def test_double_free_through_batch_is_not_an_error():
    _, mm = sim()
    with mm.batch() as batch:
        a = batch.malloc(MiB)
        a.free()
        with pytest.raises(DoubleFreeError):
            a.free()
