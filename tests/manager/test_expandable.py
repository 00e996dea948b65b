"""Expandable segments (gpumem/manager/expandable.py + the pool's grow/trim), level **real** on the
simulated device: the real Cython pool and manager, the sim's VMM model counting every page,
mapping and reservation. Every test ends with the invariant checker, which on sim also proves
that the pool's expandable segments are exactly the device's mapped pages."""
from __future__ import annotations

import random
import threading

import pytest

import gpumem_sim
from gpumem import MemoryConfig, OutOfMemoryError
from gpumem.errors import DriverError
from gpumem.units import MiB
from invariants import check, run_threads, sim_manager

pytestmark = pytest.mark.usefixtures("clean_registry")

PAGE = 2 * MiB


def _leaks(dev) -> tuple[int, int, int]:
    return dev.live_page_handles, dev.live_mappings, dev.live_reservations


def test_segment_grows_in_place_and_bytes_cross_pages():
    """Large requests on one stream extend one segment: one reservation, pages mapped on
    demand, physical bytes = mapped bytes = the pool's reserved bytes; data written across a
    page border reads back."""
    dev, mm = sim_manager("1GiB", back_memory=True, segments="tight")
    bufs = [mm.malloc(n) for n in (5 * MiB, 30 * MiB, 3 * MiB)]
    segs = mm.pool.segments()
    assert len(segs) == 1 and dev.live_reservations == 1
    assert segs[0]["size"] == dev.mapped_bytes == mm.pool.reserved_bytes == 38 * MiB
    assert dev.live_bytes == 38 * MiB and not dev.segments()        # no plain segment
    data = bytes(range(256)) * 16
    bufs[1].copy_from_host(data)                                     # starts inside page 2
    assert bytes(bufs[1].copy_to_host()[:len(data)]) == data
    check(mm, bufs)
    for b in bufs:
        b.free()
    mm.close()
    assert _leaks(dev) == (0, 0, 0) and dev.live_bytes == 0


def test_free_tail_is_extended_not_duplicated():
    """The case plain segments cannot serve without new memory: a request larger than the free
    tail grows the tail by the difference only."""
    dev, mm = sim_manager("1GiB", segments="tight")
    a = mm.malloc(40 * MiB)
    b = mm.malloc(20 * MiB)
    b.free()                                     # 20 MiB free at the end
    calls = mm._expandable.driver_calls
    c = mm.malloc(30 * MiB)                      # needs 10 MiB more, not 30
    assert mm.pool.reserved_bytes == 70 * MiB and dev.mapped_bytes == 70 * MiB
    # 5 pages, each: create + map, and one access grant for the range
    assert mm._expandable.driver_calls - calls == 2 * 5 + 1
    assert c.ptr == a.ptr + 40 * MiB
    check(mm, [a, c])
    mm.close()


def test_empty_cache_and_shrink_return_free_tail_pages():
    dev, mm = sim_manager("1GiB", segments="tight")
    a = mm.malloc(10 * MiB)
    b = mm.malloc(50 * MiB)
    b.free()
    released = mm.shrink(40 * MiB)
    assert released > 0 and mm.stats().cached_bytes <= 40 * MiB
    check(mm, [a])
    released += mm.empty_cache()
    assert mm.pool.reserved_bytes == 10 * MiB == dev.mapped_bytes
    assert released == 50 * MiB and dev.mem_get_info()[0] == 1024 * MiB - 10 * MiB
    check(mm, [a])
    a.free()
    assert mm.empty_cache() == 10 * MiB
    assert _leaks(dev) == (0, 0, 0) and mm.pool.segments() == []
    check(mm, [])
    mm.close()


def test_cache_cap_trims_tails_on_free():
    dev, mm = sim_manager("1GiB", segments="tight", max_pool_size=8 * MiB)
    a = mm.malloc(4 * MiB)
    b = mm.malloc(60 * MiB)
    b.free()
    assert mm.stats().cached_bytes <= 8 * MiB + PAGE
    check(mm, [a])
    mm.close()


@pytest.mark.parametrize("fault", [dict(create_after=1), dict(map_after=1),
                                   dict(create_rate=1.0), dict(map_rate=1.0)])
def test_failed_growth_rolls_back_completely(fault):
    """Page creation or mapping refused midway through a growth (40 MiB = two chunks: the
    second fails): the request fails with
    OutOfMemoryError and the pool, its counters and the device are exactly as before (no
    page, mapping or reservation left behind)."""
    dev, mm = sim_manager("1GiB", segments="tight")
    keep = mm.malloc(8 * MiB)
    before = (mm.stats().as_dict(), mm.pool.segments(), _leaks(dev), dev.live_bytes)
    dev.inject_vm(**fault)
    with pytest.raises(OutOfMemoryError, match="expandable segments on"):
        mm.malloc(40 * MiB)
    after = mm.stats().as_dict()
    assert after.pop("num_ooms") == before[0].pop("num_ooms") + 1
    assert after == before[0]
    assert (mm.pool.segments(), _leaks(dev), dev.live_bytes) == before[1:]
    check(mm, [keep])
    dev.clear_faults()
    buf = mm.malloc(40 * MiB)                      # and it works once the driver agrees
    check(mm, [keep, buf])
    mm.close()
    assert _leaks(dev) == (0, 0, 0)


def test_failed_first_growth_frees_the_reservation():
    dev, mm = sim_manager("1GiB", segments="tight")
    dev.inject_vm(map_after=1)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(40 * MiB)                        # two chunks: the second map fails
    assert _leaks(dev) == (0, 0, 0) and mm.pool.segments() == []
    check(mm, [])
    mm.close()


def test_map_error_that_is_not_oom_propagates_after_rollback():
    dev, mm = sim_manager("1GiB", segments="tight")
    dev.inject(fail_kind="error")
    dev.inject_vm(map_after=0)
    with pytest.raises(DriverError, match="injected failure mapping") as err:
        mm.malloc(20 * MiB)
    assert not isinstance(err.value, MemoryError)
    assert _leaks(dev) == (0, 0, 0)
    check(mm, [])
    mm.close()


def test_oom_ladder_trims_tails_of_other_streams():
    """A stream that needs memory gets it from another stream's free tail: the ladder's
    release step unmaps those pages, then the growth maps new ones."""
    dev, mm = sim_manager("128MiB", segments="tight")
    s = dev.create_stream()
    a = mm.malloc(20 * MiB)
    b = mm.malloc(90 * MiB)
    b.free()                                       # 90 MiB cached as stream 0's tail
    dev.submit(0)                                  # stream 0 busy: its blocks are not lent
    c = mm.malloc(90 * MiB, stream=s)
    assert dev.live_reservations == 2 and mm.pool.reserved_bytes == 110 * MiB
    check(mm, [a, c])
    mm.close()
    assert _leaks(dev) == (0, 0, 0)


def test_small_requests_keep_plain_segments():
    dev, mm = sim_manager("1GiB", segments="tight")
    small = mm.malloc(4096)
    assert len(dev.segments()) == 1 and dev.live_reservations == 0
    check(mm, [small])
    mm.close()


def test_option_is_on_by_default_where_the_device_has_virtual_memory(monkeypatch):
    """Level real (sim, host): a manager with the default config on a device whose backend
    has virtual memory (sim) uses expandable segments; False in the config or
    GPUMEM_EXPANDABLE_SEGMENTS=0 (read by the config a manager makes for itself) turns them
    off; on host memory (no virtual memory: the device says so, no backend name is tested)
    the option is ignored and plain segments serve the request."""
    import gpumem_sim
    from gpumem import MemoryManager
    assert MemoryConfig().segment_policy == "auto"
    monkeypatch.delenv("GPUMEM_EXPANDABLE_SEGMENTS", raising=False)
    dev = gpumem_sim.SimDevice("8GiB")             # roomy: auto grows in one handle
    mm = MemoryManager(dev)                         # MemoryConfig.from_env(): the default
    assert dev.supports_virtual_memory and mm._expandable is not None
    buf = mm.malloc(30 * MiB)
    assert dev.live_segments == 0 and dev.mapped_bytes == 40 * MiB     # auto: 2 quanta
    buf.free()
    mm.close()
    monkeypatch.setenv("GPUMEM_EXPANDABLE_SEGMENTS", "0")
    assert MemoryConfig.from_env().expandable_segments is False
    for mm in (MemoryManager(dev), MemoryManager(dev, MemoryConfig(expandable_segments=False))):
        assert mm._expandable is None
        buf = mm.malloc(30 * MiB)
        assert dev.live_segments == 1 and dev.mapped_bytes == 0
        buf.free()
        mm.close()
    mm = MemoryManager("cpu", MemoryConfig(segments="tight"))
    assert not mm.device.supports_virtual_memory
    assert mm._expandable is None                  # host memory has no VMM: plain segments
    buf = mm.malloc(30 * MiB)
    check(mm, [buf])
    buf.free()
    mm.close()


def test_oom_message_suggests_the_option_when_fragmentation_is_the_cause():
    # plain segments: the message for the option off
    dev, mm = sim_manager("128MiB", release_before_grow=False, expandable_segments=False)
    keep = [mm.malloc(30 * MiB) for _ in range(4)]
    keep[0].free()
    keep[2].free()                                 # 60 MiB cached, in two 30 MiB pieces
    with pytest.raises(OutOfMemoryError, match="segments='auto'"):
        mm.malloc(50 * MiB)
    mm.close()


def test_threads_with_expandable_segments():
    """Four threads, two streams each growing its own segment, with random frees: no block
    is handed out twice (tags survive), and the invariants hold at the end."""
    dev, mm = sim_manager("2GiB", back_memory=True, segments="tight")
    streams = [0, 0, dev.create_stream(), dev.create_stream()]
    start = threading.Barrier(4)

    def work(tid: int) -> None:
        rng = random.Random(tid)
        live = []
        start.wait()
        for i in range(600):
            if live and (rng.random() < 0.5 or len(live) > 12):
                buf, tag = live.pop(rng.randrange(len(live)))
                assert bytes(buf.copy_to_host()[:8]) == tag
                buf.free()
                if rng.random() < 0.05:
                    mm.empty_cache()
            else:
                buf = mm.malloc(rng.choice([3 * MiB, 5 * MiB + 7, 11 * MiB, 100]),
                                stream=streams[tid])
                tag = (tid * 1_000_000 + i).to_bytes(8, "little")
                buf.copy_from_host(tag)
                live.append((buf, tag))
        for buf, _ in live:
            buf.free()

    errors = run_threads(work, range(4))
    assert not errors, errors
    check(mm, [])
    mm.empty_cache()
    assert dev.live_bytes == 0 and _leaks(dev) == (0, 0, 0)
    mm.close()
    gpumem_sim.uninstall()


def test_a_hit_that_takes_the_free_tail_mid_growth_does_not_fail_the_request(monkeypatch):
    """The race behind the 1-in-8 OOM of the threaded test: a growth reads the free tail,
    maps the pages missing beyond it, and meanwhile a cache hit on the same stream (the hot
    path takes only the pool's lock) takes part of the tail. The growth must still serve the
    request by mapping pages that hold it alone, not give up with OutOfMemoryError while the
    device has room."""
    dev, mm = sim_manager("1GiB", segments="tight")
    a = mm.malloc(10 * MiB)
    b = mm.malloc(8 * MiB)
    b.free()                                     # an 8 MiB free tail at offset 10 MiB
    hits = []
    real_map = dev.vm_map_many

    def map_while_a_hit_takes_the_tail(*args):
        if not hits:                             # the first mapping of the growth below
            t = threading.Thread(target=lambda: hits.append(mm.malloc(6 * MiB)))
            t.start()
            t.join(10)
            assert hits and hits[0].ptr == a.ptr + 10 * MiB, "the hit did not take the tail"
        return real_map(*args)

    monkeypatch.setattr(dev, "vm_map_many", map_while_a_hit_takes_the_tail)
    c = mm.malloc(12 * MiB)                      # tail 8 MiB: maps 4 MiB, then finds 2 MiB
    monkeypatch.undo()
    assert mm.stats().num_ooms == 0
    assert c.ptr == a.ptr + 16 * MiB             # carved from the 2 MiB left + new pages
    # the 4 MiB stay as part of a 6 MiB free tail; the second plan maps the 6 MiB missing
    assert mm.pool.reserved_bytes == dev.mapped_bytes == 28 * MiB
    check(mm, [a, hits[0], c])
    mm.close()
    assert _leaks(dev) == (0, 0, 0)


def test_a_free_of_the_last_block_mid_growth_keeps_the_pool_and_the_device_in_step(monkeypatch):
    """The race behind a stress-test failure ("no mapping starts at ..." on empty_cache): a
    growth plans to map at the segment's end (its last block live), and meanwhile another
    thread frees that last block. Stitching must not take pages from the new free tail:
    carving them would cut the segment's end back, and the pool would then record the new
    pages below where the device mapped them."""
    dev, mm = sim_manager("1GiB", segments="tight")
    a = mm.malloc(4 * MiB)
    b = mm.malloc(4 * MiB)                       # the last block, live
    exp = mm._expandable
    real_plan = exp._plan
    freed = []

    def plan_then_the_last_block_is_freed(*args):
        plan = real_plan(*args)
        if not freed:
            t = threading.Thread(target=lambda: (b.free(), freed.append(1)))
            t.start()
            t.join(10)
            assert freed
        return plan

    monkeypatch.setattr(exp, "_plan", plan_then_the_last_block_is_freed)
    c = mm.malloc(8 * MiB)                       # planned at the end, offset 8 MiB
    monkeypatch.undo()
    assert mm.pool.reserved_bytes == dev.mapped_bytes
    check(mm, [a, c])
    mm.empty_cache()
    check(mm, [a, c])
    for buf in (a, c):
        buf.free()
    mm.close()
    assert _leaks(dev) == (0, 0, 0)


def _segment_cached_for_a_busy_stream(dev, mm, n: int) -> int:
    """Stream 0's expandable segment, wholly free, its one block lent to a second stream
    that is then busy (so it stays that stream's): the state the state machine reached."""
    s2 = dev.create_stream()
    mm.malloc(n).free()                          # stream 0's segment: one page, wholly free
    mm.malloc(n, stream=s2).free()               # stream 0 idle: its block moves to s2
    dev.submit(s2)
    [seg] = mm.pool.segments()
    assert [b["stream"] for b in seg["blocks"]] == [s2] and mm.pool.whole_free_bytes == PAGE
    return s2


def test_growth_past_a_block_of_another_stream_keeps_whole_free_bytes():
    """Regression (hypothesis, ExpandablePoolMachine): stream 0 grows its segment while the
    segment's only block, free, is cached for another stream; the segment is no longer wholly
    free, and the pool's whole_free_bytes counter (read without the lock by the cache cap
    and release_before_grow) must say so."""
    dev, mm = sim_manager("1GiB", segments="tight")
    _segment_cached_for_a_busy_stream(dev, mm, MiB + 1)
    c = mm.malloc(MiB + 1)                       # grows the segment past s2's free block
    [seg] = mm.pool.segments()
    assert [b["state"] for b in seg["blocks"]] == ["free", "allocated", "free"]
    assert seg["size"] == 2 * PAGE
    assert mm.pool.whole_free_bytes == 0
    check(mm, [c])                               # the pool's own recount agrees
    c.free()
    mm.close()
    assert _leaks(dev) == (0, 0, 0)


def test_trim_back_to_a_block_of_another_stream_counts_the_segment_wholly_free():
    """The converse: the OOM ladder of a failing batch unmaps the free page cached for the
    busy stream (after a device synchronize: inner pages go back too) and the batch's undo
    the pages it mapped. The segment, left all holes, is released with its reservation, and
    whole_free_bytes is back at 0 (not wrapped below it)."""
    dev, mm = sim_manager("256MiB", segments="tight")
    _segment_cached_for_a_busy_stream(dev, mm, MiB + 1)
    with pytest.raises(OutOfMemoryError):
        mm.allocate_batch([100 * MiB] * 3)       # two grow the segment, the third cannot fit
    assert mm.pool.segments() == [] and _leaks(dev) == (0, 0, 0)
    assert mm.pool.whole_free_bytes == 0 == mm.pool.reserved_bytes
    check(mm, [])
    mm.close()


def test_snapshot_text_and_segment_map_show_mapped_and_unmapped_bytes(tmp_path):
    """A snapshot gives each segment's mapped bytes (its size) and the reserved, unmapped
    address space after it; the text view names it and the segment map draws it."""
    from gpumem.observe.snapshot import format_snapshot, take_snapshot
    dev, mm = sim_manager("1GiB", segments="tight")
    bufs = [mm.malloc(10 * MiB), mm.malloc(4096)]
    snap = take_snapshot(mm)
    by_pool = {s["pool"]: s for s in snap["segments"]}
    large, small = by_pool["large"], by_pool["small"]
    assert large["mapped_bytes"] == large["size"] == 10 * MiB == dev.mapped_bytes
    assert large["unmapped_bytes"] == 1024 * MiB - 10 * MiB      # reservation = usable memory
    assert small["unmapped_bytes"] == 0 and small["mapped_bytes"] == small["size"]
    assert "1014.00 MiB more reserved, unmapped" in format_snapshot(snap)
    pytest.importorskip("matplotlib", reason="plots need matplotlib (extra 'plot')")
    from gpumem.observe.plot import plot_segments
    out = plot_segments(snap, tmp_path / "segments.png")
    assert (tmp_path / "segments.png").stat().st_size > 0 and out.endswith("segments.png")
    for b in bufs:
        b.free()
    mm.close()


def test_failed_batch_gives_back_the_pages_it_mapped():
    """allocate_batch undoes a failure completely with expandable segments too: the chunks
    its one-by-one requests mapped are unmapped again, the segment's earlier size kept."""
    dev, mm = sim_manager("256MiB", segments="tight")
    keep = mm.malloc(40 * MiB)
    before = (mm.pool.reserved_bytes, dev.mapped_bytes, _leaks(dev))
    with pytest.raises(OutOfMemoryError):
        mm.allocate_batch([100 * MiB, 100 * MiB, 100 * MiB])     # the third cannot fit
    assert (mm.pool.reserved_bytes, dev.mapped_bytes, _leaks(dev)) == before
    check(mm, [keep])
    mm.close()
