"""Reconfiguring a live manager (issue 33): a config the manager accepts is the one it runs with,
every part acts on it, and a field it cannot change is refused with nothing changed."""
from __future__ import annotations

import dataclasses

import pytest

import gpumem
from gpumem import MemoryConfig, MemoryManager, MultiDeviceManager
from gpumem.errors import ClosedManagerError, InvalidInputError, OutOfMemoryError
from gpumem.manager.live_config import FIXED_FIELDS, LIVE_FIELDS
from gpumem.placement.shared import close_shared_managers

MiB, GiB = 1 << 20, 1 << 30


def _configs_reachable(mm: MemoryManager) -> list[tuple[str, MemoryConfig]]:
    """Every MemoryConfig a part of `mm` holds (attributes of its parts and of the objects they
    hold, two levels down), named by path: a part that kept the config it was built with shows
    up here."""
    found = []
    seen = set()

    def walk(obj, path, depth):
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        for name, value in list(getattr(obj, "__dict__", {}).items()):
            if isinstance(value, MemoryConfig):
                found.append((f"{path}.{name}", value))
            elif type(value).__module__.startswith("gpumem.manager"):
                walk(value, f"{path}.{name}", depth + 1)

    for name in ("_growth", "_miss", "_pressure", "_streams", "_peaks"):
        walk(getattr(mm, name), name, 0)
    return found


def test_cpu_fallback_turned_off_by_assignment(sim_device):
    """The issue's first example: assigning a config without CPU fallback stops fallbacks (a
    1 GiB device used to serve over 100 of 200 x 10 MiB from host memory anyway)."""
    sim_device("1GiB")
    mm = MemoryManager("sim:0", MemoryConfig())
    try:
        mm.config = mm.config.replace(cpu_fallback_enabled=False)
        assert mm.config.cpu_fallback_enabled is False
        with pytest.raises(OutOfMemoryError):
            mm.allocate_batch([10 * MiB] * 200)
        assert mm.stats().cpu_fallbacks == 0
        mm.reconfigure(cpu_fallback_enabled=True)     # and back on: host memory serves the rest
        bufs = mm.allocate_batch([10 * MiB] * 200)
        assert mm.stats().cpu_fallbacks > 0
        del bufs
    finally:
        mm.close()


def test_track_allocations_makes_and_drops_the_tracker(make_manager):
    """Assigning track_allocations=True makes the tracker (it sees buffers allocated after);
    False drops it, and check_leaks says tracking is off."""
    mm = make_manager()
    assert mm.tracker is None
    mm.config = mm.config.replace(track_allocations=True)
    assert mm.tracker is not None
    buf = mm.malloc(MiB, tag="weights")
    assert [b.tag for b in mm.check_leaks()] == ["weights"]
    mm.reconfigure(track_stacks=True)             # a tracker with stacks replaces it
    assert mm.tracker.capture_stacks
    other = mm.malloc(MiB, tag="kv")
    assert "kv" in [b.tag for b in mm.check_leaks()]
    mm.reconfigure(track_allocations=False)
    assert mm.tracker is None
    with pytest.raises(InvalidInputError, match="track_allocations"):
        mm.check_leaks()
    buf.free()
    other.free()


def test_gpu_memory_fraction_changes_the_limit(sim_device):
    """gpu_memory_fraction=0.1 on a 4 GiB device: the limit drops to 0.4 GiB, so 1 GiB is no
    longer served (it was before the change)."""
    sim_device("4GiB")
    mm = MemoryManager("sim:0", MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0,
                                             reserve_bytes=0))
    try:
        mm.malloc(GiB).free()
        mm.empty_cache()
        mm.config = mm.config.replace(gpu_memory_fraction=0.1)
        assert mm.usable_memory == int(4 * GiB * 0.1)
        with pytest.raises(OutOfMemoryError):
            mm.malloc(GiB)
        mm.malloc(300 * MiB).free()               # within the new limit
        mm.reconfigure(gpu_memory_fraction=1.0)
        mm.malloc(GiB).free()
    finally:
        mm.close()


def test_narrower_limit_releases_the_cache(make_manager):
    """A limit below what the pool holds gives the cached segments back at once."""
    mm = make_manager()
    mm.malloc(2 * GiB).free()
    assert mm.stats().reserved_bytes >= 2 * GiB
    mm.reconfigure(gpu_memory_fraction=0.25)
    assert mm.stats().reserved_bytes <= GiB


def test_set_max_pool_size_is_reported_in_config_and_snapshot(make_manager):
    """set_max_pool_size("128MiB") is what config and snapshot()["config"] say afterwards."""
    mm = make_manager()
    mm.set_max_pool_size("128MiB")
    assert mm.config.max_pool_size == 128 * MiB
    assert mm.snapshot()["config"]["max_pool_size"] == 128 * MiB
    mm.set_max_pool_size(None)
    assert mm.config.max_pool_size is None


def test_max_pool_size_by_reconfigure_trims(make_manager):
    """reconfigure(max_pool_size=...) caps the cache as set_max_pool_size does."""
    mm = make_manager(expandable_segments=False)
    bufs = [mm.malloc(30 * MiB) for _ in range(8)]
    for b in bufs:
        b.free()
    assert mm.stats().cached_bytes >= 200 * MiB
    mm.reconfigure(max_pool_size=64 * MiB)
    assert mm.stats().cached_bytes <= 64 * MiB


def test_pressure_thresholds_take_effect(make_manager):
    """New pressure thresholds change the level at once."""
    mm = make_manager()
    buf = mm.malloc(GiB)                        # a quarter of the device
    assert mm.pressure() == gpumem.MemoryPressure.LOW
    mm.reconfigure(pressure_thresholds=(0.1, 0.2, 0.9))
    assert mm.pressure() == gpumem.MemoryPressure.HIGH
    buf.free()


def test_every_part_holds_the_new_config(make_manager):
    """After a change no part keeps an older config: every MemoryConfig reachable from the
    parts is the manager's own (a part that copied its config at construction fails this)."""
    for expandable in (True, False):
        mm = make_manager(expandable_segments=expandable)
        mm.reconfigure(min_free_bytes=MiB, release_before_grow=False)
        held = _configs_reachable(mm)
        assert held, "the parts hold no config: this test would prove nothing"
        for path, cfg in held:
            assert cfg is mm.config, f"{path} still holds an older config"


@pytest.mark.parametrize("name", sorted(n for n in FIXED_FIELDS
                                        if n in {f.name for f in dataclasses.fields(MemoryConfig)}))
def test_fixed_fields_are_refused(make_manager, name):
    """A pool or segment-layout field cannot change on a live manager: the error names the
    field and why, and config, limits and stats are unchanged (the other changes of the same
    call are not applied either)."""
    mm = make_manager()
    before = (mm.config, mm.usable_memory, mm.stats())
    plain = mm.config.segments == "plain"
    special = {"expandable_segments": ({name: True, "segments": "auto"} if plain
                                       else {name: not mm.config.expandable_segments}),
               # a handle size with plain segments is refused by MemoryConfig itself: the
               # plain pass changes the policy too, and the refusal still names the field
               "expandable_handle_size": ({name: 64 * MiB, "segments": "tight"}
                                          if plain else {name: 64 * MiB}),
               "max_split_size": {name: 64 * MiB},
               "segments": {name: "plain" if mm.config.segments != "plain" else "tight"},
               "shared_group": {name: "another-group"},
               "shared_budget": {"shared_group": "another-group", name: 0.5},
               "shared_hand_back": {name: not mm.config.shared_hand_back}}
    changes = special.get(name) or {name: getattr(mm.config, name) * 2}
    with pytest.raises(InvalidInputError, match=rf"{name} .*cannot|cannot.*{name} \("):
        mm.reconfigure(**changes, gpu_memory_fraction=0.5)
    with pytest.raises(InvalidInputError, match=name):
        mm.config = mm.config.replace(**changes)
    assert (mm.config, mm.usable_memory, mm.stats()) == before


def test_every_config_field_is_classified():
    """Each MemoryConfig field is either changeable on a live manager or fixed (with a reason):
    a new field must say which, or a change to it is refused."""
    names = {f.name for f in dataclasses.fields(MemoryConfig)}
    assert not set(LIVE_FIELDS) & set(FIXED_FIELDS)
    unclassified = names - set(LIVE_FIELDS) - set(FIXED_FIELDS)
    assert not unclassified, unclassified


def test_bad_changes_change_nothing(make_manager):
    """An invalid value, an unknown field, a non-config assignment: InvalidInputError, and the
    config is the same object as before."""
    mm = make_manager()
    cfg = mm.config
    with pytest.raises(InvalidInputError, match="gpu_memory_fraction"):
        mm.reconfigure(gpu_memory_fraction=2.0)
    with pytest.raises(InvalidInputError, match="unknown MemoryConfig field"):
        mm.reconfigure(no_such_field=1)
    with pytest.raises(InvalidInputError, match="MemoryConfig"):
        mm.config = {"cpu_fallback_enabled": False}
    with pytest.raises(InvalidInputError, match="max_pool_size"):
        mm.set_max_pool_size("lots")
    assert mm.config is cfg


def test_closed_manager_refuses(make_manager):
    mm = make_manager()
    mm.close()
    with pytest.raises(ClosedManagerError):
        mm.reconfigure(cpu_fallback_enabled=True)


def test_multi_device_reconfigure_all_or_none(sim_device):
    """MultiDeviceManager.reconfigure reaches every manager; placement reads the new limits;
    a field one manager refuses changes none."""
    sim_device("4GiB", count=2)
    cfg = MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0, reserve_bytes=0)
    with MultiDeviceManager(["sim:0", "sim:1"], cfg, policy="most_free") as multi:
        with pytest.raises(InvalidInputError, match="large_segment"):
            multi.reconfigure(large_segment=40 * MiB, gpu_memory_fraction=0.5)
        assert all(m.config is not None and m.config.gpu_memory_fraction == 0.9 for m in multi)
        multi.reconfigure(gpu_memory_fraction=0.5)
        assert [m.usable_memory for m in multi] == [2 * GiB, 2 * GiB]
        multi.manager("sim:0").reconfigure(gpu_memory_fraction=1.0)
        # most free now means sim:0 (4 GiB usable), on the Python path (a name) as in C
        buf = multi.allocate_on_best_device(MiB, name="w")
        assert buf.manager is multi.manager("sim:0")
        buf.free()


def test_shared_manager_reconfigured_in_place(sim_device):
    """A shared manager changed through get_manager() keeps its live buffers and runs with
    the new config (gpumem.configure replaces the manager; this changes it)."""
    sim_device("1GiB")
    try:
        mm = gpumem.get_manager("sim:0")
        buf = mm.malloc(MiB)
        mm.config = mm.config.replace(cpu_fallback_enabled=False, gpu_memory_fraction=0.9)
        assert gpumem.get_manager("sim:0") is mm
        assert gpumem.get_manager("sim:0").config.cpu_fallback_enabled is False
        with pytest.raises(OutOfMemoryError):   # over the (now hard) limit, within the device:
            mm.malloc(950 * MiB)                 # host memory served it before
        assert buf.alive
        buf.free()
    finally:
        close_shared_managers()
