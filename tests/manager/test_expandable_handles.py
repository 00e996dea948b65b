"""Physical handles of several pages in expandable segments
(``MemoryConfig(expandable_handle_size=n)``; gpumem/manager/expandable.py, the pool's whole-mapping
carving in gpumem/_core/pool_pages.pyx).

The driver maps, unmaps and releases a physical handle whole, so memory made of larger handles
costs fewer driver calls, and a handle can move to another address or go back to the device
only when no live block touches it. Tests using the ``vm`` fixture (tests/vm_managers.py) run
at level **real** (sim, back_memory=True) and **fake driver** (tests/fake_cuda, in ci/test.sh's
cuda passes); each ends with the invariant checker and with no handle, mapping or reservation
left after close().
"""
from __future__ import annotations

import pytest

from gpumem import MemoryConfig
from gpumem.errors import InvalidInputError
from gpumem.units import MiB
from invariants import check, sim_manager, snapshot_state
from vm_managers import PAGE, fill, intact, layout, random_walk, refusing_nth, vm  # noqa: F401

pytestmark = pytest.mark.usefixtures("clean_registry")


@pytest.mark.handle_size(8 * MiB)
def test_new_memory_comes_in_handles_of_the_configured_size(vm):
    """A 20 MiB growth with 8 MiB handles is three handles (8, 8 and 4 MiB) mapped by one
    vm_map_many: 1 reserve + 3 creates + 3 maps + 1 access grant, where one page per handle
    makes 10 creates and 10 maps."""
    mm = vm.mm
    calls = mm._expandable.driver_calls
    a = mm.malloc(20 * MiB)
    [seg] = mm._expandable.layout()
    assert mm._expandable.mappings(seg) == [(0, 8 * MiB), (8 * MiB, 8 * MiB), (16 * MiB, 4 * MiB)]
    assert mm._expandable.driver_calls - calls == 8
    assert vm.physical == 20 * MiB == mm.pool.reserved_bytes
    data = fill(a, 1)
    intact([(a, data)])
    check(mm, [a])


@pytest.mark.handle_size(8 * MiB)
def test_only_wholly_free_handles_go_back_to_the_device(vm):
    """After a 24 MiB block (three 8 MiB handles) is freed and a 4 MiB request takes the start
    of its free block, empty_cache returns the two handles the live block does not touch
    (16 MiB) and keeps the first one mapped: its free half stays cached. Physical memory,
    the pool's reserved bytes and the blocks agree; the live bytes survive."""
    mm = vm.mm
    a = mm.malloc(24 * MiB)
    guard = mm.malloc(8 * MiB)
    kept = [(guard, fill(guard, 2))]
    start = a.ptr
    a.free()
    b = mm.malloc(4 * MiB)
    assert b.ptr == start
    kept.append((b, fill(b, 3)))
    assert mm.empty_cache() == 16 * MiB
    assert vm.physical == 16 * MiB == mm.pool.reserved_bytes
    assert layout(mm) == [(0, 4 * MiB, "allocated"), (4 * MiB, 4 * MiB, "free"),
                          (8 * MiB, 16 * MiB, "unmapped"), (24 * MiB, 8 * MiB, "allocated")]
    intact(kept)
    check(mm, [b, guard])
    b.free()                                     # now the first handle is wholly free too
    assert mm.empty_cache() == 8 * MiB and vm.physical == 8 * MiB
    intact(kept[:1])
    check(mm, [guard])


@pytest.mark.handle_size(8 * MiB)
def test_a_budgeted_trim_returns_whole_handles_from_the_top(vm):
    """shrink() asked to free 4 MiB of a freed 24 MiB block (three 8 MiB handles) returns one
    whole handle, the highest (8 MiB: a handle cannot go back in part), and the two below stay
    cached as one free block."""
    mm = vm.mm
    a = mm.malloc(24 * MiB)
    guard = mm.malloc(8 * MiB)
    kept = [(guard, fill(guard, 4))]
    a.free()
    assert mm.shrink(20 * MiB) == 8 * MiB
    assert vm.physical == 24 * MiB == mm.pool.reserved_bytes
    assert layout(mm) == [(0, 16 * MiB, "free"), (16 * MiB, 8 * MiB, "unmapped"),
                          (24 * MiB, 8 * MiB, "allocated")]
    intact(kept)
    check(mm, [guard])


def _two_free_runs(mm):
    """16 MiB free (two handles) at 0, a live 4 MiB, 16 MiB free at 20 MiB, a live 4 MiB."""
    a, s1, b, s2 = (mm.malloc(n * MiB) for n in (16, 4, 16, 4))
    kept = [(s1, fill(s1, 1)), (s2, fill(s2, 2))]
    a.free()
    b.free()
    return kept


@pytest.mark.handle_size(8 * MiB)
def test_a_stitch_moves_whole_free_handles(vm):
    """A 30 MiB request fits neither 16 MiB free run: the pool moves the four free 8 MiB
    handles (32 MiB, the surplus stays a free tail) to the segment's end instead of creating
    memory: physical memory does not grow, the driver sees 4 unmaps, 4 maps and one access
    grant (one page per handle: 15 of each), and every byte survives."""
    mm = vm.mm
    kept = _two_free_runs(mm)
    before, calls = vm.physical, mm._expandable.driver_calls
    d = mm.malloc(30 * MiB)
    assert vm.physical == before == mm.pool.reserved_bytes
    assert mm._expandable.stitched_bytes == 32 * MiB
    assert mm._expandable.driver_calls - calls == 9
    kept.append((d, fill(d, 9)))
    intact(kept)
    check(mm, [s for s, _ in kept])


def test_a_moved_handle_never_passes_the_reservations_end():
    """Level real (sim). A 64 MiB reservation of 8 MiB handles: a free 8 MiB handle at its
    start, a free 10 MiB tail at 48 MiB and 6 MiB of room after it. A 14 MiB miss at the end
    needs 4 MiB more; the free handle would overshoot the reservation by 2 MiB, so it stays
    where it is and a 4 MiB handle is made (the old code returned the move before checking the
    room, and the driver refused a mapping past the reservation: gpumem tune on a small card
    crashed on bert_varlen_infer with 20 MiB handles)."""
    # the pressure responses off: at 62 of 64 MiB they would return the free handle
    _, mm = sim_manager("64MiB", segments="tight", expandable_handle_size=8 * MiB,
                        gpu_memory_fraction=1.0, auto_release_at_high=False,
                        auto_cleanup_at_critical=False)
    try:
        x, live, t = mm.malloc(8 * MiB), mm.malloc(40 * MiB), mm.malloc(10 * MiB)
        [seg] = mm._expandable.layout()
        assert mm._expandable._segments[seg].reserved == 64 * MiB
        t.free()
        x.free()
        got = mm.malloc(14 * MiB)
        assert got.ptr == live.ptr + 40 * MiB
        assert mm._expandable.mappings(seg)[0] == (0, 8 * MiB)        # not moved
        assert mm._expandable.mappings(seg)[-1] == (58 * MiB, 4 * MiB)
        assert mm._expandable.stitched_bytes == 0
        check(mm, [live, got])
        live.free()
        got.free()
    finally:
        mm.close()


def test_a_fill_that_leaves_an_unmapped_tail_never_misplaces_a_later_growth():
    """Level real (sim). The synthetic varlen trace (seed 1) on a card just large enough
    (2,984,411,136 B: a stream's reservation gets used up, so it has two, and one of them
    is emptied into holes) with 20 MiB handles: a fill into a segment's only hole left an
    unmapped tail; a later growth at that segment's end was planned past the tail, a carve
    in between cut the tail off, and the growth was mapped where the pool did not put it
    (the pool and the device out of step, then a mapping refused for overlapping one:
    gpumem tune's smallest-card search crashed). Now a fill cuts such a tail, as a carve
    does, and the invariant checker asserts no segment ends in a hole. Every
    invariant every 500 events and at the end; OOMs are expected on such a card."""
    from gpumem.observe.synth_traces import synthesize
    from gpumem.observe.trace import OP_ALLOC
    from gpumem.errors import OutOfMemoryError
    data = synthesize("varlen", seed=1)
    _, mm = sim_manager(2_984_411_136, segments="tight", expandable_handle_size=20 * MiB,
                        base={}, cpu_fallback_enabled=False, min_free_bytes=0)
    live = {}
    try:
        for k, (op, i, n) in enumerate(zip(data.ops.tolist(), data.ids.tolist(),
                                           data.sizes.tolist())):
            if op == OP_ALLOC:
                try:
                    live[i] = mm.malloc(n)
                except OutOfMemoryError:
                    pass
            elif i in live:
                live.pop(i).free()
            if k % 500 == 0:
                check(mm, list(live.values()))
        check(mm, list(live.values()))
        for buf in live.values():
            buf.free()
    finally:
        mm.close()


@pytest.mark.handle_size(8 * MiB)
@pytest.mark.parametrize("fault", ["map", "unmap", "create"])
def test_a_refusal_while_moving_handles_rolls_back_completely(vm, fault, monkeypatch):
    """A 40 MiB miss moves the four free handles and creates 8 MiB more; the 2nd unmap, the
    creation or the mapping (all of the range, one call) is refused: every handle goes back
    where it was, and the pool's blocks and counters, the device's physical memory and its
    live handles and mappings are as before; the same miss works afterwards."""
    mm = vm.mm
    kept = _two_free_runs(mm)
    state, physical, live = snapshot_state(mm), vm.physical, vm.leaks()
    dev = mm._expandable._dev
    name, nth = {"map": ("vm_map_many", 1), "unmap": ("vm_unmap", 2),
                 "create": ("vm_create", 1)}[fault]
    refuse, calls = refusing_nth(dev, name, nth)
    monkeypatch.setattr(dev, name, refuse)
    with mm._slow:
        assert mm._expandable.grow(40 * MiB, 0, None) is None
    monkeypatch.undo()
    assert len(calls) == nth
    assert snapshot_state(mm) == state and vm.physical == physical and vm.leaks() == live
    check(mm, [s for s, _ in kept])
    intact(kept)
    g = mm.malloc(40 * MiB)
    intact(kept)
    check(mm, [s for s, _ in kept] + [g])


@pytest.mark.handle_size(6 * MiB)
def test_random_work_with_three_page_handles_keeps_every_invariant(vm):
    """vm_managers.random_walk with 6 MiB handles: handles straddle blocks of every size, so
    moves and trims must take whole handles only; every invariant and byte after each step."""
    random_walk(vm.mm)


@pytest.mark.handle_size("growth")
def test_each_growth_is_one_handle_rounded_to_a_plain_large_segment(vm):
    """With one handle per growth (the fast policy, and auto while there is room), a 30 MiB
    miss is one handle of 40 MiB, the next multiple of a plain large segment (20 MiB; reserve,
    create, map, access: 4 driver calls, where one page per handle makes 15 creates and 15
    maps); six 3 MiB requests fit in its 10 MiB surplus and one 20 MiB growth (3 calls: create,
    map, access), which plain segments would give an 18 MiB segment; the rest of it serves
    the next ones with no driver call. Bytes survive; the invariants hold."""
    mm = vm.mm
    calls = mm._expandable.driver_calls
    big = mm.malloc(30 * MiB)
    [seg] = mm._expandable.layout()
    assert mm._expandable.mappings(seg) == [(0, 40 * MiB)]
    assert mm._expandable.driver_calls - calls == 4
    kept = [(big, fill(big, 1))]
    calls = mm._expandable.driver_calls
    kept += [(b, fill(b, 2 + i)) for i, b in enumerate(mm.malloc(3 * MiB) for _ in range(3))]
    assert mm._expandable.driver_calls == calls            # the surplus: cache hits
    kept += [(b, fill(b, 5 + i)) for i, b in enumerate(mm.malloc(3 * MiB) for _ in range(3))]
    assert mm._expandable.driver_calls - calls == 3
    assert mm._expandable.mappings(seg) == [(0, 40 * MiB), (40 * MiB, 20 * MiB)]
    assert vm.physical == 60 * MiB == mm.pool.reserved_bytes
    more = [mm.malloc(3 * MiB) for _ in range(4)]            # 9 + 12 MiB of the 20: hits
    assert mm._expandable.driver_calls - calls == 3
    kept += [(b, fill(b, 9 + i)) for i, b in enumerate(more)]
    intact(kept)
    check(mm, [b for b, _ in kept])


@pytest.mark.handle_size("growth")
def test_a_streams_first_growth_is_one_plain_segments_worth(vm):
    """The first 3 MiB request of a stream reserves its range and maps one 20 MiB handle (a
    plain large segment; reserve, create, map, access: 4 calls); five more 3 MiB requests are
    cache hits."""
    mm = vm.mm
    calls = mm._expandable.driver_calls
    bufs = [mm.malloc(3 * MiB) for _ in range(6)]
    [seg] = mm._expandable.layout()
    assert mm._expandable.mappings(seg) == [(0, 20 * MiB)]
    assert mm._expandable.driver_calls - calls == 4
    assert vm.physical == 20 * MiB
    kept = [(b, fill(b, i)) for i, b in enumerate(bufs)]
    intact(kept)
    check(mm, bufs)


@pytest.mark.handle_size("growth")
@pytest.mark.parametrize("fault", ["map", "create"])
def test_a_refused_growth_handle_rolls_back_completely(vm, fault, monkeypatch):
    """A 3 MiB miss that would make one 20 MiB handle is refused at the creation or the
    mapping: the pool, its counters, the device's physical memory and its live handles and
    mappings are as before; the same request works afterwards."""
    mm = vm.mm
    big = mm.malloc(40 * MiB)                  # two whole quanta: no free tail
    kept = [(big, fill(big, 1))]
    state, physical, live = snapshot_state(mm), vm.physical, vm.leaks()
    dev = mm._expandable._dev
    name = {"map": "vm_map_many", "create": "vm_create"}[fault]
    refuse, calls = refusing_nth(dev, name, 1)
    monkeypatch.setattr(dev, name, refuse)
    with mm._slow:
        assert mm._expandable.grow(3 * MiB, 0, None) is None
    monkeypatch.undo()
    assert len(calls) == 1
    assert snapshot_state(mm) == state and vm.physical == physical and vm.leaks() == live
    small = mm.malloc(3 * MiB)
    intact(kept)
    check(mm, [big, small])


def test_a_growth_handle_shrinks_to_the_need_where_the_limit_is_near():
    """Level real (sim). With 6 MiB of the device left and 2 MiB to be kept free
    (min_free_bytes), a 3 MiB miss can have neither the 20 MiB handle of a quantum nor the 6
    MiB left in the reservation: it gets the 4 MiB it needs (two pages), not an OOM."""
    _, mm = sim_manager("66MiB", segments="fast",
                        gpu_memory_fraction=1.0, min_free_bytes=2 * MiB)
    try:
        big = mm.malloc(60 * MiB)
        small = mm.malloc(3 * MiB)
        [seg] = mm._expandable.layout()
        assert mm._expandable.mappings(seg) == [(0, 60 * MiB), (60 * MiB, 4 * MiB)]
        check(mm, [big, small])
        big.free()
        small.free()
    finally:
        mm.close()


@pytest.mark.handle_size("growth")
def test_random_work_with_one_handle_per_growth_keeps_every_invariant(vm):
    """vm_managers.random_walk with one handle per growth (the fast policy): handles of every
    size, returned only whole (holes) and never moved (the fast policy makes a new handle
    rather than move one: on the measured H200 a move costs the driver more); every
    invariant and byte after each step."""
    random_walk(vm.mm, seed=9, stitches=False)


def test_the_handle_size_is_checked_and_read_from_the_environment():
    """Level real. A bad size (or a string other than 'growth') names the field;
    GPUMEM_EXPANDABLE_HANDLE_SIZE sets it (a size, or 'growth' in any case); a size that is not
    whole pages is rounded down to whole pages (at least one)."""
    for bad in (-1, "grow", 1.5, True):          # "8MiB" is a size (issue 35)
        with pytest.raises(InvalidInputError, match="expandable_handle_size"):
            MemoryConfig(expandable_handle_size=bad)
    cfg = MemoryConfig.from_env({"GPUMEM_EXPANDABLE_HANDLE_SIZE": "20MiB"})
    assert cfg.expandable_handle_size == 20 * MiB
    cfg = MemoryConfig.from_env({"GPUMEM_EXPANDABLE_HANDLE_SIZE": "Growth"})
    assert cfg.expandable_handle_size == "growth"
    with pytest.raises(InvalidInputError, match="GPUMEM_EXPANDABLE_HANDLE_SIZE.*'growth'"):
        MemoryConfig.from_env({"GPUMEM_EXPANDABLE_HANDLE_SIZE": "grow"})
    for asked, made in ((0, PAGE), (PAGE - 1, PAGE), (5 * MiB, 4 * MiB), (20 * MiB, 20 * MiB)):
        _, mm = sim_manager("256MiB", segments="tight", expandable_handle_size=asked)
        try:
            assert mm._expandable.sizing.handle_size == made
        finally:
            mm.close()


def test_mapping_bounds_must_ascend():
    """Level real. The pool's carve takes the mapping boundaries as an ascending list; any
    other order is refused before the pool's lock is taken, and nothing changes."""
    _, mm = sim_manager("256MiB", segments="tight")
    try:
        a = mm.malloc(8 * MiB)
        [seg] = mm._expandable.layout()
        state = snapshot_state(mm)
        with pytest.raises(ValueError, match="ascend"):
            mm.pool.carve_free_pages(seg, PAGE, bounds=[4 * MiB, 2 * MiB])
        assert snapshot_state(mm) == state
        a.free()
    finally:
        mm.close()
