"""The OOM ladder of MemoryManager, observed through the simulated driver's call log.

Order under test: best fit from the cache -> a new segment (within usable_memory and
min_free_bytes, checked *before* the driver is asked) -> release cached free segments and retry
-> OOM callbacks (which may free; then retry) -> CPU fallback when enabled -> OutOfMemoryError
carrying requested / free / total / in use / cached / limit / largest free block. A failed
malloc leaves every counter as it was, except num_ooms.

Sizes are chosen so every segment is exact: requests of 10 MiB and more get a segment of their
own size (large_threshold), so usable memory is counted in whole requests.
"""
from __future__ import annotations

import dataclasses

import pytest

from gpumem import FallbackBuffer, MemoryManager
from gpumem.errors import DriverError, OutOfMemoryError
from gpumem.units import format_bytes
from gpumem_sim import SimDevice
from invariants import QUIET, sim_manager

MiB = 1 << 20


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


def make(capacity: int = 1000 * MiB, **kw) -> tuple[SimDevice, MemoryManager]:
    """``sim_manager`` with the QUIET config (exact usable memory, no automatic responses)."""
    return sim_manager(capacity, base=QUIET, **kw)


def ops(dev: SimDevice, start: int) -> list[tuple[str, int, str]]:
    """Driver calls since ``start`` as (op, MiB, outcome)."""
    return [(c.op, c.nbytes // MiB, c.outcome) for c in list(dev.calls)[start:]]


def counters(mm: MemoryManager) -> dict:
    d = dataclasses.asdict(mm.stats())
    d.pop("num_ooms")
    return d


# --- rung 1: the cache ------------------------------------------------------------------------
def test_cache_hit_asks_nothing_of_the_driver():
    dev, mm = make()
    mm.malloc(100 * MiB).free()
    start, hits = len(dev.calls), mm.stats().pool_hits
    buf = mm.malloc(100 * MiB)
    assert ops(dev, start) == []
    assert mm.stats().pool_hits == hits + 1
    assert buf.alive


def test_cache_is_best_fit():
    dev, mm = make()
    a = mm.malloc(100 * MiB)
    b = mm.malloc(30 * MiB)
    keep = mm.malloc(50 * MiB)
    seg_b = b.segment_location()[0]
    a.free()
    b.free()
    c = mm.malloc(25 * MiB)                   # fits both cached segments: the 30 MiB one wins
    assert c.segment_location()[0] == seg_b
    assert keep.alive


# --- rung 2/3: new segment, then release the cache and retry --------------------------------------
def test_limit_refusal_then_release_cached_then_grow():
    dev, mm = make(expandable_segments=False)  # plain segments: the driver-call sequence
    held = [mm.malloc(100 * MiB) for _ in range(9)]
    held.pop().free()
    held.pop().free()                         # 700 MiB in use, 200 MiB cached in 2 segments
    start = len(dev.calls)
    buf = mm.malloc(250 * MiB)                # 900 + 250 > 1000: no driver call before release
    assert ops(dev, start) == [("synchronize", 0, "ok"), ("free", 100, "ok"),
                               ("free", 100, "ok"), ("alloc", 250, "ok")]
    st = mm.stats()
    assert st.reserved_bytes == 950 * MiB and st.cached_bytes == 0
    assert st.segments_released == 2 and st.num_ooms == 0
    assert buf.alive


def test_driver_refusal_then_release_cached_then_grow():
    """The driver's address space is fragmented: a new segment is refused although enough bytes
    are free; giving back a cached segment next to the holes makes room."""
    dev, mm = make(expandable_segments=False)  # plain segments: the driver-call sequence
    held = [mm.malloc(100 * MiB) for _ in range(10)]    # the whole device, in address order
    held[2].free()
    held[4].free()
    assert mm.empty_cache() == 200 * MiB                # two 100 MiB holes at the driver
    held[3].free()                                      # cached by the pool, between the holes
    start = len(dev.calls)
    buf = mm.malloc(150 * MiB)
    assert ops(dev, start) == [("alloc", 150, "oom"), ("synchronize", 0, "ok"),
                               ("free", 100, "ok"), ("alloc", 150, "ok")]
    assert buf.alive and mm.stats().num_ooms == 0


def test_full_segment_not_allowed_falls_back_to_exact_size():
    dev, mm = make(expandable_segments=False)  # plain segments: the driver-call sequence
    held = [mm.malloc(100 * MiB) for _ in range(9)]
    held.append(mm.malloc(95 * MiB))                    # 5 MiB of usable memory left
    start = len(dev.calls)
    buf = mm.malloc(2 * MiB)                            # a miss normally takes a 20 MiB segment
    assert ops(dev, start) == [("alloc", 2, "ok")]
    assert buf.alive


# --- rung 4: OOM callbacks ------------------------------------------------------------------------
def test_callbacks_come_after_cache_release_and_may_free():
    dev, mm = make(expandable_segments=False)  # plain segments: the driver-call sequence
    held = [mm.malloc(100 * MiB) for _ in range(9)]
    held.pop().free()                                   # 800 in use, 100 cached
    timeline: list = []

    def free_two(manager, nbytes):
        assert manager is mm and nbytes == 250 * MiB
        timeline.append(("callback", len(dev.calls)))
        held.pop().free()
        held.pop().free()

    mm.on_oom(free_two)
    start = len(dev.calls)
    buf = mm.malloc(250 * MiB)
    (_, at), = timeline
    before, after = ops(dev, start)[:at - start], ops(dev, at)
    assert before == [("synchronize", 0, "ok"), ("free", 100, "ok")]     # cache released first
    assert after == [("synchronize", 0, "ok"), ("free", 100, "ok"), ("free", 100, "ok"),
                     ("alloc", 250, "ok")]                              # then retried
    assert buf.alive and mm.stats().num_ooms == 0


def test_callback_freeing_a_fitting_block_gives_a_cache_hit():
    dev, mm = make()
    held = [mm.malloc(300 * MiB) for _ in range(3)]
    calls = []
    mm.on_oom(lambda m, n: (calls.append(n), held.pop().free()))
    start, hits = len(dev.calls), mm.stats().pool_hits
    buf = mm.malloc(250 * MiB)
    assert calls == [250 * MiB]
    assert ops(dev, start) == []                       # no release, no new segment
    assert mm.stats().pool_hits == hits + 1
    assert buf.alive


def test_every_callback_runs_once_in_order():
    dev, mm = make()
    held = [mm.malloc(500 * MiB) for _ in range(2)]
    order = []
    mm.on_oom(lambda m, n: order.append("first"))
    mm.on_oom(lambda m, n: order.append("second"))
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)
    assert order == ["first", "second"]
    assert len(held) == 2


def test_on_oom_rejects_non_callable():
    _, mm = make()
    with pytest.raises(Exception, match="callable"):
        mm.on_oom(42)


# --- rung 5: CPU fallback -------------------------------------------------------------------------
def test_cpu_fallback_comes_after_callbacks():
    dev, mm = make(cpu_fallback_enabled=True)
    held = [mm.malloc(500 * MiB) for _ in range(2)]
    seen = []
    mm.on_oom(lambda m, n: seen.append(m.stats().cpu_fallbacks))
    start = len(dev.calls)
    fb = mm.malloc(100 * MiB)
    assert isinstance(fb, FallbackBuffer) and fb.location == "cpu" and fb.nbytes == 100 * MiB
    assert seen == [0]                                 # callbacks ran before the fallback
    assert ops(dev, start) == []                       # the limit refused without the driver
    st = mm.stats()
    assert st.cpu_fallbacks == 1 and st.fallback_bytes == 100 * MiB and st.num_ooms == 0
    fb.free()
    assert mm.stats().fallback_bytes == 0 and len(held) == 2


# --- the end of the ladder: OutOfMemoryError ------------------------------------------------------
def test_oom_error_carries_the_state():
    dev, mm = make(expandable_segments=False)  # plain segments: exact segment sizes
    held = [mm.malloc(100 * MiB) for _ in range(8)]
    part = mm.malloc(2 * MiB)                          # 20 MiB segment, 18 MiB free in it
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(250 * MiB)
    e = info.value
    assert e.requested == 250 * MiB
    assert e.device == "sim:0"
    assert e.free == 1000 * MiB - 820 * MiB and e.total == 1000 * MiB
    assert e.in_use == 802 * MiB and e.cached == 18 * MiB
    assert e.limit == mm.usable_memory == 1000 * MiB
    assert e.largest_free_block == 18 * MiB
    assert "CPU fallback is disabled" in e.reason
    text = str(e)
    for n in (250 * MiB, 180 * MiB, 1000 * MiB, 802 * MiB, 18 * MiB):
        assert format_bytes(n) in text
    assert isinstance(e, MemoryError)
    assert mm.stats().num_ooms == 1
    assert part.alive and len(held) == 8


def test_failed_malloc_leaves_every_counter_but_num_ooms():
    dev, mm = make()
    held = [mm.malloc(100 * MiB) for _ in range(8)]
    part = mm.malloc(2 * MiB)                          # cached bytes that cannot be released
    mm.on_oom(lambda m, n: None)
    before = counters(mm)
    sim_before = (dev.alloc_calls, dev.free_calls, dev.live_bytes, dev.failed_allocs)
    for _ in range(3):
        with pytest.raises(OutOfMemoryError):
            mm.malloc(250 * MiB)
    assert counters(mm) == before
    assert mm.stats().num_ooms == 3
    assert (dev.alloc_calls, dev.free_calls, dev.live_bytes, dev.failed_allocs) == sim_before
    mm.pool.check_invariants()
    assert part.alive and len(held) == 8


def test_injected_driver_oom_counts_and_leaves_state():
    dev, mm = make(expandable_segments=False)      # plain segments: fail_after faults alloc_segment
    keep = mm.malloc(100 * MiB)
    before = counters(mm)
    dev.inject(fail_after=0)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)
    assert dev.alloc_calls == 2 and dev.injected_failures == 1   # one try: no cache to release
    mm.on_oom(lambda m, n: None)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)
    assert dev.injected_failures == 3                  # grow, then grow again after callbacks
    assert counters(mm) == before and mm.stats().num_ooms == 2
    dev.clear_faults()
    assert mm.malloc(100 * MiB).alive and keep.alive


def test_injected_page_oom_counts_and_leaves_state():
    """The same with expandable segments, whose growth creates pages (``inject_vm``) instead of
    segments: a refused page is one try, rolled back, and the manager's counters and the
    device's mappings are as before (level real: the Cython pool on sim)."""
    dev, mm = make(segments="tight")
    keep = mm.malloc(100 * MiB)
    before, mapped = counters(mm), dev.mapped_bytes
    creates = dev.vm_calls["create"]
    dev.inject_vm(create_after=0)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)
    assert dev.vm_calls["create"] == creates + 1       # one try: no cache to release
    mm.on_oom(lambda m, n: None)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)
    assert dev.vm_calls["create"] == creates + 3       # grow, then grow again after callbacks
    assert counters(mm) == before and mm.stats().num_ooms == 2
    assert dev.mapped_bytes == mapped and dev.live_mappings == dev.live_page_handles
    dev.inject_vm(create_after=None)
    assert mm.malloc(100 * MiB).alive and keep.alive


def _fail_next_growth_with_an_error(dev: SimDevice, expandable: bool) -> None:
    """A plain DriverError (not out-of-memory) on the next growth: from alloc_segment for plain
    segments, from vm_map for expandable ones."""
    if expandable:
        dev.inject(fail_kind="error")
        dev.inject_vm(map_after=0)
    else:
        dev.inject(fail_after=0, fail_kind="error")


@pytest.mark.parametrize("expandable, first", [(False, True), (True, True), (True, False)],
                         ids=["plain", "expandable-new-segment", "expandable-grown-segment"])
def test_non_oom_driver_error_is_not_memory_pressure(expandable, first):
    """A driver error that is not an out-of-memory propagates at once: no OOM callback, no CPU
    fallback, no OOM counted, and the manager's counters as before; with expandable segments
    both for a stream's first segment and for the growth of an existing one (level real)."""
    dev, mm = make(cpu_fallback_enabled=True, expandable_segments=expandable)
    if not first:
        mm.malloc(10 * MiB)                            # the stream's segment exists
    mapped = dev.mapped_bytes
    _fail_next_growth_with_an_error(dev, expandable)
    called = []
    mm.on_oom(lambda m, n: called.append(n))
    before = counters(mm)
    with pytest.raises(DriverError) as info:
        mm.malloc(100 * MiB)
    assert not isinstance(info.value, MemoryError)
    assert called == []
    assert counters(mm) == before and mm.stats().num_ooms == 0
    assert mm.stats().cpu_fallbacks == 0
    assert dev.mapped_bytes == mapped and dev.live_mappings == dev.live_page_handles


def test_fail_rate_is_survived_by_the_ladder_with_fallback():
    # plain segments: fail_rate faults alloc_segment
    dev, mm = make(cpu_fallback_enabled=True, device=SimDevice(1000 * MiB, seed=11), expandable_segments=False)
    dev.inject(fail_rate=0.5)
    bufs = [mm.malloc(30 * MiB) for _ in range(20)]
    on_cpu = sum(isinstance(b, FallbackBuffer) for b in bufs)
    st = mm.stats()
    assert st.cpu_fallbacks == on_cpu > 0
    assert st.active_buffers == 20
    assert dev.injected_failures > 0
    mm.pool.check_invariants()
    for b in bufs:
        b.free()
    assert mm.stats().active_buffers == 0 and mm.stats().fallback_bytes == 0


# --- limits are checked before the driver is asked ------------------------------------------------
def test_min_free_bytes_enforced_without_driver_call():
    # plain segments: counts alloc_segment calls
    dev, mm = make(min_free_bytes=300 * MiB, expandable_segments=False)
    start = len(dev.calls)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(800 * MiB)                           # would leave 200 MiB free
    assert dev.alloc_calls == 0 and ops(dev, start) == []
    buf = mm.malloc(700 * MiB)                         # leaves exactly 300 MiB
    assert dev.alloc_calls == 1 and buf.alive
    with pytest.raises(OutOfMemoryError):
        mm.malloc(10 * MiB)
    assert dev.alloc_calls == 1


def test_min_free_bytes_counts_other_processes():
    dev, mm = make(min_free_bytes=100 * MiB, device=SimDevice(1000 * MiB,
                                                              other_process_bytes=400 * MiB),
                   expandable_segments=False)          # plain segments: counts alloc_segment calls
    with pytest.raises(OutOfMemoryError):
        mm.malloc(550 * MiB)                           # 600 free - 550 < 100
    assert dev.alloc_calls == 0
    assert mm.malloc(500 * MiB).alive
    assert dev.alloc_calls == 1


def test_gpu_memory_fraction_enforced_without_driver_call():
    # plain segments: counts alloc_segment calls
    dev, mm = make(gpu_memory_fraction=0.5, expandable_segments=False)
    assert mm.usable_memory == 500 * MiB
    held = [mm.malloc(100 * MiB) for _ in range(5)]
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(100 * MiB)
    assert dev.alloc_calls == 5
    assert info.value.limit == 500 * MiB
    with pytest.raises(OutOfMemoryError, match="usable memory"):
        mm.malloc(600 * MiB)
    assert dev.alloc_calls == 5 and len(held) == 5


def test_request_beyond_total_memory_fails_fast_even_with_fallback():
    dev, mm = make(cpu_fallback_enabled=True)
    called = []
    mm.on_oom(lambda m, n: called.append(n))
    with pytest.raises(OutOfMemoryError, match="total memory"):
        mm.malloc(2000 * MiB)
    assert dev.alloc_calls == 0 and called == [] and mm.stats().cpu_fallbacks == 0
    with pytest.raises(OutOfMemoryError):
        mm.malloc(1 << 70)                             # too large for C: still a clean OOM


def test_request_beyond_usable_memory_keeps_the_cache():
    dev, mm = make(gpu_memory_fraction=0.5)
    mm.malloc(100 * MiB).free()                        # 100 MiB cached
    called = []
    mm.on_oom(lambda m, n: called.append(n))
    before = counters(mm)
    with pytest.raises(OutOfMemoryError, match="usable memory"):
        mm.malloc(600 * MiB)
    assert called == []
    assert counters(mm) == before
