"""The segment policy named by intent (``MemoryConfig(segments=...)``, issue 31) and the auto
policy's two regimes: one cheap handle per growth while there is room, compaction (one-page
handles, moved pages) near the limits.

Levels: **real** (the real pool and manager on sim) and, through the ``vm`` fixture's cuda
param, **fake driver** (tests/fake_cuda under the real cuda-python; ci/test.sh's cuda pass).
"""
from __future__ import annotations

import pytest

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import InvalidInputError
from gpumem.manager.handle_sizing import ROOMY_HANDLE_SHARE
from gpumem.units import MiB
from invariants import check, sim_manager
from vm_managers import fill, intact, random_walk, refusing_nth, vm  # noqa: F401


@pytest.mark.parametrize("settings, policy, handle", [
    ({}, "auto", 0),
    ({"segments": "tight"}, "tight", 0),
    ({"segments": "fast"}, "fast", 0),
    ({"segments": "plain"}, "plain", 0),
    ({"expandable_segments": False}, "plain", 0),
    ({"expandable_segments": True}, "auto", 0),
    ({"expandable_handle_size": 0}, "tight", 0),            # one page per handle: tight
    ({"expandable_handle_size": 20 * MiB}, "tight", 20 * MiB),
    ({"expandable_handle_size": "growth"}, "fast", 0),
    ({"segments": "tight", "expandable_handle_size": 6 * MiB}, "tight", 6 * MiB),
])
def test_the_older_settings_still_name_a_policy(settings, policy, handle):
    """What a user who set expandable_segments / expandable_handle_size before gets: False is
    plain, a handle size is tight with handles of that size (2 MiB keeps meaning one page,
    always tight), "growth" is fast; the default is auto."""
    cfg = MemoryConfig(**settings)
    assert (cfg.segment_policy, cfg.tight_handle_size) == (policy, handle)


@pytest.mark.parametrize("settings, named", [
    ({"segments": "fast", "expandable_segments": False}, "expandable_segments=False"),
    ({"segments": "fast", "expandable_handle_size": 0}, "expandable_handle_size=0"),
    ({"segments": "tight", "expandable_handle_size": "growth"}, "expandable_handle_size='growth'"),
    ({"segments": "quick"}, "segments must be one of auto, tight, fast, plain"),
])
def test_contradicting_settings_are_refused_naming_both(settings, named):
    """A policy and an older setting that says otherwise: InvalidInputError naming both (no
    silent winner)."""
    with pytest.raises(InvalidInputError, match=named.replace("(", r"\(")):
        MemoryConfig(**settings)


def test_the_environment_names_the_policy():
    """GPUMEM_SEGMENTS picks the policy (any case); GPUMEM_EXPANDABLE_SEGMENTS=0 still means
    plain; a policy that does not exist names the variable."""
    assert MemoryConfig.from_env({"GPUMEM_SEGMENTS": "Tight"}).segment_policy == "tight"
    assert MemoryConfig.from_env({"GPUMEM_EXPANDABLE_SEGMENTS": "0"}).segment_policy == "plain"
    with pytest.raises(InvalidInputError, match="GPUMEM_SEGMENTS"):
        MemoryConfig.from_env({"GPUMEM_SEGMENTS": "quick"})


def test_plain_policy_uses_driver_segments():
    """segments="plain" on a device with virtual memory: no expandable segment, a cuMemAlloc-
    style segment per miss (sim: live_segments)."""
    dev, mm = sim_manager("1GiB", segments="plain")
    buf = mm.malloc(30 * MiB)
    assert mm._expandable is None and dev.live_segments == 1 and dev.mapped_bytes == 0
    buf.free()
    mm.close()


def test_auto_grows_in_one_handle_while_there_is_room():
    """On a roomy card (8 GiB for 30 MiB) a miss maps one handle, rounded up to a plain large
    segment (40 MiB: reserve, create, map, access = 4 driver calls; tight makes 15 one-page
    handles), and nothing moves."""
    dev, mm = sim_manager("8GiB", segments="auto")
    ex = mm._expandable
    calls = ex.driver_calls
    buf = mm.malloc(30 * MiB)
    [seg] = ex.layout()
    assert ex.mappings(seg) == [(0, 40 * MiB)]
    assert ex.driver_calls - calls == 4
    assert (ex.roomy_growths, ex.tight_growths, ex.stitched_bytes) == (1, 0, 0)
    buf.free()
    mm.close()


def test_auto_compacts_near_the_limit_and_not_before():
    """Level real (sim, 1 GiB, every byte usable). 20 MiB requests one after another: while a
    20 MiB handle is at most ROOMY_HANDLE_SHARE of the room left and the room could hold the
    cache again, each growth is one 20 MiB handle; from there on each is ten one-page handles
    (which can move and go back page by page). Then, near the limit, a request that no free
    block holds is served by moving free pages (stitching) instead of new memory; bytes
    survive and the invariants hold throughout."""
    dev, mm = sim_manager("1GiB", back_memory=True, segments="auto")
    ex = mm._expandable
    kept = []
    for i in range(40):
        b = mm.malloc(20 * MiB)
        kept.append((b, fill(b, i)))
    [seg] = ex.layout()
    sizes = [n for _, n in ex.mappings(seg)]
    roomy = [n for n in sizes if n == 20 * MiB]
    assert ex.roomy_growths == len(roomy) > 0 and ex.tight_growths > 0
    # all roomy handles come first: the switch happens once, as the room runs out
    assert sizes[:len(roomy)] == roomy and set(sizes[len(roomy):]) == {ex.page}
    # the last roomy growth left at least 32 handles' worth of room
    assert 1024 * MiB - (len(roomy) - 1) * 20 * MiB >= 20 * MiB / ROOMY_HANDLE_SHARE
    check(mm, [b for b, _ in kept])
    # free every other tight buffer: 20 MiB pieces of free pages between live ones
    tight = kept[len(roomy):]
    freed = tight[::2]
    for b, _ in freed:
        b.free()
    kept = [x for x in kept if x not in freed]
    physical = dev.mapped_bytes
    big = mm.malloc(40 * MiB)                  # no free block holds it: pages move to it
    kept.append((big, fill(big, 99)))
    assert ex.stitched_bytes > 0 and dev.mapped_bytes <= physical
    intact(kept)
    check(mm, [b for b, _ in kept])
    for b, _ in kept:
        b.free()
    mm.close()


@pytest.mark.parametrize("fault", ["vm_map_many", "vm_create", "vm_unmap"])
def test_a_fault_while_compacting_rolls_back_completely(fault, monkeypatch):
    """Level real (sim). A miss near the limit that moves pages (and makes the rest) is
    refused at the unmap, the creation or the mapping: the pool, its counters and the
    device's memory are as before, live bytes are intact, and the same request works after."""
    from gpumem.observe.snapshot import take_snapshot
    dev, mm = sim_manager("320MiB", back_memory=True, segments="auto")
    ex = mm._expandable
    bufs = [mm.malloc(6 * MiB) for _ in range(40)]   # 240 MiB: one-page handles (compacting)
    kept = [(b, fill(b, i)) for i, b in enumerate(bufs)]
    for b, _ in kept[::4]:
        b.free()                                       # 60 MiB of free pages between live ones
    kept = [x for i, x in enumerate(kept) if i % 4]
    before = (mm.pool.reserved_bytes, mm.pool.in_use_bytes, dev.mapped_bytes,
              [(s["size"], [(b["size"], b["state"]) for b in s["blocks"]])
               for s in take_snapshot(mm)["segments"]])
    refuse, calls = refusing_nth(dev, fault, 1)
    monkeypatch.setattr(dev, fault, refuse)
    with mm._slow:
        assert ex.grow(72 * MiB, 0, None) is None      # 60 MiB of free pages move, 12 are made
    monkeypatch.undo()
    assert calls, f"the miss never called {fault}: it did not compact"
    after = (mm.pool.reserved_bytes, mm.pool.in_use_bytes, dev.mapped_bytes,
             [(s["size"], [(b["size"], b["state"]) for b in s["blocks"]])
              for s in take_snapshot(mm)["segments"]])
    assert after == before
    again = mm.malloc(72 * MiB)
    intact(kept)
    check(mm, [b for b, _ in kept] + [again])
    mm.close()


@pytest.mark.handle_size(None)
def test_random_work_with_the_auto_policy_keeps_every_invariant(vm):
    """vm_managers.random_walk on a 1 GiB card with the auto policy: the walk's requests
    (up to 24 MiB) are roomy while little is live and compacting as the card fills (both
    happen), holes included; every invariant and byte after each step. (Moved pages under
    auto: test_auto_compacts_near_the_limit_and_not_before.) The fake driver's card is
    larger: its manager is limited to the same 1 GiB."""
    total = vm.mm.device.mem_get_info()[1]
    if total > 1024 * MiB:
        vm.mm.reconfigure(gpu_memory_fraction=1024 * MiB / total)
    random_walk(vm.mm, seed=5, stitches=None)
    ex = vm.mm._expandable
    assert ex.roomy_growths > 0 and ex.tight_growths > 0


def test_a_shared_card_makes_auto_compact_early():
    """Memory another process holds counts: on an 8 GiB card with 7.5 GiB taken by others,
    auto compacts (one-page handles) where the same card free would grow in one handle."""
    dev = gpumem_sim.SimDevice("8GiB", other_process_bytes="7.5GiB")
    mm = MemoryManager(dev, MemoryConfig(min_free_bytes=0, cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0))
    buf = mm.malloc(30 * MiB)
    [seg] = mm._expandable.layout()
    assert set(n for _, n in mm._expandable.mappings(seg)) == {mm._expandable.page}
    assert mm._expandable.tight_growths == 1
    buf.free()
    mm.close()


def test_rounding_up_never_asks_other_processes(monkeypatch):
    """The quantum a cheap growth rounds up to is only worth having if it is free now: its
    check never asks the members of a shared group to hand memory back (that costs them a
    trim and this miss up to REPLY_WAIT); the size the miss needs is still checked with
    asking allowed."""
    dev, mm = sim_manager("8GiB", segments="auto")
    growth = mm._growth
    real = growth.segment_allowed
    calls = []

    def recording(seg_size, reserved, free, *, ask_others=True):
        calls.append((seg_size, ask_others))
        return real(seg_size, reserved, free, ask_others=ask_others)
    monkeypatch.setattr(growth, "segment_allowed", recording)
    buf = mm.malloc(30 * MiB)                   # needs 30 MiB, rounded up to 40 MiB
    assert (40 * MiB, False) in calls
    assert all(ask for size, ask in calls if size != 40 * MiB)
    buf.free()
    mm.close()
