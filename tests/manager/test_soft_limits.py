"""Soft by default, hard when asked (issue 38): gpu_memory_fraction and min_free_bytes left at
their defaults bound the cache and set the pressure scale but never refuse what the device can
serve; a limit the user sets is hard and its OOM names it; messages say who refused.

Level: **real** (the real pool and MemoryManager on gpumem_sim devices).
"""
from __future__ import annotations

import pickle
import warnings

import pytest

import gpumem
import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import CpuFallbackWarning, OutOfMemoryError
from gpumem.manager.pressure import MemoryPressure
from gpumem_sim import SimDevice

MiB = 1 << 20
GiB = 1 << 30

pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


def _fresh(config: MemoryConfig | None = None, capacity: str = "1GiB",
           **sim) -> tuple[MemoryManager, SimDevice]:
    dev = SimDevice(capacity, **sim)
    gpumem_sim.install(dev)
    return MemoryManager("sim:0", config if config is not None else MemoryConfig()), dev


def _oom(mm: MemoryManager, nbytes: int) -> OutOfMemoryError:
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(nbytes, fallback=False)
    return info.value


# --- provenance: which limits are hard ------------------------------------------------------
def test_defaults_are_soft_and_values_the_user_writes_are_hard():
    """MemoryConfig() has no hard limit; a value passed (even the default's), replace(),
    with_*(), from_env() and for_constrained() make hard ones; other changes keep the kinds;
    with_soft_limits() and for_inference() keep theirs soft; a pickle keeps them (real)."""
    assert MemoryConfig().user_limits == frozenset()
    assert MemoryConfig().limit_kinds() == {"gpu_memory_fraction": "soft",
                                            "min_free_bytes": "soft",
                                            "reserve_bytes": "soft", "max_pool_size": "off"}
    explicit = MemoryConfig(gpu_memory_fraction=0.9)
    assert explicit == MemoryConfig() and explicit.is_hard("gpu_memory_fraction")
    assert not explicit.is_hard("min_free_bytes")
    assert MemoryConfig().replace(min_free_bytes="512MiB").user_limits == {"min_free_bytes"}
    assert MemoryConfig().with_gpu_memory_fraction(0.8).is_hard("gpu_memory_fraction")
    kept = explicit.replace(track_allocations=True, segments="plain")
    assert kept.user_limits == {"gpu_memory_fraction"}
    env = MemoryConfig.from_env({"GPUMEM_MIN_FREE_BYTES": "256MiB"})
    assert env.user_limits == {"min_free_bytes"}
    assert MemoryConfig.for_constrained().is_hard("gpu_memory_fraction")
    assert MemoryConfig.for_constrained().is_hard("min_free_bytes")
    inference = MemoryConfig.for_inference()
    assert inference.gpu_memory_fraction == 0.95 and not inference.is_hard("gpu_memory_fraction")
    assert inference.limit_kinds()["max_pool_size"] == "hard"
    soft = explicit.with_soft_limits(gpu_memory_fraction=0.8)
    assert soft.gpu_memory_fraction == 0.8 and soft.user_limits == frozenset()
    assert pickle.loads(pickle.dumps(explicit)).user_limits == {"gpu_memory_fraction"}
    assert "gpu_memory_fraction=0.9 (hard)" in explicit.describe_limits()
    with pytest.raises(gpumem.InvalidInputError, match="with_soft_limits takes limits only"):
        MemoryConfig().with_soft_limits(segments="plain")
    with pytest.raises(gpumem.InvalidInputError, match="not a limit"):
        MemoryConfig().is_hard("segments")


# --- the targets of the issue -----------------------------------------------------------------
def test_default_serves_95_percent_of_an_empty_1gib_card():
    """MemoryConfig() serves 0.95 GiB of an empty sim:1GiB, from the device, without a CPU
    fallback or a warning (today's hard 0.9 and 512 MiB refused it) (real)."""
    mm, dev = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CpuFallbackWarning)
        buf = mm.malloc(int(0.95 * GiB))
    assert buf.location == "device" and mm.stats().cpu_fallbacks == 0
    assert mm.pressure() is MemoryPressure.CRITICAL          # past the soft usable memory
    buf.free()
    mm.close()


def test_a_users_fraction_refuses_and_the_oom_names_it():
    """MemoryConfig(gpu_memory_fraction=0.5) refuses 600 MiB on sim:1GiB; the OOM names the
    setting as the user's hard limit; the fraction it suggests serves it (real)."""
    mm, _ = _fresh(MemoryConfig(gpu_memory_fraction=0.5))
    msg = str(_oom(mm, 600 * MiB))
    assert "gpu_memory_fraction=0.5 (your hard limit) refused it" in msg
    assert "min_free_bytes" not in msg.split("refused it")[0]
    mm.close()
    mm, _ = _fresh(MemoryConfig(gpu_memory_fraction=0.59))
    mm.malloc(600 * MiB, fallback=False).free()
    mm.close()


def test_an_explicit_default_value_caps():
    """MemoryConfig(gpu_memory_fraction=0.9), the default's value written by the user, is a hard
    cap: 0.95 GiB is refused where MemoryConfig() serves it (real)."""
    mm, _ = _fresh(MemoryConfig(gpu_memory_fraction=0.9, min_free_bytes=0))
    assert mm.hold_limit == int(0.9 * GiB)
    assert "gpu_memory_fraction=0.9 (your hard limit)" in str(_oom(mm, int(0.95 * GiB)))
    mm.close()


def test_environment_and_configure_make_hard_limits(monkeypatch):
    """GPUMEM_MIN_FREE_BYTES and gpumem.configure(...) are the user's: the first refuses 600 MiB
    of sim:1GiB (leaving < 512 MiB), the second caps the shared manager (real)."""
    monkeypatch.setenv("GPUMEM_MIN_FREE_BYTES", "512MiB")
    mm, _ = _fresh(MemoryConfig.from_env())
    assert "min_free_bytes=512.00 MiB (your hard limit) refused it" in str(_oom(mm, 600 * MiB))
    mm.close()
    monkeypatch.delenv("GPUMEM_MIN_FREE_BYTES")
    shared = gpumem.configure("sim:0", gpu_memory_fraction=0.5)
    try:
        assert shared.hold_limit == GiB // 2
    finally:
        shared.close()


def test_soft_min_free_gives_cache_back_before_asking_the_driver():
    """A growth past the soft limits first releases cached memory, then asks the driver: the
    driver never sees a request it must refuse, and the request is served (real)."""
    mm, dev = _fresh(MemoryConfig(segments="plain"))
    mm.malloc(400 * MiB).free()                      # 400 MiB cached
    failed = dev.failed_allocs
    buf = mm.malloc(700 * MiB, fallback=False)       # 624 MiB free: the cache must go first
    assert dev.failed_allocs == failed and mm.stats().cpu_fallbacks == 0
    assert mm.stats().reserved_bytes == buf.nbytes   # the 400 MiB went back
    buf.free()
    mm.close()


def test_soft_usable_memory_bounds_the_cache():
    """Past the soft usable memory the pressure is CRITICAL and the emergency cleanup leaves no
    wholly free segment cached, while every live buffer is served (real)."""
    mm, _ = _fresh(MemoryConfig(segments="plain"))
    keep = [mm.malloc(300 * MiB, fallback=False) for _ in range(2)]
    spare = mm.malloc(200 * MiB, fallback=False)
    spare.free()                                     # 200 MiB cached, 800 MiB held
    big = mm.malloc(200 * MiB, fallback=False)       # served from the cache
    more = mm.malloc(150 * MiB, fallback=False)      # past 0.9 GiB: a growth, cache trimmed
    assert mm.pressure() is MemoryPressure.CRITICAL
    assert mm.stats().reserved_bytes == mm.stats().in_use_bytes
    for b in keep + [big, more]:
        b.free()
    mm.close()


def test_the_device_refusal_is_named_as_the_devices():
    """A request the device cannot hold (other processes hold it) is refused by the device, and
    the OOM and the CPU-fallback warning say so, not that a setting refused it (real)."""
    mm, _ = _fresh(other_process_bytes=900 * MiB)
    msg = str(_oom(mm, 200 * MiB))
    assert "the device refused it: it has only 124.00 MiB free" in msg
    assert "(your hard limit)" not in msg
    with pytest.warns(CpuFallbackWarning, match=r"the device refused it \(124.00 MiB free\)"):
        fb = mm.malloc(200 * MiB)
    fb.free()
    mm.close()


def test_fallback_warning_names_a_hard_limit_and_not_an_exhausted_device():
    """With the device half empty, a user's hard fraction refuses: the CPU-fallback warning
    names that limit and does not call the device exhausted (real)."""
    mm, _ = _fresh(MemoryConfig(gpu_memory_fraction=0.5, min_free_bytes=0))
    with pytest.warns(CpuFallbackWarning) as record:
        fb = mm.malloc(600 * MiB)
    text = str(record[0].message)
    assert "gpu_memory_fraction=0.5 (your hard limit) refused it" in text
    assert "exhausted" not in text
    fb.free()
    mm.close()


def test_usable_memory_assigned_on_a_manager_is_hard():
    """mm.usable_memory = n caps the manager at n (the caller's own limit) and the OOM says it
    was set on the manager (real)."""
    mm, _ = _fresh()
    mm.usable_memory = 256 * MiB
    assert mm.hold_limit == 256 * MiB
    assert "usable_memory=256.00 MiB (set on the manager)" in str(_oom(mm, 300 * MiB))
    mm.close()


def test_info_and_summary_say_which_limits_are_hard(capsys, monkeypatch):
    """gpumem info prints each limit with its kind (GPUMEM_GPU_MEMORY_FRACTION makes that one
    hard), and memory_summary says soft/hard beside the figures (real, CLI in process)."""
    from gpumem.cli import main
    gpumem_sim.install(SimDevice("1GiB"))
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "0.8")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "gpu_memory_fraction=0.8 (hard)" in out and "min_free_bytes=512.00 MiB (soft)" in out
    monkeypatch.delenv("GPUMEM_GPU_MEMORY_FRACTION")
    mm = MemoryManager("sim:0", MemoryConfig())
    assert "usable 1.00 GiB" in mm.memory_summary() and "soft" in mm.memory_summary()
    mm.close()
