"""The caching pool's placement rules, seen through a MemoryManager on a simulated device:
rounding, small and large pools, segment sizes, hits and misses, splitting and coalescing,
max_split_size, and per-stream free lists."""
from __future__ import annotations

import pytest

from gpumem import CachingPool, MemoryConfig
from invariants import check

KiB = 1 << 10
MiB = 1 << 20


def seg_of(mm, buf) -> dict:
    """The pool segment holding `buf`."""
    handle, _ = buf.segment_location()
    (seg,) = [s for s in mm.pool.segments() if s["handle"] == handle]
    return seg


def blocks(mm, handle) -> list[tuple[int, int, str]]:
    (seg,) = [s for s in mm.pool.segments() if s["handle"] == handle]
    return [(b["offset"], b["size"], b["state"]) for b in seg["blocks"]]


# --- rounding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n, rounded", [(0, 512), (1, 512), (511, 512), (512, 512), (513, 1024),
                                        (4095, 4096), (4096, 4096), (4097, 4608),
                                        (MiB + 1, MiB + 512)])
def test_rounding_to_512(manager, n, rounded):
    assert manager.pool.round_size(n) == rounded
    buf = manager.malloc(n)
    st = manager.stats()
    assert buf.nbytes == n and len(buf) == n
    assert st.in_use_bytes == rounded
    assert st.requested_bytes == n
    assert st.rounding_bytes == rounded - n
    assert buf.ptr % 512 == 0
    check(manager, [buf])
    buf.free()
    check(manager, [])
    assert manager.stats().in_use_bytes == 0


def test_granularity_from_config(make_manager):
    mm = make_manager(granularity=4096)
    assert mm.pool.round_size(1) == 4096
    a, b = mm.malloc(1), mm.malloc(4097)
    assert b.ptr - a.ptr == 4096
    assert mm.stats().in_use_bytes == 4096 + 8192
    check(mm, [a, b])


def test_granularity_at_least_device_alignment(sim_device, make_manager):
    sim_device("1GiB", alignment=2048)
    mm = make_manager()
    assert mm.pool.granularity == 2048
    bufs = [mm.malloc(n) for n in (1, 100, 3000)]
    assert all(b.ptr % 2048 == 0 for b in bufs)
    check(mm, bufs)


def test_size_zero_is_a_valid_zero_length_buffer(manager):
    a = manager.malloc(0)
    b = manager.malloc(0)
    assert a.alive and a.nbytes == 0 and len(a) == 0
    assert a.ptr != b.ptr and a.id != b.id             # each takes its own 512-byte block
    seg = seg_of(manager, a)
    assert seg["base"] <= a.ptr < seg["base"] + seg["size"]
    assert a.copy_to_host().size == 0
    a.copy_from_host(b"")
    assert manager.stats().in_use_bytes == 1024
    assert manager.stats().requested_bytes == 0
    check(manager, [a, b])
    a.free()
    b.free()
    assert not a.alive
    check(manager, [])


# --- segment sizes and the two pools ----------------------------------------------------------
def test_small_requests_share_2mib_segments(manager):
    dev = manager.device
    bufs = [manager.malloc(n) for n in (1, 4096, 100_000, MiB)]
    segs = manager.pool.segments()
    assert len(segs) == 1
    assert segs[0]["size"] == 2 * MiB and segs[0]["pool"] == "small"
    assert dev.alloc_calls == 1 and dev.segments()[0].nbytes == 2 * MiB
    check(manager, bufs)


@pytest.mark.parametrize("n", [MiB + 1, 2 * MiB, 3 * MiB, 4 * MiB + 7, 5 * MiB, 10 * MiB - 512])
def test_medium_requests_get_about_20mib_holding_whole_blocks(make_manager, n):
    manager = make_manager(expandable_segments=False)  # plain segments: exact segment sizes
    rounded = manager.pool.round_size(n)
    seg_size = manager.pool.segment_size(n)
    assert seg_size % rounded == 0
    assert 20 * MiB - rounded < seg_size <= 20 * MiB
    if (20 * MiB) % rounded == 0:
        assert seg_size == 20 * MiB
    buf = manager.malloc(n)
    seg = seg_of(manager, buf)
    assert seg["size"] == seg_size and seg["pool"] == "large"
    # the segment holds seg_size // rounded such blocks with no second driver call
    more = [manager.malloc(n) for _ in range(seg_size // rounded - 1)]
    assert manager.device.alloc_calls == 1
    assert manager.stats().cached_bytes == 0
    check(manager, [buf] + more)


@pytest.mark.parametrize("n", [10 * MiB, 10 * MiB + 1, 12 * MiB + 3, 40 * MiB])
def test_large_requests_get_their_own_segment(make_manager, n):
    manager = make_manager(expandable_segments=False)  # plain segments: exact segment sizes
    buf = manager.malloc(n)
    seg = seg_of(manager, buf)
    assert seg["size"] == manager.pool.round_size(n)   # default large_round is 512: exact
    assert seg["pool"] == "large"
    assert len(seg["blocks"]) == 1
    check(manager, [buf])


def test_large_round_config(make_manager):
    mm = make_manager(large_round=2 * MiB, segments="tight")   # page-exact, like plain
    buf = mm.malloc(12 * MiB + 3)
    assert seg_of(mm, buf)["size"] == 14 * MiB
    check(mm, [buf])


def test_small_and_large_pools_do_not_mix(manager):
    small = manager.malloc(4096)                        # 2 MiB small segment, ~2 MiB free
    large = manager.malloc(MiB + 512)                   # must not come from the small segment
    assert seg_of(manager, large)["handle"] != seg_of(manager, small)["handle"]
    assert seg_of(manager, large)["pool"] == "large"
    big = manager.malloc(3 * MiB)                       # an 18 MiB segment with room to spare
    tiny = manager.malloc(512)                          # ... yet a small request uses the small pool
    assert seg_of(manager, tiny)["handle"] == seg_of(manager, small)["handle"]
    assert seg_of(manager, tiny)["pool"] == "small"
    check(manager, [small, large, big, tiny])


# --- hits and misses ------------------------------------------------------------------------------
def test_miss_then_hit_reuses_the_block_without_a_driver_call(manager):
    dev = manager.device
    a = manager.malloc(5000)
    st = manager.stats()
    assert (st.pool_misses, st.pool_hits, st.segments_created) == (1, 0, 1)
    ptr = a.ptr
    a.free()
    calls = dev.alloc_calls
    b = manager.malloc(5000)
    st = manager.stats()
    assert b.ptr == ptr
    assert (st.pool_misses, st.pool_hits) == (1, 1)
    assert dev.alloc_calls == calls
    c = manager.malloc(5000)                            # the rest of the segment: a hit too
    assert manager.stats().pool_hits == 2 and dev.alloc_calls == calls
    check(manager, [b, c])


def test_cache_is_reused_across_sizes(manager):
    bufs = [manager.malloc(n) for n in (4096, 8192, 16384)]
    for b in bufs:
        b.free()
    reserved = manager.stats().reserved_bytes
    again = [manager.malloc(n) for n in (16384, 4096, 8192, 100)]
    assert manager.stats().reserved_bytes == reserved
    assert manager.stats().pool_misses == 1
    check(manager, again)


# --- split and coalesce ---------------------------------------------------------------------------
def test_split_then_coalesce_free_b_then_a(manager):
    a, b, c = (manager.malloc(1000) for _ in range(3))
    h = seg_of(manager, a)["handle"]
    assert seg_of(manager, b)["handle"] == h == seg_of(manager, c)["handle"]
    assert (b.ptr - a.ptr, c.ptr - b.ptr) == (1024, 1024)
    a_ptr = a.ptr                         # a freed buffer refuses to say its address
    assert blocks(manager, h) == [(0, 1024, "allocated"), (1024, 1024, "allocated"),
                                  (2048, 1024, "allocated"), (3072, 2 * MiB - 3072, "free")]
    b.free()
    assert blocks(manager, h)[1] == (1024, 1024, "free")
    check(manager, [a, c])
    a.free()
    assert blocks(manager, h)[:2] == [(0, 2048, "free"), (2048, 1024, "allocated")]
    check(manager, [c])
    # the merged block serves a request that neither half could
    ab = manager.malloc(2048)
    assert ab.ptr == a_ptr
    check(manager, [ab, c])
    ab.free()
    c.free()
    assert blocks(manager, h) == [(0, 2 * MiB, "free")]
    assert manager.pool.whole_free_bytes == 2 * MiB
    check(manager, [])


def test_coalesce_with_both_neighbours(manager):
    a, b, c, d = (manager.malloc(4096) for _ in range(4))
    h = seg_of(manager, a)["handle"]
    a.free()
    c.free()
    assert len(blocks(manager, h)) == 5
    b.free()                                            # joins a and c
    assert blocks(manager, h)[:2] == [(0, 3 * 4096, "free"), (3 * 4096, 4096, "allocated")]
    check(manager, [d])
    d.free()
    assert blocks(manager, h) == [(0, 2 * MiB, "free")]
    check(manager, [])


def test_large_block_split_keeps_remainder(manager):
    big = manager.malloc(40 * MiB)
    h = seg_of(manager, big)["handle"]
    big.free()
    part = manager.malloc(30 * MiB)                     # no max_split_size: the block is split
    assert seg_of(manager, part)["handle"] == h
    assert blocks(manager, h) == [(0, 30 * MiB, "allocated"), (30 * MiB, 10 * MiB, "free")]
    rest = manager.malloc(10 * MiB)
    assert seg_of(manager, rest)["handle"] == h
    assert manager.stats().pool_misses == 1
    check(manager, [part, rest])


def test_small_remainder_of_large_block_is_not_split_off(make_manager):
    """A large block is split only when the remainder is at least large_split_min (1 MiB)."""
    # plain segments: expandable splits down to 64 KiB
    manager = make_manager(expandable_segments=False)
    big = manager.malloc(12 * MiB)
    h = seg_of(manager, big)["handle"]
    big.free()
    b = manager.malloc(12 * MiB - 512 * KiB)
    assert blocks(manager, h) == [(0, 12 * MiB, "allocated")]
    assert manager.stats().in_use_bytes == 12 * MiB
    assert manager.stats().requested_bytes == 12 * MiB - 512 * KiB
    check(manager, [b])


# --- max_split_size ----------------------------------------------------------------------------------
def test_max_split_size_keeps_oversize_blocks_whole(make_manager):
    # plain segments: expandable ignores max_split_size
    mm = make_manager(max_split_size=32 * MiB, release_before_grow=False, expandable_segments=False)
    big = mm.malloc(40 * MiB)
    h = seg_of(mm, big)["handle"]
    big.free()
    small = [mm.malloc(4 * MiB), mm.malloc(4096), mm.malloc(8 * MiB)]
    for b in small:
        assert seg_of(mm, b)["handle"] != h
    assert blocks(mm, h) == [(0, 40 * MiB, "free")]
    check(mm, small)
    # a request of at least max_split_size takes the cached block whole (within the slack)
    again = mm.malloc(35 * MiB)
    assert seg_of(mm, again)["handle"] == h
    assert blocks(mm, h) == [(0, 40 * MiB, "allocated")]
    check(mm, small + [again])


def test_max_split_size_oversize_block_not_taken_beyond_slack(make_manager):
    mm = make_manager(max_split_size=32 * MiB, oversize_slack=4 * MiB,
                      release_before_grow=False,
                      expandable_segments=False)  # plain segments: expandable ignores max_split_size
    big = mm.malloc(60 * MiB)
    h = seg_of(mm, big)["handle"]
    big.free()
    b = mm.malloc(40 * MiB)                            # 20 MiB too big: not a close fit
    assert seg_of(mm, b)["handle"] != h
    c = mm.malloc(57 * MiB)                            # within 4 MiB: taken whole
    assert seg_of(mm, c)["handle"] == h
    check(mm, [b, c])


def test_without_max_split_size_small_requests_split_big_blocks(make_manager):
    mm = make_manager(release_before_grow=False)
    big = mm.malloc(40 * MiB)
    h = seg_of(mm, big)["handle"]
    big.free()
    b = mm.malloc(4 * MiB)
    assert seg_of(mm, b)["handle"] == h
    check(mm, [b])


# --- streams -------------------------------------------------------------------------------------------
def test_block_freed_on_a_stream_is_reused_by_it_at_once(manager):
    dev = manager.device
    s = dev.create_stream()
    a = manager.malloc(MiB, stream=s)
    keep = manager.malloc(MiB, stream=s)
    assert a.stream == s
    loc = a.segment_location()
    a.free()
    dev.submit(s)                                       # work still pending on s
    b = manager.malloc(MiB, stream=s)
    assert b.segment_location() == loc
    check(manager, [keep, b])


def test_other_stream_waits_until_the_stream_is_idle(manager):
    dev = manager.device
    s, t = dev.create_stream(), dev.create_stream()
    a = manager.malloc(MiB, stream=s)
    keep = manager.malloc(MiB, stream=s)                # s's segment (2 MiB) is now full
    loc_a = a.segment_location()
    a.free()                                            # the only cached block, on s
    dev.submit(s)
    t1 = manager.malloc(MiB, stream=t)
    assert t1.segment_location()[0] != loc_a[0], "t got s's block while s had pending work"
    t2 = manager.malloc(MiB, stream=t)                  # t's own segment is now full
    assert t2.segment_location()[0] == t1.segment_location()[0]
    assert blocks(manager, loc_a[0])[0][2] == "free"    # s's block still cached for s
    t3_alloc_calls = dev.alloc_calls
    dev.complete(s)
    t3 = manager.malloc(MiB, stream=t)
    assert t3.segment_location() == loc_a, "t did not get s's block once s was idle"
    assert dev.alloc_calls == t3_alloc_calls
    assert t3.stream == t
    check(manager, [keep, t1, t2, t3])
    # freed again, it belongs to t: s reuses it only through the idle check
    t3.free()
    check(manager, [keep, t1, t2])
    assert [b["stream"] for b in seg_of(manager, keep)["blocks"]] == [t, s]


def test_stream_with_pending_work_never_lends_while_busy(manager):
    dev = manager.device
    s, t = dev.create_stream(), dev.create_stream()
    held = [manager.malloc(4096, stream=s) for _ in range(8)]
    freed_handles = {held[0].segment_location()[0]}
    for b in held[::2]:
        b.free()
    dev.submit(s, 3)
    got = [manager.malloc(4096, stream=t) for _ in range(6)]
    assert all(g.segment_location()[0] not in freed_handles for g in got)
    dev.complete(s, 2)                                  # one item still pending
    u = dev.create_stream()
    g = manager.malloc(4096, stream=u)
    assert g.segment_location()[0] not in freed_handles
    check(manager, held[1::2] + got + [g])


# --- record_stream: a block used on other streams waits for them -----------------------------------
def test_record_stream_defers_reuse_until_the_other_stream_passes(manager):
    dev = manager.device
    s = dev.create_stream()
    a = manager.malloc(MiB)                             # allocated on stream 0
    keep = manager.malloc(MiB)                          # the 2 MiB segment is full
    loc = a.segment_location()
    a.record_stream(s)
    dev.submit(s)                                       # a kernel on s still reads a
    a.free()
    assert not a.alive
    st = manager.stats()
    assert st.pending_free_bytes == MiB and st.active_buffers == 1
    assert manager.pending_free_ids() == {a.id}
    [seg] = manager.snapshot()["segments"]
    assert [(b["id"], b["pending_free"]) for b in seg["blocks"]] == [(a.id, True), (keep.id, False)]
    check(manager, [keep])
    b = manager.malloc(MiB)                             # stream 0 must not get a's bytes yet
    assert b.segment_location() != loc
    assert manager.pending_free_bytes == MiB
    dev.complete(s)
    c = manager.malloc(MiB)                             # collects the pending free, reuses it
    assert c.segment_location() == loc
    assert manager.stats().pending_free_bytes == 0
    assert dev.live_events == 0, "the event recorded at free() was not destroyed"
    check(manager, [keep, b, c])


def test_record_stream_on_the_allocation_stream_frees_at_once(manager):
    a = manager.malloc(4096)
    a.record_stream(0)
    assert a.used_on_streams == ()
    a.free()
    assert manager.pending_free_bytes == 0
    check(manager, [])


def test_dropped_buffer_with_recorded_stream_also_waits(manager):
    dev = manager.device
    s = dev.create_stream()
    a = manager.malloc(MiB)
    a.record_stream(s)
    dev.submit(s)
    del a                                               # RAII path
    assert manager.pending_free_bytes == MiB
    dev.complete(s)
    assert manager.collect_pending_frees() == 1
    assert manager.pending_free_bytes == 0 and dev.live_events == 0
    check(manager, [])


def test_oom_waits_for_pending_frees_before_failing(sim_device, make_manager):
    sim_device("64MiB", back_memory=True)
    mm = make_manager(cpu_fallback_enabled=False)
    dev = mm.device
    s = dev.create_stream()
    big = mm.malloc(mm.usable_memory // 2 + MiB)        # two of these cannot coexist
    big.record_stream(s)
    dev.submit(s)
    big.free()
    again = mm.malloc(mm.usable_memory // 2 + MiB)      # the ladder synchronizes, then reuses
    assert mm.pending_free_bytes == 0
    assert dev.pending(s) == 0
    check(mm, [again])


def test_record_stream_bad_input_leaves_the_buffer_as_it_was(manager):
    from gpumem import InvalidInputError
    a = manager.malloc(4096)
    with pytest.raises(InvalidInputError, match="not a stream of sim:0"):
        a.record_stream(12345)
    with pytest.raises(TypeError, match="stream must be"):
        a.record_stream("s1")
    assert a.used_on_streams == ()
    a.free()
    with pytest.raises(InvalidInputError, match="has been freed"):
        a.record_stream(0)
    assert manager.pending_free_bytes == 0
    check(manager, [])


def test_close_with_pending_frees_releases_their_events(manager):
    dev = manager.device
    s = dev.create_stream()
    a = manager.malloc(MiB)
    a.record_stream(s)
    dev.submit(s)
    a.free()
    manager.close()
    assert dev.live_events == 0 and dev.live_segments == 0


def test_idle_segment_split_between_streams_does_not_double_reserved(make_manager):
    """S's 20 MiB segment lends a block to T; once both blocks are freed (and no work is
    pending) the segment is entirely free, in three pieces filed under two streams. A 20 MiB
    request must then not leave 40 MiB reserved: the pieces should be merged, or the idle
    segment released before growing (as release_before_grow does for single-piece segments)."""
    # plain segments: a segment lent across streams
    manager = make_manager(expandable_segments=False)
    dev = manager.device
    s, t = dev.create_stream(), dev.create_stream()
    x = manager.malloc(4 * MiB, stream=s)              # 20 MiB segment, 16 MiB cached on s
    y = manager.malloc(4 * MiB, stream=t)              # t borrows from idle s
    assert y.segment_location()[0] == x.segment_location()[0]
    x.free()
    y.free()
    check(manager, [])
    assert manager.stats().cached_bytes == 20 * MiB and dev.stream_idle(s) and dev.stream_idle(t)
    z = manager.malloc(20 * MiB, stream=s)
    check(manager, [z])
    assert manager.stats().reserved_bytes == 20 * MiB, manager.stats()


def test_stream_objects_with_handle_attribute(manager):
    class Stream:
        def __init__(self, handle):
            self.handle = handle

    s = Stream(manager.device.create_stream())
    b = manager.malloc(100, stream=s)
    assert b.stream == s.handle
    check(manager, [b])


def test_idle_stream_lends_at_once_and_mixed_segment_is_released(manager):
    """A new stream borrows from an idle stream's cache before growing; a segment whose free
    blocks then sit in two streams' heaps is still wholly free for empty_cache."""
    dev = manager.device
    t = dev.create_stream()
    a = manager.malloc(4096)
    keep = manager.malloc(4096)
    a.free()
    calls = dev.alloc_calls
    b = manager.malloc(4096, stream=t)
    assert b.segment_location()[0] == keep.segment_location()[0]
    assert dev.alloc_calls == calls
    assert manager.stats().pool_hits == 2
    check(manager, [keep, b])
    keep.free()
    b.free()
    streams = {blk["stream"] for blk in manager.pool.segments()[0]["blocks"]}
    assert streams == {0, t}
    check(manager, [])
    assert manager.empty_cache() == 2 * MiB
    assert manager.stats().reserved_bytes == 0
    assert dev.live_bytes == 0
    check(manager, [])


# --- the pool object itself ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(granularity=0), dict(granularity=3),
                                    dict(granularity=768),
                                    dict(small_size=4 * MiB, small_segment=2 * MiB),
                                    dict(large_segment=MiB, large_threshold=2 * MiB),
                                    dict(large_round=0)])
def test_caching_pool_rejects_bad_geometry(kwargs):
    with pytest.raises(ValueError):
        CachingPool(**kwargs)


def test_caching_pool_standalone():
    pool = CachingPool()
    assert pool.granularity == 512 and pool.small_size == MiB
    assert pool.round_size(0) == 512 and pool.round_size(1 << 40) == 1 << 40
    assert pool.segment_size(100) == 2 * MiB
    assert pool.has_stream(0) and not pool.has_stream(7)
    pool.register_stream(7)
    assert pool.has_stream(7)
    assert pool.segments() == []
    assert pool.release_free_segments() == []
    assert pool.largest_free_block() == 0
    c = pool.counters()
    assert all(v == 0 for v in c.values()), c
    pool.check_invariants()


def test_restore_segment_round_trip(manager):
    a = manager.malloc(4096)
    a.free()
    before = manager.pool.segments()
    (desc,) = manager.pool.release_free_segments()
    assert manager.pool.reserved_bytes == 0
    manager.pool.restore_segment(*desc)
    after = manager.pool.segments()
    assert [(s["handle"], s["base"], s["size"], s["pool"]) for s in after] == \
           [(s["handle"], s["base"], s["size"], s["pool"]) for s in before]
    check(manager, [])
    b = manager.malloc(4096)
    assert b.ptr == before[0]["base"]
    check(manager, [b])


def test_config_default_pool_geometry_matches_pool():
    cfg = MemoryConfig()
    assert (cfg.granularity, cfg.small_size, cfg.small_segment, cfg.large_segment,
            cfg.large_threshold) == (512, MiB, 2 * MiB, 20 * MiB, 10 * MiB)


def test_the_invariant_checker_can_fail(sim_device, make_manager):
    """check() is only worth calling everywhere if it notices a wrong picture."""
    sim_device("1GiB", count=2, back_memory=True)
    manager, other = make_manager("sim:0"), make_manager("sim:1")
    a = manager.malloc(4096)
    b = manager.malloc(4096)
    check(manager, [a, b])
    with pytest.raises(AssertionError):
        check(manager, [a])                              # one live buffer unaccounted for
    c = other.malloc(4096)
    with pytest.raises(AssertionError):
        check(manager, [a, b, c])                        # c is not a block of this pool
    # the device disagreeing with the pool (a segment the pool does not know) is noticed
    handle, _ = manager.device.alloc_segment(4096)
    with pytest.raises(AssertionError):
        check(manager, [a, b])
    manager.device.free_segment(handle)
    check(manager, [a, b])
    check(other, [c])
