"""Holes and stitching in expandable segments (gpumem/manager/expandable.py, the pool's unmapped block
state in gpumem/_core/pool_pages.pyx), with one page per physical handle (the default).

Tests using the ``vm`` fixture (tests/vm_managers.py) run twice: level **real** on the
simulated device and level **fake driver** (tests/fake_cuda). Each ends with the invariant
checker (physical bytes = mapped bytes, every page of a non-hole block mapped) and with no
page handle, mapping or reservation left after close()."""
from __future__ import annotations

from typing import Any

import pytest

from gpumem import OutOfMemoryError
from gpumem.errors import DriverError, DriverOutOfMemory
from gpumem.units import MiB
from invariants import check, sim_manager, snapshot_state
from vm_managers import PAGE, random_walk, refusing_nth, vm  # noqa: F401
from vm_managers import fill as _fill, intact as _intact, layout as _layout

pytestmark = pytest.mark.usefixtures("clean_registry")


def test_empty_cache_releases_inner_pages_while_blocks_live_on_both_sides(vm):
    """A free block between two live ones gives its whole pages back to the device (plain
    tail trimming could not: a block lives after it) and the hole is mapped again when a
    request needs it; the live blocks' bytes are untouched throughout."""
    mm = vm.mm
    a, b, c = mm.malloc(10 * MiB), mm.malloc(20 * MiB), mm.malloc(10 * MiB)
    kept = [(a, _fill(a, 1)), (c, _fill(c, 2))]
    before = vm.physical
    b.free()
    assert mm.empty_cache() == 20 * MiB
    assert vm.physical == before - 20 * MiB == mm.pool.reserved_bytes
    assert _layout(mm) == [(0, 10 * MiB, "allocated"), (10 * MiB, 20 * MiB, "unmapped"),
                           (30 * MiB, 10 * MiB, "allocated")]
    check(mm, [a, c])
    _intact(kept)
    d = mm.malloc(20 * MiB)                      # the hole fits it exactly: mapped again
    assert d.ptr == a.ptr + 10 * MiB and vm.physical == before
    _fill(d, 3)
    _intact(kept)
    check(mm, [a, c, d])


def test_stitch_serves_a_request_from_free_pages_without_new_physical_memory(vm):
    """Two 20 MiB free blocks between live ones; a 36 MiB request fits neither. Instead of
    mapping 36 MiB of new memory at the segment's end, the pool moves 18 free pages there:
    the device's physical memory does not grow, the bytes of every live block survive, and
    the moved pages hold the new buffer's bytes."""
    mm = vm.mm
    a, b, c, e, f = (mm.malloc(n * MiB) for n in (10, 20, 10, 20, 10))
    kept = [(x, _fill(x, i)) for i, x in enumerate((a, c, f))]
    b.free()
    e.free()
    before = vm.physical
    syncs = mm._expandable.stitch_syncs
    d = mm.malloc(36 * MiB)
    assert vm.physical == before == mm.pool.reserved_bytes
    assert mm._expandable.stitched_bytes == 36 * MiB
    assert mm._expandable.stitch_syncs == syncs              # the stream is idle: no sync
    assert d.ptr == a.ptr + 70 * MiB                         # at the end, over moved pages
    data = _fill(d, 9)
    _intact(kept + [(d, data)])
    states = [s for _, _, s in _layout(mm)]
    assert states.count("unmapped") == 2                      # b's pages all, e's partly
    check(mm, [a, c, f, d])


def test_a_hole_between_free_neighbours_is_filled_before_the_segment_grows(vm):
    """After empty_cache a request larger than a hole's free neighbours fills the hole (the
    address range does not grow) and is carved across hole and neighbours."""
    mm = vm.mm
    a, b, c = mm.malloc(10 * MiB), mm.malloc(20 * MiB), mm.malloc(10 * MiB)
    b.free()
    mm.empty_cache()
    span = mm._expandable.extents()
    d = mm.malloc(19 * MiB)
    assert d.ptr == a.ptr + 10 * MiB and mm._expandable.extents() == span
    check(mm, [a, c, d])


@pytest.mark.parametrize("fault", ["map", "unmap", "create"])
def test_a_fault_midway_through_a_stitch_rolls_back_completely(vm, fault, monkeypatch):
    """The 5th page mapping, the 3rd unmapping or the 1st page creation of a stitching miss is
    refused (an out-of-memory refusal, so the miss reports "no memory"): every page goes
    back where it was, the pool's blocks and counters, the device's physical memory and its
    live handles and mappings are exactly as before, and the live blocks keep their bytes.
    A miss maps all its pages with one vm_map_many; a refusal at its 5th page leaves none of
    them mapped (the 4 before are unmapped again, as the backends do)."""
    mm = vm.mm
    a, b, c, e, f = (mm.malloc(n * MiB) for n in (10, 20, 10, 20, 10))
    kept = [(x, _fill(x, i)) for i, x in enumerate((a, c, f))]
    b.free()
    e.free()
    state, physical, live = snapshot_state(mm), vm.physical, vm.leaks()
    dev = mm._expandable._dev
    name, nth = {"map": ("vm_map_many", 5), "unmap": ("vm_unmap", 3),
                 "create": ("vm_create", 1)}[fault]
    real = getattr(dev, name)
    refuse_nth, calls = refusing_nth(dev, name, nth)

    def refuse_nth_page(address, handles):
        calls.append(address)
        handles = list(handles)
        before = handles[:nth - 1]
        real(address, before)                   # the first pages map, then the 5th fails
        at = address
        for _, n in before:
            dev.vm_unmap(at, n)
            at += n
        raise DriverOutOfMemory(f"{name} refused at page {nth} (test)")

    monkeypatch.setattr(dev, name, refuse_nth_page if fault == "map" else refuse_nth)
    # 44 MiB: more than the 40 MiB of free pages, so the miss also creates pages
    with mm._slow:
        assert mm._expandable.grow(44 * MiB, 0, None) is None
    monkeypatch.undo()
    assert len(calls) >= (1 if fault == "map" else nth)
    assert snapshot_state(mm) == state and vm.physical == physical and vm.leaks() == live
    check(mm, [a, c, f])
    _intact(kept)
    g = mm.malloc(44 * MiB)                      # and the same miss works afterwards
    _intact(kept)
    check(mm, [a, c, f, g])


def test_a_driver_error_that_is_not_oom_propagates_after_the_rollback(vm, monkeypatch):
    mm = vm.mm
    a, b, c = mm.malloc(10 * MiB), mm.malloc(20 * MiB), mm.malloc(10 * MiB)
    kept = [(a, _fill(a, 1)), (c, _fill(c, 2))]
    b.free()
    state, physical, live = snapshot_state(mm), vm.physical, vm.leaks()
    dev = mm._expandable._dev
    real = dev.vm_map_many
    calls = []

    def broken(*args):
        calls.append(args)
        if len(calls) == 1:                     # the miss maps its pages with one call
            raise DriverError("vm_map_many: CUDA_ERROR_INVALID_VALUE (test)")
        return real(*args)

    monkeypatch.setattr(dev, "vm_map_many", broken)
    with pytest.raises(DriverError, match="test"):
        mm.malloc(30 * MiB)
    monkeypatch.undo()
    assert snapshot_state(mm) == state and vm.physical == physical and vm.leaks() == live
    _intact(kept)
    check(mm, [a, c])


def test_out_of_memory_after_stitching_keeps_everything_consistent(vm):
    """When even the moved pages and the device's free memory cannot hold a request, the
    miss ends in OutOfMemoryError through the whole ladder (trim included) with the pool
    consistent and nothing leaked."""
    mm = vm.mm
    free, _ = mm.device.mem_get_info()
    a, b, c = mm.malloc(10 * MiB), mm.malloc(20 * MiB), mm.malloc(10 * MiB)
    kept = [(a, _fill(a, 1)), (c, _fill(c, 2))]
    b.free()
    with pytest.raises(OutOfMemoryError):
        mm.malloc(free)
    _intact(kept)
    check(mm, [a, c])


def test_a_stream_whose_reservation_is_used_up_gets_another():
    """Level **real** (sim): the reservation is as large as usable memory, so to reach its end
    the test shrinks it. A stream whose reservation has no room and no hole that fits gets a
    second reservation instead of failing; both are released on empty_cache once free."""
    dev, mm = sim_manager("1GiB", back_memory=True, segments="tight")
    mm.usable_memory = 64 * MiB                  # reservations of 64 MiB
    a = mm.malloc(40 * MiB)
    b = mm.malloc(20 * MiB)
    mm.usable_memory = 1024 * MiB                # the device may hold more: only the
    c = mm.malloc(30 * MiB)                      # reservation is full
    assert dev.live_reservations == 2 and len(mm.pool.segments()) == 2
    check(mm, [a, b, c])
    for x in (a, b, c):
        x.free()
    mm.empty_cache()
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)
    check(mm, [])
    mm.close()


def test_snapshot_text_plot_and_torch_export_show_holes(tmp_path):
    """Level **real** (sim): a hole left by empty_cache is an "unmapped" block in the
    snapshot; the totals count physical bytes only (reserved = mapped), a saved snapshot
    loads back, the text view names the hole, the segment map draws it and the torch export
    lists no block for it."""
    from gpumem.observe.snapshot import format_snapshot, load_snapshot, save_snapshot, summarize, \
        take_snapshot
    from gpumem.observe.torch_snapshot import to_memory_viz
    dev, mm = sim_manager("1GiB", segments="tight")
    a, b, c = mm.malloc(10 * MiB), mm.malloc(20 * MiB), mm.malloc(10 * MiB)
    b.free()
    mm.empty_cache()
    snap = take_snapshot(mm)
    [large] = snap["segments"]
    assert [x["state"] for x in large["blocks"]] == ["allocated", "unmapped", "allocated"]
    assert large["size"] == 40 * MiB and large["mapped_bytes"] == 20 * MiB == dev.mapped_bytes
    assert large["unmapped_bytes"] == 1024 * MiB - 20 * MiB
    totals = summarize(snap)
    assert totals["reserved_bytes"] == 20 * MiB and totals["hole_bytes"] == 20 * MiB
    assert totals["cached_bytes"] == 0
    assert "<20.00 MiB unmapped>" in format_snapshot(snap)
    save_snapshot(snap, tmp_path / "snap.json")
    assert load_snapshot(tmp_path / "snap.json")["segments"][0]["blocks"][1]["state"] == \
        "unmapped"
    torch_snap = to_memory_viz(snap)
    assert [blk["size"] for blk in torch_snap["segments"][0]["blocks"]] == [10 * MiB, 10 * MiB]
    pytest.importorskip("matplotlib", reason="plots need matplotlib (extra 'plot')")
    from gpumem.observe.plot import plot_segments
    plot_segments(snap, tmp_path / "segments.png")
    assert (tmp_path / "segments.png").stat().st_size > 0
    for x in (a, c):
        x.free()
    mm.close()


def test_random_work_keeps_every_invariant_and_every_byte(vm):
    """vm_managers.random_walk with one page per handle: every invariant and every live
    buffer's bytes after each of 300 steps in which holes and stitching both occur."""
    random_walk(vm.mm)


@pytest.mark.parametrize("release_before_grow", [True, False])
def test_release_before_grow_crosses_the_two_pools(release_before_grow):
    """release_before_grow with expandable segments (level real, sim): growth past the
    high-water mark first gives back what the other pool holds idle, since neither pool can
    use the other's memory. Expandable growth returns idle small-pool segments (40 MiB
    physical, not 48); a new small-pool segment first returns free pages of a partly used
    expandable segment (40 MiB, not 42). With the option off nothing is returned."""
    def physical(dev) -> int:
        free, total = dev.mem_get_info()
        return total - free

    dev, mm = sim_manager("1GiB", segments="tight",
                          release_before_grow=release_before_grow)
    big = mm.malloc(20 * MiB)
    for x in [mm.malloc(MiB) for _ in range(8)]:              # 4 small segments, then idle
        x.free()
    assert physical(dev) == 28 * MiB
    more = mm.malloc(20 * MiB)                                # past the mark (28 MiB)
    assert physical(dev) == (40 if release_before_grow else 48) * MiB
    check(mm, [big, more])
    mm.close()

    dev, mm = sim_manager("1GiB", segments="tight",
                          release_before_grow=release_before_grow)
    keep = mm.malloc(20 * MiB)
    mm.malloc(20 * MiB).free()                                # a 20 MiB free tail: pages
    small = mm.malloc(4096)                                   # a new small segment, past 40
    assert physical(dev) == (40 if release_before_grow else 42) * MiB
    check(mm, [keep, small])
    mm.close()


def test_pages_carved_off_the_end_come_back_in_any_order():
    """A stitching miss that is rolled back (a refused map, or the limits) gives carved pages
    back one by one, not always lowest first; pages carved off a segment's end had shortened
    its span. The pool takes a page past the span with the gap left unmapped, so every order
    restores the segment exactly (level real, sim). Found by the stress test with expandable
    segments and page faults: before, the pool refused a page past the span and the miss
    failed with MemoryError("the pool could not record mapped pages")."""
    dev, mm = sim_manager("1GiB", segments="tight")
    live = mm.malloc(4 * MiB)                              # [0, 4 MiB)
    mm.malloc(8 * MiB).free()                              # a free tail [4, 12 MiB)
    handle = live.segment_location()[0]
    before = snapshot_state(mm)
    carved = mm.pool.carve_free_pages(handle, PAGE, stream=0)
    assert carved == [(4 * MiB, 8 * MiB)]
    assert [s["size"] for s in mm.pool.segments()] == [4 * MiB]     # the span was cut
    for off in (10, 6, 4, 8):                              # last page first, then a middle one
        assert mm.pool.fill_unmapped(handle, off * MiB, PAGE, 0)
        mm.pool.check_invariants()
    assert snapshot_state(mm) == before
    check(mm, [live])
    mm.close()


def test_a_budgeted_trim_takes_the_highest_pages_first(vm):
    """shrink() asked for 4 MiB, with a 20 MiB free block low in the segment and a 10 MiB
    free tail: the pages go from the top, so the span shrinks back (a later growth maps at
    the end again) and the low free block stays whole for the next 20 MiB request, a cache
    hit (walking up, the trim cut a hole in it instead). The live bytes are untouched."""
    mm = vm.mm
    a, b, c, e, f = (mm.malloc(n * MiB) for n in (10, 20, 10, 20, 10))
    kept = [(x, _fill(x, i)) for i, x in enumerate((a, c, e))]
    b.free()
    f.free()
    before = vm.physical
    assert mm.shrink(26 * MiB) == 4 * MiB
    assert vm.physical == before - 4 * MiB == mm.pool.reserved_bytes
    assert _layout(mm) == [(0, 10 * MiB, "allocated"), (10 * MiB, 20 * MiB, "free"),
                           (30 * MiB, 10 * MiB, "allocated"), (40 * MiB, 20 * MiB, "allocated"),
                           (60 * MiB, 6 * MiB, "free")]
    check(mm, [a, c, e])
    misses = mm.stats().pool_misses
    g = mm.malloc(20 * MiB)
    assert g.ptr == a.ptr + 10 * MiB and vm.physical == before - 4 * MiB
    assert mm.stats().pool_misses == misses                  # a hit: no driver call
    _intact(kept)
    check(mm, [a, c, e, g])


@pytest.mark.parametrize("edge, gives", [(2.25, True), (2.125, False)])
def test_a_free_block_gives_pages_only_when_they_outweigh_what_they_strand(vm, edge, gives):
    """The STITCH_RATIO rule (create / (create - 2 move) of the driver cost table, 2.21): a free
    block with both ends off the page grid gives its 4 whole pages (8 MiB) to a 16 MiB miss
    when they are at least STITCH_RATIO times the bytes left stranded around them (1.75 +
    1.75 MiB: 2.29, yes; 1.875 + 1.875 MiB: 2.13, no, and the miss maps new pages instead).
    Physical memory grows by exactly what was not moved; bytes survive."""
    from gpumem.manager.expandable import STITCH_RATIO
    assert (8 / (2 * (4 - edge)) >= STITCH_RATIO) == gives       # the two sides of the rule
    mm = vm.mm
    side = int(edge * MiB)
    a, b, c = mm.malloc(side), mm.malloc(16 * MiB - 2 * side), mm.malloc(side)
    assert c.ptr - a.ptr == 16 * MiB - side
    kept = [(a, _fill(a, 1)), (c, _fill(c, 2))]
    b.free()
    before, moved = vm.physical, mm._expandable.stitched_bytes
    d = mm.malloc(16 * MiB)
    assert d.ptr == a.ptr + 16 * MiB                          # at the segment's end
    taken = 8 * MiB if gives else 0
    assert mm._expandable.stitched_bytes - moved == taken
    assert vm.physical == before + 16 * MiB - taken == mm.pool.reserved_bytes
    data = _fill(d, 3)
    _intact(kept + [(d, data)])
    check(mm, [a, c, d])


@pytest.mark.parametrize("busy", [False, True])
def test_pages_are_unmapped_after_a_synchronize_only_while_their_stream_has_work(busy):
    """The stream-order rule of stitching and trims (level real, sim): a free block's pages
    may still be used by work queued on the stream that freed it, and cuMemUnmap is not
    stream-ordered. While that stream has queued work, a stitching miss and a trim each
    synchronize the device once before unmapping; once the stream is idle they unmap without
    waiting (the device is only asked, a stream query). Bytes and invariants hold either way."""
    dev, mm = sim_manager("1GiB", back_memory=True, segments="tight")
    s = dev.create_stream()
    a, b, c, e, f = (mm.malloc(n * MiB, stream=s) for n in (10, 20, 10, 20, 10))
    kept = [(x, _fill(x, i)) for i, x in enumerate((a, c, f))]
    b.free()
    e.free()
    if busy:
        dev.submit(s)                            # work queued before the frees may still run
    syncs, device_syncs = mm._expandable.stitch_syncs, dev.synchronize_calls
    d = mm.malloc(36 * MiB, stream=s)            # stitches 18 pages of b and e
    assert mm._expandable.stitched_bytes == 36 * MiB
    assert mm._expandable.stitch_syncs - syncs == dev.synchronize_calls - device_syncs == busy
    assert dev.stream_idle(s) is True            # a synchronize drains every stream
    d.free()
    if busy:
        dev.submit(s)
    syncs, device_syncs = mm._expandable.stitch_syncs, dev.synchronize_calls
    assert mm.empty_cache() > 0
    assert mm._expandable.stitch_syncs - syncs == dev.synchronize_calls - device_syncs == busy
    _intact(kept)
    check(mm, [a, c, f])
    for x in (a, c, f):
        x.free()
    mm.close()
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)
