"""Memory the process holds is in the statistics (issue 33): pages of expandable segments the
driver refused to free stay allocated on the device until a retry frees them; they are counted in
``reserved_bytes`` and in ``held_bytes``, shown by memory_summary, the CLI's summary JSON and the
Dask metrics. A seeded random walk with faults injected checks after every step that the device's
live bytes are exactly ``reserved_bytes``, with expandable segments and without.

Level: real (the Cython pool and the manager on gpumem_sim, faults injected in the simulated
driver).
"""
from __future__ import annotations

import random
import warnings

import pytest

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import OutOfMemoryError
from gpumem.observe.summary import summary_data
from invariants import QUIET, check, config_over

MiB = 1 << 20


def _held_manager():
    """A 1 GiB sim device whose expandable segments hold pages after a refused free."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(**config_over(QUIET, {"expandable_segments": True})))
    assert mm.expandable_segments is not None
    mm.malloc(64 * MiB).free()
    dev.inject(fail_free=True)
    with pytest.warns(RuntimeWarning, match="refused to free"):
        mm.empty_cache()
    dev.clear_faults()                  # the pages stay held until the next trim retries them
    return dev, mm


def test_refused_pages_are_reserved_and_held():
    """After the driver refuses to free pages, reserved_bytes still counts them (the device
    holds them), held_bytes says how much, and a later trim frees them."""
    dev, mm = _held_manager()
    try:
        st = mm.stats()
        held = mm.expandable_segments.held_bytes
        assert held == 64 * MiB
        assert mm.expandable_segments.held_pages == held // dev.vm_granularity()
        assert st.held_bytes == held
        assert st.reserved_bytes == dev.live_bytes == st.in_use_bytes + st.cached_bytes + held
        assert st.peak_reserved_bytes >= st.reserved_bytes
        check(mm)
        mm.empty_cache()                              # the retry frees them
        st = mm.stats()
        assert (st.held_bytes, st.reserved_bytes, dev.live_bytes) == (0, 0, 0)
    finally:
        mm.close()


def test_held_pages_are_shown_everywhere():
    """memory_summary has a line for them; summary_data (the CLI's `gpumem summary --json`)
    and the Dask worker metrics carry held_bytes."""
    pytest.importorskip("distributed")
    from gpumem.dask.plugin import GpumemPlugin
    dev, mm = _held_manager()
    try:
        held = mm.stats().held_bytes
        assert held > 0
        text = mm.memory_summary()
        assert "held (free refused)" in text
        assert summary_data(mm)["held_bytes"] == held
        plugin = GpumemPlugin()
        plugin.manager = mm
        assert plugin._metric(None)["held_bytes"] == held
        assert "held after a refused free" in str(mm.stats())
        mm.empty_cache()
        assert "held (free refused)" not in mm.memory_summary()
    finally:
        mm.close()


@pytest.mark.parametrize("expandable", [True, False], ids=["expandable", "plain"])
@pytest.mark.parametrize("seed", range(4))
def test_random_walk_with_faults_device_holds_what_reserved_says(expandable, seed):
    """300 random steps (allocations of many sizes, frees, trims, cache caps, and faults armed
    and cleared: refused frees, failing allocations at a rate, failing after n calls); after each,
    the device's live bytes equal reserved_bytes and every pool invariant holds."""
    rng = random.Random(seed)
    dev = gpumem_sim.SimDevice("512MiB", seed=seed)
    mm = MemoryManager(dev, MemoryConfig(**config_over(QUIET, {"expandable_segments": expandable})))
    assert (mm.expandable_segments is not None) == expandable
    live = []
    saw_held = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # refused frees warn, by design
            for step in range(300):
                op = rng.random()
                if op < 0.45:
                    size = rng.choice([rng.randrange(1, 64 << 10), rng.randrange(1, 2 * MiB),
                                       rng.randrange(MiB, 48 * MiB)])
                    try:
                        live.append(mm.malloc(size))
                    except OutOfMemoryError:
                        pass
                elif op < 0.75 and live:
                    live.pop(rng.randrange(len(live))).free()
                elif op < 0.82:
                    mm.empty_cache()
                elif op < 0.86:
                    mm.shrink(rng.randrange(0, 64 * MiB))
                elif op < 0.89:
                    mm.set_max_pool_size(rng.choice([None, 16 * MiB, 128 * MiB]))
                elif op < 0.94:
                    dev.inject(fail_free=rng.choice([True, 1, 2, 5]))
                elif op < 0.97:
                    dev.inject(fail_rate=rng.choice([0.1, 0.5]), fail_after=rng.choice(
                        [None, rng.randrange(0, 8)]))
                else:
                    dev.clear_faults()
                st = mm.stats()
                saw_held |= st.held_bytes > 0
                assert dev.live_bytes == st.reserved_bytes, (
                    f"step {step}: the device holds {dev.live_bytes} bytes, reserved_bytes "
                    f"says {st.reserved_bytes} (held {st.held_bytes})")
                check(mm, live)
        dev.clear_faults()
        for b in live:
            b.free()
        mm.empty_cache()
        assert dev.live_bytes == mm.stats().reserved_bytes == 0
        if expandable and seed == 0:
            assert saw_held, "the walk never made the driver refuse a page: it proves little"
    finally:
        mm.close()
