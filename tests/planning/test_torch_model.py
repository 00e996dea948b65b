"""The model of PyTorch's CUDA caching allocator (issue 20 item 1): its decisions are the ones
``c10/cuda/CUDACachingAllocator.cpp`` makes, on the cases PyTorch's source and its own tests
fix (test_cuda.py ``test_allocator_settings`` for rounding and the config errors).

Level: real. The model is pure Python with no device; every figure below is derived by hand
from PyTorch's rules (the comment next to each says which), so a change of policy fails here.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

import gpumem
from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.planning.torch_conf import UNLIMITED, parse_torch_conf
from gpumem.planning.torch_model import TorchAllocatorModel, allocation_size, round_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def model(conf: str = "", capacity: int = 8 * GiB, **kw) -> TorchAllocatorModel:
    return TorchAllocatorModel(capacity, conf, **kw)


def blocks(m: TorchAllocatorModel) -> list[list[tuple[int, bool]]]:
    return [[(b["size"], b["allocated"]) for b in s["blocks"]] for s in m.segments()]


def power2_div(size: int, div: int) -> int:
    """torch's test_allocator_settings reference: walk up from the lower power of two in
    steps of 1/div of it (an independent way to the same value as round_size)."""
    pow2 = 1
    while pow2 < size:
        pow2 *= 2
    if pow2 == size:
        return pow2
    step = pow2 // 2 // div
    ret = pow2 // 2
    while ret < size:
        ret += step
    return ret


# --- rounding -----------------------------------------------------------------------------------
def test_sizes_round_to_512_bytes_by_default():
    """Below 512 B a request takes 512 B; above, the next multiple of 512 (round_size)."""
    conf = parse_torch_conf("")
    assert [round_size(n, conf) for n in (1, 511, 512, 513, 1536, 84 * MiB + 1)] == \
        [512, 512, 512, 1024, 1536, 84 * MiB + 512]


def test_roundup_power2_divisions_matches_torch_test_values():
    """test_allocator_settings: 84 MiB (21M floats) stays 84 MiB by default, rounds to
    power2_div(84 MiB, 4) = 96 MiB with 4 divisions, 88 MiB with the list form's 64:8, and
    400 MiB to 512 MiB under its 256:2."""
    nbytes, big = 84 * MiB, 400 * MiB
    assert round_size(nbytes, parse_torch_conf("")) == nbytes
    assert round_size(nbytes, parse_torch_conf("roundup_power2_divisions:4")) == \
        power2_div(nbytes, 4) == 96 * MiB
    lst = parse_torch_conf("garbage_collection_threshold:0.5,"
                           "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
    assert round_size(nbytes, lst) == power2_div(nbytes, 8) == 88 * MiB
    assert round_size(big, lst) == power2_div(big, 2) == 512 * MiB


@pytest.mark.parametrize("div", [2, 4, 8, 16])
def test_roundup_power2_divisions_on_random_sizes(div):
    """Over 3,000 random sizes: above 512*div bytes round_size is torch's power2_div, below it
    a multiple of 512; never smaller than the request."""
    conf = parse_torch_conf(f"roundup_power2_divisions:{div}")
    rng = random.Random(div)
    for _ in range(3000):
        n = int(2 ** rng.uniform(0, 36))
        got = round_size(n, conf)
        want = power2_div(n, div) if n > 512 * div else max(512, -(-n // 512) * 512)
        assert got == want >= n, n


def test_roundup_list_form_intervals_and_the_overwrite_quirk():
    """The first listed interval also sets all below it; '>' sets from the last listed one
    on, that one included (PyTorch fills from last_index): in [256:1,512:2,>:4] the 512 MiB
    interval ends up with 4, not 2."""
    conf = parse_torch_conf("roundup_power2_divisions:[256:1,512:2,>:4]")
    assert conf.divisions(1 * MiB) == conf.divisions(300 * MiB) == 1
    assert conf.divisions(600 * MiB) == 4
    assert conf.divisions(2 * GiB) == 4
    assert parse_torch_conf("roundup_power2_divisions:[>:8]").roundup_power2_divisions == (8,) * 16


# --- pools and segment sizes --------------------------------------------------------------------
@pytest.mark.parametrize("request_bytes,segment", [
    (1, 2 * MiB), (512 * KiB, 2 * MiB), (1 * MiB, 2 * MiB),                 # small pool
    (1 * MiB + 1, 20 * MiB), (10 * MiB - 512, 20 * MiB),                    # kLargeBuffer
    (10 * MiB, 10 * MiB), (10 * MiB + 1, 12 * MiB), (21 * MiB, 22 * MiB),   # kRoundLarge
])
def test_segment_size_per_request_size(request_bytes, segment):
    """get_allocation_size: <= 1 MiB -> a 2 MiB segment; < 10 MiB -> 20 MiB; else the rounded
    request rounded up to 2 MiB."""
    m = model()
    m.malloc(request_bytes)
    assert m.reserved_bytes == segment == allocation_size(round_size(request_bytes, m.conf))
    assert m.driver_call_counts == {"segment_alloc": 1}


def test_small_requests_pack_into_2mib_segments_and_never_use_the_large_pool():
    """Four 512 KiB blocks share one 2 MiB segment, the fifth opens another; a small request
    does not take a cached large-pool block."""
    m = model()
    big = m.malloc(4 * MiB)
    m.free(big)                                        # 20 MiB cached in the large pool
    for _ in range(4):
        m.malloc(512 * KiB)
    assert m.reserved_bytes == 22 * MiB
    m.malloc(512 * KiB)
    assert m.reserved_bytes == 24 * MiB


def test_best_fit_smallest_block_then_lowest_address():
    """get_free_block takes the smallest cached block that fits; of equal sizes the lowest
    address."""
    m = model()
    a = m.malloc(4 * MiB)                              # one 20 MiB segment, split up
    m.malloc(2 * MiB)
    c = m.malloc(6 * MiB)
    m.malloc(2 * MiB)                                  # 6 MiB left at the end
    m.free(a)
    m.free(c)                                          # free: 4, 6 (c), 6 (tail)
    assert m.malloc(3 * MiB) == a
    assert m.malloc(5 * MiB) == c
    assert m.reserved_bytes == 20 * MiB


def test_streams_have_their_own_cached_blocks():
    """A block freed on stream 1 is not handed to stream 0."""
    m = model()
    m.free(m.malloc(4 * MiB, stream=1))
    m.malloc(4 * MiB, stream=0)
    assert m.reserved_bytes == 40 * MiB
    m.malloc(4 * MiB, stream=1)
    assert m.reserved_bytes == 40 * MiB


# --- splitting and merging ----------------------------------------------------------------------
def test_large_pool_splits_only_when_more_than_1mib_remains():
    """should_split (large pool): the remainder must exceed kSmallSize (1 MiB). 19 MiB in a
    20 MiB segment keeps the whole block (1 MiB lost); 18.5 MiB splits off 1.5 MiB."""
    m = model()
    m.malloc(19 * MiB)
    assert blocks(m) == [[(20 * MiB, True)]] and m.allocated_bytes == 20 * MiB
    m = model()
    m.malloc(18 * MiB + 512 * KiB)
    assert blocks(m) == [[(18 * MiB + 512 * KiB, True), (1536 * KiB, False)]]


def test_small_pool_splits_down_to_512_bytes():
    """should_split (small pool): a remainder of 512 B is split off, so a 1536 B cached block
    serves a 1024 B request and keeps 512 B free."""
    m = model()
    x = m.malloc(1536)
    m.malloc(512)
    m.free(x)
    assert m.malloc(1024) == x
    assert blocks(m)[0][:3] == [(1024, True), (512, False), (512, True)]


def test_free_merges_with_free_neighbours_and_empty_cache_releases_whole_segments():
    """free_block merges a block with free neighbours of its segment, in any order; a
    segment is returned to the driver (cudaFree) only when it is one free block."""
    m = model()
    a, b, c = m.malloc(2 * MiB), m.malloc(2 * MiB), m.malloc(2 * MiB)
    m.free(b)
    assert blocks(m) == [[(2 * MiB, True), (2 * MiB, False), (2 * MiB, True), (14 * MiB, False)]]
    m.free(a)
    m.empty_cache()                                    # c still splits the segment: kept
    assert m.reserved_bytes == 20 * MiB
    m.free(c)
    assert blocks(m) == [[(20 * MiB, False)]]
    m.empty_cache()
    assert m.reserved_bytes == 0 and m.segments() == []
    assert m.driver_call_counts == {"segment_alloc": 1, "segment_free": 1}


# --- max_split_size_mb and oversize blocks -----------------------------------------------------
def test_oversize_block_is_not_given_to_a_smaller_request():
    """With max_split_size_mb:40 a cached 50 MiB block is oversize: a 30 MiB request gets a
    segment of its own; without the setting it takes (and splits) the 50 MiB block."""
    m = model("max_split_size_mb:40")
    m.free(m.malloc(50 * MiB))
    m.malloc(30 * MiB)
    assert m.reserved_bytes == 80 * MiB
    m = model()
    m.free(m.malloc(50 * MiB))
    m.malloc(30 * MiB)
    assert m.reserved_bytes == 50 * MiB and blocks(m) == [[(30 * MiB, True), (20 * MiB, False)]]


def test_oversize_request_takes_a_block_less_than_20mib_larger_unsplit():
    """An oversize request takes a cached block only if block < request + 20 MiB
    (max_non_split_rounding_mb), and never splits it: a 62 MiB block serves 42 MiB + 512 B but
    not 42 MiB."""
    m = model("max_split_size_mb:40")
    m.free(m.malloc(62 * MiB))
    m.malloc(42 * MiB)                                 # 62 >= 42 + 20: a new segment
    assert m.reserved_bytes == 104 * MiB
    m = model("max_split_size_mb:40")
    m.free(m.malloc(62 * MiB))
    m.malloc(42 * MiB + 1)                             # rounds to 42 MiB + 512 B: reused
    assert m.reserved_bytes == 62 * MiB and m.allocated_bytes == 62 * MiB
    m = model("max_split_size_mb:40,max_non_split_rounding_mb:30")
    m.free(m.malloc(62 * MiB))
    m.malloc(42 * MiB)                                 # 62 < 42 + 30
    assert m.reserved_bytes == 62 * MiB


# --- out of memory: release and retry -----------------------------------------------------------
def test_failed_cudamalloc_frees_the_cache_and_retries():
    """cudaMalloc refused -> release_cached_blocks (every cached whole segment) -> retry."""
    m = model(capacity=64 * MiB)
    m.free(m.malloc(30 * MiB))
    m.malloc(40 * MiB)
    assert m.reserved_bytes == 40 * MiB and m.num_ooms == 0 and m.num_alloc_retries == 1
    assert m.driver_call_counts == {"segment_alloc": 3, "segment_free": 1}


def test_oom_when_only_split_segments_are_cached_leaves_the_model_usable():
    """A free block inside a segment still in use cannot be released: torch raises, the
    OOM is counted, and the live block stays valid."""
    m = model(capacity=40 * MiB)
    a = m.malloc(2 * MiB)
    m.free(m.malloc(12 * MiB))                         # 18 MiB free, but in a's segment
    with pytest.raises(OutOfMemoryError) as exc:
        m.malloc(22 * MiB)
    assert "torch" in str(exc.value) and m.num_ooms == 1
    assert m.reserved_bytes == 20 * MiB and m.allocated_bytes == 2 * MiB
    m.free(a)
    assert m.allocated_bytes == 0


def test_release_available_frees_oversize_blocks_first():
    """With max_split_size set, a refused cudaMalloc first frees the smallest cached oversize
    block at least as large as the request (here the 76 MiB one, which the 50 MiB request may
    not take: 76 >= 50 + 20), keeping the 40 MiB one; no full release, no retry counted."""
    m = model("max_split_size_mb:30", capacity=120 * MiB)
    x, y = m.malloc(40 * MiB), m.malloc(76 * MiB)
    m.free(x)
    m.free(y)
    m.malloc(50 * MiB)
    assert m.reserved_bytes == 90 * MiB and m.num_alloc_retries == 0
    assert sorted(s["total_size"] for s in m.segments()) == [40 * MiB, 50 * MiB]


def test_release_available_frees_several_oversize_blocks_from_the_largest():
    """No single cached oversize block is large enough: they are freed largest first until
    their bytes cover the request."""
    m = model("max_split_size_mb:30", capacity=100 * MiB)
    x, y = m.malloc(40 * MiB), m.malloc(40 * MiB)
    m.free(x)
    m.free(y)
    m.malloc(50 * MiB)
    assert m.reserved_bytes == 50 * MiB and m.driver_call_counts["segment_free"] == 2
    assert m.num_alloc_retries == 0


# --- garbage collection ----------------------------------------------------------------------------
def _gc_workload(m: TorchAllocatorModel, reuse: int = 3) -> None:
    m.malloc(2 * MiB)                                  # keeps its 20 MiB segment split
    a, b = m.malloc(30 * MiB), m.malloc(30 * MiB)
    m.free(a)                                          # a becomes old while...
    for _ in range(reuse):
        m.free(m.malloc(2 * MiB))                      # ...lookups pass
    m.free(b)                                          # b is young
    m.malloc(40 * MiB)


def test_garbage_collection_frees_the_oldest_cached_blocks_over_the_threshold():
    """garbage_collection_threshold:0.5 with a 100 MiB per-process limit: at 80 MiB reserved
    a miss frees cached whole segments older than the average age (a, not b) until 30 MiB are
    reclaimed, before asking the driver."""
    m = model("garbage_collection_threshold:0.5", capacity=200 * MiB, memory_fraction=0.5)
    _gc_workload(m)
    assert m.reserved_bytes == 90 * MiB
    assert sorted(s["total_size"] for s in m.segments()) == [20 * MiB, 30 * MiB, 40 * MiB]


def test_garbage_collection_needs_a_memory_fraction_as_in_torch():
    """PyTorch collects only when set_per_process_memory_fraction was called: with the
    threshold alone nothing is freed."""
    m = model("garbage_collection_threshold:0.5", capacity=200 * MiB)
    _gc_workload(m)
    assert m.reserved_bytes == 120 * MiB


def test_memory_fraction_caps_reserved_bytes_without_a_driver_call():
    """Over the fraction, alloc_block fails before cudaMalloc; the cache is released and the
    request retried within the limit."""
    m = model(capacity=100 * MiB, memory_fraction=0.5)
    m.free(m.malloc(30 * MiB))
    m.malloc(30 * MiB + 2 * MiB)
    assert m.reserved_bytes == 32 * MiB
    assert m.driver_call_counts == {"segment_alloc": 2, "segment_free": 1}
    with pytest.raises(OutOfMemoryError):
        m.malloc(20 * MiB)


# --- expandable segments -----------------------------------------------------------------------------
def test_expandable_segment_grows_by_pages_and_tiles_requests():
    """expandable_segments:True: small requests map 2 MiB pages, large ones 20 MiB pages, in
    one segment per pool that grows at its end; blocks split down to 512 B."""
    m = model("expandable_segments:True")
    m.malloc(100)
    assert m.reserved_bytes == 2 * MiB
    m.malloc(3 * MiB)
    m.malloc(30 * MiB)                                 # 17 MiB free + one more 20 MiB page
    assert m.reserved_bytes == 42 * MiB
    large = [s for s in m.segments() if s["pool"] == "large"]
    assert len(large) == 1 and large[0]["expandable"]
    assert [(b["size"], b["allocated"]) for b in large[0]["blocks"]] == \
        [(3 * MiB, True), (30 * MiB, True), (7 * MiB, False)]
    c = m.driver_call_counts
    assert c["vm_reserve"] == 2 and c["vm_create"] == c["vm_map"] == 3
    assert c["vm_set_access"] == 3


def test_expandable_pages_stay_mapped_until_empty_cache_unmaps_whole_free_pages():
    """Freed blocks keep their pages; empty_cache unmaps only pages wholly free, and releases
    a segment once nothing in it is mapped."""
    m = model("expandable_segments:True")
    a, b = m.malloc(3 * MiB), m.malloc(30 * MiB)
    m.free(b)
    assert m.reserved_bytes == 40 * MiB
    m.empty_cache()                                    # page 1 is free, page 0 holds a
    assert m.reserved_bytes == 20 * MiB
    m.free(a)
    m.empty_cache()
    assert m.reserved_bytes == 0 and m.segments() == []
    c = m.driver_call_counts
    assert c["vm_unmap"] == c["vm_release"] == 2 and c["vm_free"] == 1
    assert c["synchronize"] == 2


def test_expandable_out_of_memory_after_unmapping_what_it_can():
    """A page that does not fit is refused (cuMemCreate); nothing whole is free to unmap, so
    after the retry torch raises."""
    m = model("expandable_segments:True", capacity=50 * MiB)
    m.malloc(30 * MiB)
    with pytest.raises(OutOfMemoryError):
        m.malloc(15 * MiB)
    assert m.num_ooms == 1 and m.reserved_bytes == 40 * MiB
    assert m.driver_call_counts["vm_create"] == 4      # 2 mapped, 2 refused


def test_expandable_best_fit_prefers_a_block_over_the_growable_tail():
    """get_free_block counts the unmapped space after a segment's last free block as its
    size, so a closely fitting block elsewhere is taken first."""
    m = model("expandable_segments:True")
    a = m.malloc(6 * MiB)
    m.malloc(2 * MiB)
    m.free(a)                                          # free: 6 MiB at 0, 12 MiB tail
    assert m.malloc(5 * MiB) == a
    m2 = model("expandable_segments:True")
    a = m2.malloc(16 * MiB)
    m2.malloc(2 * MiB)
    m2.free(a)                                         # free: 16 MiB at 0, 2 MiB tail
    assert m2.malloc(1536 * KiB) == a                  # not the 2 MiB tail


# --- configuration and bad input ---------------------------------------------------------------------
@pytest.mark.parametrize("conf,key", [
    ("foo:1,bar:2", "foo"), ("garbage_collection_threshold:1.2", "garbage_collection_threshold"),
    ("max_split_size_mb:2", "max_split_size_mb"), ("max_split_size_mb:40.5", "max_split_size_mb"),
    ("max_split_size_mb", "max_split_size_mb"), ("expandable_segments:true", "expandable_segments"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[64:3]", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[100:2]", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[64:2", "roundup_power2_divisions"),
    ("backend:cudaMallocAsync", "cudaMallocAsync"),
    ("pinned_num_register_threads:1024", "pinned_num_register_threads"),
    ("max_split_size_mb:40;expandable_segments:True", "max_split_size_mb"),
])
def test_bad_conf_strings_name_the_key(conf, key):
    """Unknown keys and bad values raise InvalidInputError naming the key (torch raises on
    the same strings in test_allocator_settings)."""
    with pytest.raises(InvalidInputError, match=key):
        TorchAllocatorModel(GiB, conf)


def test_conf_syntax_as_torch_reads_it():
    """Spaces are ignored, a trailing comma is allowed, keys without effect on placement are
    accepted, and the last of a repeated key wins."""
    c = parse_torch_conf(" max_split_size_mb : 128 , expandable_segments:True,")
    assert c.max_split_size == 128 * MiB and c.expandable_segments
    c = parse_torch_conf("backend:native,release_lock_on_cudamalloc:True,"
                         "pinned_num_register_threads:8,max_split_size_mb:64,max_split_size_mb:96")
    assert c.max_split_size == 96 * MiB and not c.expandable_segments
    assert parse_torch_conf("").max_split_size == UNLIMITED


def test_bad_arguments_raise_and_leave_the_model_unchanged():
    """Bad sizes, streams, capacities and frees are InvalidInputError; state is kept."""
    for args in [(0,), ("-1",), (GiB, "", 1.5)]:
        with pytest.raises(InvalidInputError):
            if len(args) == 3:
                TorchAllocatorModel(args[0], args[1], memory_fraction=args[2])
            else:
                TorchAllocatorModel(*args)
    m = model()
    a = m.malloc(4 * KiB)
    before = (m.allocated_bytes, m.reserved_bytes, blocks(m))
    for bad in (-1, 1.5, True, "4KiB"):
        with pytest.raises(InvalidInputError):
            m.malloc(bad)
    with pytest.raises(InvalidInputError):
        m.malloc(1, stream=-1)
    with pytest.raises(InvalidInputError):
        m.free(a + 512)
    m.free(a)
    with pytest.raises(InvalidInputError):
        m.free(a)                                      # double free
    assert (m.allocated_bytes, m.reserved_bytes) == (0, before[1])


def test_zero_bytes_is_a_null_pointer_and_huge_requests_are_refused():
    """torch's allocate(): 0 bytes gives a null pointer without touching the pools; 1 EB or
    more is an OutOfMemoryError before the allocator runs."""
    m = model()
    assert m.malloc(0) == 0 and m.reserved_bytes == 0
    m.free(0)
    with pytest.raises(OutOfMemoryError):
        m.malloc(1 << 60)
    assert m.num_ooms == 0 and m.driver_calls == 0


def test_exported_from_gpumem_lazily():
    """gpumem.TorchAllocatorModel is the model, loaded on first use."""
    assert gpumem.TorchAllocatorModel is TorchAllocatorModel
    assert "TorchAllocatorModel" in dir(gpumem)


# --- invariants under random workloads ------------------------------------------------------------
def check_invariants(m: TorchAllocatorModel) -> None:
    """The model's books balance: segments are tiled by linked, contiguous blocks; free
    neighbours are always merged; every free block is findable; counters match the blocks."""
    from gpumem.planning.torch_model import _ADDR_MASK
    by_addr = {**m._cached, **m._unmapped_blocks, **m._active}
    assert len(by_addr) == len(m._cached) + len(m._unmapped_blocks) + len(m._active)
    seen, mapped_total = 0, 0
    for base, seg in m._segments.items():
        b, prev = by_addr[base], None
        assert b.prev is None
        while b is not None:
            seen += 1
            assert b.prev is prev and b.seg is seg
            assert by_addr[b.addr] is b
            if prev is not None:
                assert prev.addr + prev.size == b.addr
                assert b.stream == prev.stream and b.small == prev.small
                assert prev.allocated or b.allocated or prev.mapped != b.mapped, "unmerged"
            if b.mapped:
                mapped_total += b.size
            elif seg is not None:
                assert (b.addr - seg.base) % seg.page == 0 and b.size % seg.page == 0
            prev, b = b, b.next
        if seg is not None:
            assert prev.addr + prev.size == seg.base + seg.n_pages * seg.page
    assert seen == len(by_addr)
    assert mapped_total == m.reserved_bytes == m._device_used <= m.capacity
    assert m.allocated_bytes == sum(b.size for b in m._active.values())
    keys = [(k, small) for small in (False, True) for lst in m._free[small].values() for k in lst]
    assert len(keys) == len(m._cached)
    for k, small in keys:
        b = m._cached[k & _ADDR_MASK]
        assert (b.size << 64 | b.addr) == k and b.small == small and not b.allocated
    for small in (False, True):
        for lst in list(m._free[small].values()) + list(m._unmapped[small].values()):
            assert lst == sorted(lst)


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:40", "roundup_power2_divisions:4",
                                  "expandable_segments:True",
                                  "expandable_segments:True,max_split_size_mb:64",
                                  "garbage_collection_threshold:0.6"])
def test_invariants_hold_under_random_workloads(conf):
    """3,000 random mallocs/frees (1 B..64 MiB, two streams) on a 512 MiB device, with OOMs,
    retries, garbage collection and empty_cache along the way: the invariants hold after every
    step, and freeing everything leaves no allocated byte."""
    rng = random.Random(hash(conf) & 0xFFFF)
    m = TorchAllocatorModel(512 * MiB, conf, memory_fraction=0.9)
    live: list[int] = []
    ooms = 0
    for step in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 60):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(m.malloc(int(2 ** rng.uniform(0, 26)), stream=rng.randrange(2)))
            except OutOfMemoryError:
                ooms += 1
        if step % 500 == 499:
            m.empty_cache()
        check_invariants(m)
    for a in live:
        m.free(a)
    check_invariants(m)
    assert m.allocated_bytes == 0 and m.num_ooms == ooms
    m.empty_cache()
    assert m.reserved_bytes == 0 and m.segments() == []


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_invariants_hold_after_a_shipped_trace(conf):
    """The model's books balance after replaying a real trace's events."""
    from gpumem.observe.trace import read_trace
    data = read_trace(Path(gpumem.__file__).parent / "data" / "resnet50_train_step1.csv.gz")
    m = TorchAllocatorModel(80 * GiB, conf)
    handles = {}
    for op, i, n in zip(data.ops.tolist(), data.ids.tolist(), data.sizes.tolist()):
        if op == 0:
            handles[i] = m.malloc(n)
        else:
            m.free(handles.pop(i))
    check_invariants(m)
    assert m.allocated_bytes == 0


def test_driver_calls_are_priced_by_the_sim_cost_model():
    """modeled_driver_seconds is the sum of gpumem_sim.driver_costs prices of the calls made;
    a refused cudaMalloc costs its fixed part only."""
    from gpumem_sim.driver_costs import DriverCostModel
    cost = DriverCostModel().cost
    m = model(capacity=64 * MiB)
    m.free(m.malloc(30 * MiB))
    m.malloc(40 * MiB)                         # refused once, then retried after a cudaFree
    want = (cost("segment_alloc", 30 * MiB) + cost("segment_alloc", 0)
            + cost("segment_free", 30 * MiB) + cost("segment_alloc", 40 * MiB))
    assert m.modeled_driver_seconds == pytest.approx(want)
    e = model("expandable_segments:True")
    e.malloc(3 * MiB)
    assert e.modeled_driver_seconds == pytest.approx(
        cost("vm_reserve") + cost("vm_create", 20 * MiB) + cost("vm_map") + cost("vm_set_access"))
