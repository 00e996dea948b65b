"""Memory pressure: levels, observers (exactly once per level change), automatic responses
(HIGH trims the cache, CRITICAL releases every wholly free segment) and threshold validation.

Most tests use simulated devices (exact sizes, driver call counters). The crossing test also runs
on real backends named in ``GPUMEM_TEST_BACKENDS`` (e.g. ``sim,cpu,opencl,cuda``); by default
only ``sim`` runs. Every test leaves the sim registry as it found it.
"""
from __future__ import annotations

import math
import warnings

import pytest

from gpumem import MemoryConfig, MemoryManager, MemoryPressure
from gpumem.errors import InvalidInputError
from gpumem.manager.pressure import pressure_level
from gpumem_sim import SimDevice
import invariants

MiB = 1 << 20
LOW, MEDIUM, HIGH, CRITICAL = (MemoryPressure.LOW, MemoryPressure.MEDIUM, MemoryPressure.HIGH,
                               MemoryPressure.CRITICAL)


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


@pytest.fixture(params=invariants.selected_backends(default=("sim",)))
def device(request) -> str:
    """A device string on each selected backend (sim: a fresh 4 GiB simulated device)."""
    return invariants.backend_device(request.param, "4GiB")


def sim_manager(capacity: int = 1000 * MiB, **config) -> tuple[SimDevice, MemoryManager]:
    """A manager whose usable memory is exactly ``capacity`` (no reserve, no min free) and whose
    automatic responses are off unless asked for (``invariants.QUIET``)."""
    return invariants.sim_manager(capacity, base=invariants.QUIET, **config)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[MemoryPressure, MemoryPressure, float]] = []

    def __call__(self, old: MemoryPressure, new: MemoryPressure, ratio: float) -> None:
        self.events.append((old, new, ratio))

    @property
    def changes(self) -> list[tuple[MemoryPressure, MemoryPressure]]:
        return [(o, n) for o, n, _ in self.events]


# --- levels ----------------------------------------------------------------------------------
def test_pressure_level_boundaries():
    t = (0.6, 0.8, 0.95)
    assert pressure_level(0.0, t) is LOW
    assert pressure_level(0.5999, t) is LOW
    assert pressure_level(0.6, t) is MEDIUM
    assert pressure_level(0.7999, t) is MEDIUM
    assert pressure_level(0.8, t) is HIGH
    assert pressure_level(0.95, t) is HIGH          # CRITICAL is *above* the threshold
    assert pressure_level(0.9501, t) is CRITICAL
    assert pressure_level(1.0, t) is CRITICAL
    assert LOW < MEDIUM < HIGH < CRITICAL


def test_fresh_manager_is_low():
    _, mm = sim_manager()
    assert mm.pressure() is LOW
    assert mm.pressure_ratio() == 0.0


def test_crossings_fire_each_observer_once_per_level_change():
    _, mm = sim_manager(1000 * MiB)
    a, b = Recorder(), Recorder()
    mm.on_pressure(a)
    mm.on_pressure(b)
    held = []
    seen = []
    for _ in range(10):                      # 100 MiB segments: 10 %, 20 %, ... 100 %
        held.append(mm.malloc(100 * MiB))
        seen.append(mm.pressure())
    assert seen == [LOW] * 5 + [MEDIUM] * 2 + [HIGH] * 2 + [CRITICAL]
    assert a.changes == [(LOW, MEDIUM), (MEDIUM, HIGH), (HIGH, CRITICAL)]
    assert b.changes == a.changes
    assert [r for _, _, r in a.events] == [0.6, 0.8, 1.0]
    # freeing keeps the segments reserved: no change, no callback
    for buf in held:
        buf.free()
    assert mm.pressure() is CRITICAL and len(a.events) == 3
    # releasing the cache drops straight to LOW: one callback
    assert mm.empty_cache() == 1000 * MiB
    assert a.changes[3:] == [(CRITICAL, LOW)]
    assert b.changes == a.changes
    assert mm.pressure() is LOW


def test_no_callback_without_level_change():
    _, mm = sim_manager(1000 * MiB)
    rec = Recorder()
    mm.on_pressure(rec)
    bufs = [mm.malloc(100 * MiB) for _ in range(5)]   # 50 %: still LOW
    bufs.append(mm.malloc(50 * MiB))                  # 55 %
    assert rec.events == []
    bufs.pop().free()
    mm.empty_cache()                                  # 50 %: still LOW
    assert rec.events == []


def test_custom_thresholds():
    _, mm = sim_manager(1000 * MiB, pressure_thresholds=(0.25, 0.5, 0.75))
    rec = Recorder()
    mm.on_pressure(rec)
    held = [mm.malloc(100 * MiB) for _ in range(8)]
    assert rec.changes == [(LOW, MEDIUM), (MEDIUM, HIGH), (HIGH, CRITICAL)]
    assert [r for _, _, r in rec.events] == [0.3, 0.5, 0.8]
    del held


def test_jump_over_levels_fires_once():
    _, mm = sim_manager(1000 * MiB)
    rec = Recorder()
    mm.on_pressure(rec)
    buf = mm.malloc(990 * MiB)
    assert rec.changes == [(LOW, CRITICAL)]
    buf.free()
    mm.empty_cache()
    assert rec.changes == [(LOW, CRITICAL), (CRITICAL, LOW)]


def test_crossings_on_backend(device: str):
    """The same observer contract on any backend: usable memory is made ~400 MiB through
    gpu_memory_fraction, and the callbacks must match the level seen after each step."""
    probe = MemoryManager(device, MemoryConfig(min_free_bytes=0, cpu_fallback_enabled=False))
    total = probe.total_memory
    free, _ = probe.memory_info()
    probe.close()
    if free < 600 * MiB:
        pytest.skip(f"{device} has only {free} bytes free")
    fraction = min(1.0, 400 * MiB / total)
    mm = MemoryManager(device, MemoryConfig(
        min_free_bytes=0, gpu_memory_fraction=fraction, reserve_bytes=0,
        cpu_fallback_enabled=False, release_before_grow=False))
    try:
        rec = Recorder()
        mm.on_pressure(rec)
        chunk = (mm.usable_memory // 20) // 4096 * 4096
        assert chunk >= 10 * MiB                       # exact-size segments
        expected = []
        level = LOW
        held = []
        while True:
            try:
                held.append(mm.malloc(chunk))
            except MemoryError:
                break
            now = mm.pressure()
            if now != level:
                expected.append((level, now))
                level = now
        assert level is CRITICAL
        assert rec.changes == expected
        assert rec.changes[0][0] is LOW and rec.changes[-1][1] is CRITICAL
        assert [n for _, n in rec.changes] == sorted(n for _, n in rec.changes)  # only rising
    finally:
        mm.close()


# --- automatic responses ----------------------------------------------------------------------
def test_high_trims_cache_to_high_cache_fraction():
    # plain segments: whole-segment release
    dev, mm = sim_manager(1000 * MiB, auto_release_at_high=True, high_cache_fraction=0.1, expandable_segments=False)
    rec = Recorder()
    mm.on_pressure(rec)
    bufs = [mm.malloc(100 * MiB) for _ in range(7)]   # 70 %: MEDIUM
    for b in bufs[:4]:
        b.free()                                       # 400 MiB cached in 4 segments
    assert mm.stats().cached_bytes == 400 * MiB
    frees_before = dev.free_calls
    big = mm.malloc(150 * MiB)                        # no cached block fits: grow to 85 %
    st = mm.stats()
    assert st.cached_bytes <= 0.1 * mm.usable_memory
    assert st.cached_bytes == 100 * MiB               # 3 of the 4 idle segments went back
    assert dev.free_calls - frees_before == 3
    assert rec.changes == [(LOW, MEDIUM), (MEDIUM, HIGH), (HIGH, LOW)]
    assert mm.pressure() is LOW and mm.pressure_ratio() == 0.55
    assert big.alive and all(b.alive for b in bufs[4:])
    mm.pool.check_invariants()


def test_high_response_off_keeps_cache():
    # plain segments: freed blocks in separate segments
    _, mm = sim_manager(1000 * MiB, auto_release_at_high=False, expandable_segments=False)
    bufs = [mm.malloc(100 * MiB) for _ in range(7)]
    for b in bufs[:4]:
        b.free()
    big = mm.malloc(150 * MiB)
    assert mm.stats().cached_bytes == 400 * MiB
    assert mm.pressure() is HIGH
    assert big.alive


def test_critical_releases_every_wholly_free_segment():
    # plain segments: whole-segment release
    dev, mm = sim_manager(1000 * MiB, auto_cleanup_at_critical=True, expandable_segments=False)
    rec = Recorder()
    mm.on_pressure(rec)
    held = [mm.malloc(100 * MiB) for _ in range(8)]   # 80 %: HIGH
    small = [mm.malloc(30 * MiB) for _ in range(3)]   # 89 %
    half = mm.malloc(2 * MiB)                         # a partly used 20 MiB segment: 91 %
    small[0].free()
    small[1].free()                                    # 60 MiB in wholly free segments
    assert mm.pressure() is HIGH and mm.stats().cached_bytes == 60 * MiB + 18 * MiB
    frees = dev.free_calls
    big = mm.malloc(45 * MiB)                         # no cached fit: grow to 95.5 %: CRITICAL
    st = mm.stats()
    # both idle 30 MiB segments went back; the partly used one stays
    assert dev.free_calls - frees == 2
    assert st.reserved_bytes == 800 * MiB + 30 * MiB + 20 * MiB + 45 * MiB
    assert st.cached_bytes == 18 * MiB
    assert rec.changes == [(LOW, MEDIUM), (MEDIUM, HIGH), (HIGH, CRITICAL), (CRITICAL, HIGH)]
    assert half.alive and big.alive and small[2].alive and all(b.alive for b in held)
    mm.pool.check_invariants()


def test_emergency_cleanup_returns_bytes_and_is_idempotent():
    # plain segments: whole-segment release
    dev, mm = sim_manager(1000 * MiB, expandable_segments=False)
    bufs = [mm.malloc(100 * MiB) for _ in range(3)]
    bufs[0].free()
    bufs[1].free()
    assert mm.emergency_cleanup() == 200 * MiB
    assert mm.emergency_cleanup() == 0
    assert dev.live_bytes == 100 * MiB


def test_emergency_cleanup_with_refused_free_keeps_segment():
    # plain segments: fail_free faults free_segment
    dev, mm = sim_manager(1000 * MiB, expandable_segments=False)
    mm.malloc(100 * MiB).free()
    dev.inject(fail_free=True)
    with pytest.warns(RuntimeWarning, match="refused to free"):
        assert mm.emergency_cleanup() == 0
    assert mm.stats().cached_bytes == 100 * MiB       # still cached, still usable
    mm.pool.check_invariants()
    dev.clear_faults()
    assert mm.emergency_cleanup() == 100 * MiB


def test_set_max_pool_size_trims_and_updates_pressure():
    _, mm = sim_manager(1000 * MiB)
    rec = Recorder()
    mm.on_pressure(rec)
    bufs = [mm.malloc(100 * MiB) for _ in range(7)]
    for b in bufs:
        b.free()
    assert mm.pressure() is MEDIUM
    mm.set_max_pool_size(250 * MiB)
    assert mm.stats().cached_bytes <= 250 * MiB
    assert rec.changes[-1] == (MEDIUM, LOW)
    with pytest.raises(InvalidInputError):
        mm.set_max_pool_size(-1)


def test_on_pressure_rejects_non_callable():
    _, mm = sim_manager()
    with pytest.raises(InvalidInputError, match="callable"):
        mm.on_pressure("not a function")


def test_observer_exception_does_not_fail_malloc():
    _, mm = sim_manager(1000 * MiB)

    def boom(old, new, ratio):
        raise RuntimeError("observer failed")

    mm.on_pressure(boom)
    with pytest.warns(RuntimeWarning, match="observer failed"):
        bufs = [mm.malloc(100 * MiB) for _ in range(6)]   # the 6th crosses into MEDIUM
    assert len(bufs) == 6
    assert mm.pressure() == MemoryPressure.MEDIUM     # the level change was still recorded


def test_critical_threshold_one_is_reachable():
    _, mm = sim_manager(1000 * MiB, pressure_thresholds=(0.6, 0.8, 1.0))
    held = [mm.malloc(100 * MiB) for _ in range(10)]   # 100 % of usable memory
    assert mm.pressure_ratio() == 1.0
    assert mm.pressure() is CRITICAL
    del held


# --- threshold validation ----------------------------------------------------------------------
@pytest.mark.parametrize("thresholds", [
    (-0.1, 0.8, 0.95), (0.6, -0.8, 0.95), (0.6, 0.8, -0.95),
    (math.nan, 0.8, 0.95), (0.6, math.nan, 0.95), (0.6, 0.8, math.nan),
    (0.6, 0.8, math.inf), (-math.inf, 0.8, 0.95),
    (0.0, 0.8, 0.95), (0.8, 0.6, 0.95), (0.6, 0.6, 0.95), (0.6, 0.8, 1.5),
    (0.6, 0.8), (0.6, 0.8, 0.9, 0.95), (True, 0.8, 0.95), ("0.6", 0.8, 0.95), None, 0.6,
])
def test_bad_pressure_thresholds_rejected(thresholds):
    with pytest.raises(InvalidInputError, match="pressure_thresholds"):
        MemoryConfig(pressure_thresholds=thresholds)


def test_bad_thresholds_through_builder_and_env():
    with pytest.raises(InvalidInputError):
        MemoryConfig().with_pressure_thresholds(math.nan, 0.8, 0.95)
    with pytest.raises(InvalidInputError):
        MemoryConfig().with_pressure_thresholds(-0.5, 0.8, 0.95)
    for raw in ("nan,0.8,0.95", "-1,0.8,0.95", "0.6,0.8", "a,b,c"):
        with pytest.raises(InvalidInputError, match="(?i)pressure_thresholds"):
            MemoryConfig.from_env({"GPUMEM_PRESSURE_THRESHOLDS": raw})
    assert MemoryConfig.from_env({"GPUMEM_PRESSURE_THRESHOLDS": "0.5,0.7,0.9"}
                                 ).pressure_thresholds == (0.5, 0.7, 0.9)


@pytest.mark.parametrize("fraction", [-0.1, math.nan, math.inf, 1.5, True])
def test_bad_high_cache_fraction_rejected(fraction):
    with pytest.raises(InvalidInputError, match="high_cache_fraction"):
        MemoryConfig(high_cache_fraction=fraction)


def test_valid_thresholds_accepted():
    cfg = MemoryConfig(pressure_thresholds=(0.1, 0.2, 0.3))
    assert cfg.pressure_thresholds == (0.1, 0.2, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryConfig.for_constrained()
