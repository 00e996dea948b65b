"""MultiDeviceManager: placement policies, name affinity, routing, aggregate statistics, errors.

Three simulated devices of different sizes (1 GiB, 2 GiB, 512 MiB) with exact usable memory
(no reserve, no min free). One test also mixes in a real backend named in
``GPUMEM_TEST_BACKENDS`` (by default only ``sim`` runs).
"""
from __future__ import annotations

import threading

import pytest

import gpumem_sim
from gpumem import Buffer, FallbackBuffer, MemoryConfig, MemoryManager
from gpumem.errors import (ClosedManagerError, ForeignBufferError, InvalidDeviceError,
                           InvalidInputError, OutOfMemoryError)
from gpumem.placement.multi import POLICIES, MultiDeviceManager
from gpumem_sim import SimDevice
from invariants import device_string, require_backend, selected_backends

MiB = 1 << 20
GiB = 1 << 30
CFG = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0, reserve_bytes=0,
                   cpu_fallback_enabled=False)
DEVICES = ["sim:0", "sim:1", "sim:2"]


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


@pytest.fixture
def sims() -> tuple[SimDevice, ...]:
    return gpumem_sim.install(SimDevice(GiB), SimDevice(2 * GiB), SimDevice(512 * MiB))


def where(buf) -> str:
    return buf.manager.device_string if isinstance(buf, Buffer) else buf._manager.device_string


# --- policies ------------------------------------------------------------------------------------
def test_most_free_picks_most_usable_minus_in_use(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        a = multi.allocate_on_best_device(1536 * MiB)
        assert where(a) == "sim:1"                       # 2 GiB free
        b = multi.allocate_on_best_device(100 * MiB)
        assert where(b) == "sim:0"                       # 1 GiB vs 512 MiB vs 512 MiB: first
        a.free()                                         # cached bytes count as free
        c = multi.allocate_on_best_device(100 * MiB)
        assert where(c) == "sim:1"


def test_most_free_reads_counters_not_the_driver(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        multi.manager("sim:1").malloc(GiB).free()         # cached on the most free device
        info_calls = [d.mem_get_info_calls for d in sims]
        alloc_calls = [d.alloc_calls for d in sims]
        bufs = [multi.allocate_on_best_device(32 * MiB) for _ in range(3)]
        assert [d.mem_get_info_calls for d in sims] == info_calls
        assert [d.alloc_calls for d in sims] == alloc_calls
        assert len(bufs) == 3


def test_round_robin(sims):
    with MultiDeviceManager(DEVICES, CFG, policy="round_robin") as multi:
        got = [where(multi.allocate_on_best_device(MiB)) for _ in range(7)]
        assert got == DEVICES * 2 + ["sim:0"]


def test_least_pressure(sims):
    with MultiDeviceManager(DEVICES, CFG, policy="least_pressure") as multi:
        multi.manager("sim:1").malloc(1536 * MiB).free()   # 75 % reserved (cached)
        multi.manager("sim:0").malloc(256 * MiB).free()    # 25 %
        b = multi.allocate_on_best_device(MiB)
        assert where(b) == "sim:2"                          # 0 %
        multi.manager("sim:2").malloc(400 * MiB).free()    # 78 %
        assert where(multi.allocate_on_best_device(MiB)) == "sim:0"


def test_callable_policy(sims):
    seen = []

    def last(managers, nbytes):
        seen.append(([m.device_string for m in managers], nbytes))
        return len(managers) - 1

    with MultiDeviceManager(DEVICES, CFG, policy=last) as multi:
        assert where(multi.allocate_on_best_device(5 * MiB)) == "sim:2"
        assert seen == [(DEVICES, 5 * MiB)]
        assert multi.policy is last


@pytest.mark.parametrize("bad", [3, -1, "0", None, True, 1.0])
def test_callable_policy_bad_index(sims, bad):
    with MultiDeviceManager(DEVICES, CFG, policy=lambda ms, n: bad) as multi:
        with pytest.raises(InvalidInputError, match="index"):
            multi.allocate_on_best_device(MiB, name="x")
        assert multi.affinity("x") is None
        assert all(d.alloc_calls == 0 for d in sims)


def test_unknown_policy_lists_policies(sims):
    with pytest.raises(InvalidInputError) as info:
        MultiDeviceManager(DEVICES, CFG, policy="fastest")
    for name in POLICIES:
        assert name in str(info.value)
    with pytest.raises(InvalidInputError):
        MultiDeviceManager(DEVICES, CFG, policy=42)
    assert all(d.alloc_calls == 0 and d.mem_get_info_calls == 0 for d in sims)


def test_set_policy(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        multi.set_policy("round_robin")
        assert [where(multi.allocate_on_best_device(MiB)) for _ in range(3)] == DEVICES
        with pytest.raises(InvalidInputError):
            multi.set_policy("nope")
        assert multi.policy == "round_robin"


# --- affinity -------------------------------------------------------------------------------------
def test_affinity_pins_a_name_to_its_first_device(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        w = multi.allocate_on_best_device(1536 * MiB, name="layer0")
        assert where(w) == "sim:1" and multi.affinity("layer0") == "sim:1"
        # sim:1 now has the least room, but layer0 stays there
        kv = multi.allocate_on_best_device(100 * MiB, name="layer0")
        assert where(kv) == "sim:1"
        other = multi.allocate_on_best_device(100 * MiB, name="layer1")
        assert where(other) == "sim:0" and multi.affinity("layer1") == "sim:0"
        assert multi.unpin("layer0") and not multi.unpin("layer0")
        assert where(multi.allocate_on_best_device(MiB, name="layer0")) == "sim:0"


def test_explicit_pin(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        multi.pin("emb", "sim:2")
        assert where(multi.allocate_on_best_device(MiB, name="emb")) == "sim:2"
        multi.pin("emb", 0)
        assert where(multi.allocate_on_best_device(MiB, name="emb")) == "sim:0"
        with pytest.raises(InvalidDeviceError):
            multi.pin("emb", "sim:9")


def test_affinity_to_closed_device_is_an_error_and_changes_nothing(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        multi.allocate_on_best_device(MiB, name="a")          # sim:1
        multi.manager("sim:1").close()
        before = {d: s for d, s in multi.stats().items() if d != "sim:1"}
        with pytest.raises(ClosedManagerError, match="sim:1"):
            multi.allocate_on_best_device(MiB, name="a")
        assert multi.affinity("a") == "sim:1"                 # the pin stays until unpin
        assert {d: s for d, s in multi.stats().items() if d != "sim:1"} == before
        # unnamed (and new) names go to the open devices
        b = multi.allocate_on_best_device(MiB, name="b")
        assert where(b) == "sim:0"
        multi.unpin("a")
        assert where(multi.allocate_on_best_device(MiB, name="a")) == "sim:0"
        with pytest.raises(ClosedManagerError):
            multi.pin("c", "sim:1")


def test_failed_allocation_does_not_pin(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        with pytest.raises(OutOfMemoryError):
            multi.allocate_on_best_device(3 * GiB, name="huge")
        assert multi.affinity("huge") is None
        sims[1].inject(fail_after=0)                            # the most free device fails
        with pytest.raises(OutOfMemoryError):
            multi.allocate_on_best_device(100 * MiB, name="x")
        assert multi.affinity("x") is None
        assert all(m.stats().active_buffers == 0 for m in multi.managers)
        sims[1].clear_faults()
        assert where(multi.allocate_on_best_device(100 * MiB, name="x")) == "sim:1"


def test_fallback_under_faults_is_pinned_to_its_device(sims):
    cfg = CFG.with_cpu_fallback(True)
    with MultiDeviceManager(DEVICES, cfg) as multi:
        sims[1].inject(fail_after=0)
        fb = multi.allocate_on_best_device(100 * MiB, name="x")
        assert isinstance(fb, FallbackBuffer) and where(fb) == "sim:1"
        assert multi.affinity("x") == "sim:1"
        assert multi.stats()["sim:1"].cpu_fallbacks == 1
        multi.free(fb)


def test_bad_sizes_change_nothing(sims):
    with MultiDeviceManager(DEVICES, CFG, policy="round_robin") as multi:
        with pytest.raises(InvalidInputError):
            multi.allocate_on_best_device(-1, name="n")
        with pytest.raises(TypeError):
            multi.allocate_on_best_device(1.5)
        with pytest.raises(TypeError):
            multi.allocate_on_best_device(True)
        assert multi.affinity("n") is None
        assert where(multi.allocate_on_best_device(MiB)) == "sim:0"   # the turn did not move


def test_most_free_fast_path_checks_sizes_like_malloc(sims):
    """The default policy's C fast path (issue 21) reads the size in C; whatever it cannot take
    (negatives, bools, floats, sizes past 2**62 or past a C long long) gets malloc's errors and
    changes nothing: no block, no pin. Level: real (sim)."""
    with MultiDeviceManager(DEVICES, CFG) as multi:
        before = [m.pool.counters()["num_allocs"] for m in multi.managers]
        for bad, error in ((-1, InvalidInputError), (True, TypeError), (1.5, TypeError),
                           (1 << 62, OutOfMemoryError), (1 << 70, OutOfMemoryError),
                           (-(1 << 70), InvalidInputError)):
            with pytest.raises(error):
                multi.allocate_on_best_device(bad)
        assert [m.pool.counters()["num_allocs"] for m in multi.managers] == before
        assert sum(m.stats().active_buffers for m in multi.managers) == 0
        buf = multi.allocate_on_best_device(MiB, tag="t")     # the fast path keeps the tag
        assert where(buf) == "sim:1" and buf.tag == "t" and buf.nbytes == MiB
        multi.free(buf)
        with pytest.raises(ForeignBufferError):
            multi.free(MemoryManager("sim:0", CFG).malloc(MiB))


def test_concurrent_first_use_of_a_name_pins_one_device(sims):
    with MultiDeviceManager(DEVICES, CFG, policy="round_robin") as multi:
        bufs = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def work():
            start.wait()
            b = multi.allocate_on_best_device(MiB, name="shared")
            with lock:
                bufs.append(b)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({where(b) for b in bufs}) == 1
        assert where(bufs[0]) == multi.affinity("shared")
        assert sum(m.stats().active_buffers for m in multi.managers) == 8


# --- construction ---------------------------------------------------------------------------------
def test_empty_device_list(sims):
    with pytest.raises(InvalidInputError, match="empty"):
        MultiDeviceManager([], CFG)
    with pytest.raises(InvalidInputError, match="empty"):
        MultiDeviceManager(iter([]), CFG)


def test_bad_device_entries(sims):
    with pytest.raises(InvalidInputError, match=r"devices\[1\]"):
        MultiDeviceManager(["sim:0", 7], CFG)
    with pytest.raises(InvalidDeviceError):
        MultiDeviceManager(["sim:0", "sim:9"], CFG)
    with pytest.raises(InvalidInputError, match="twice"):
        MultiDeviceManager(["sim:0", "sim:0"], CFG)
    with pytest.raises(InvalidInputError, match="config"):
        MultiDeviceManager(["sim:0"], config={"min_free_bytes": 0})
    assert all(d.alloc_calls == 0 for d in sims)


def test_duplicate_closes_what_was_created(sims):
    borrowed = MemoryManager("sim:1", CFG)
    with pytest.raises(InvalidInputError, match="twice"):
        MultiDeviceManager(["sim:0", borrowed, "sim:1"], CFG)
    assert not borrowed.closed


def test_closed_manager_rejected(sims):
    m = MemoryManager("sim:0", CFG)
    m.close()
    with pytest.raises(ClosedManagerError):
        MultiDeviceManager([m])


def test_devices_none_means_every_gpu_like_device(sims):
    with MultiDeviceManager(None, CFG) as multi:
        assert set(DEVICES) <= set(multi.devices)
        assert "cpu" not in multi.devices
        assert all(d.split(":")[0] in ("cuda", "opencl", "sim") for d in multi.devices)


def test_borrowed_managers_are_left_open(sims):
    mine = MemoryManager("sim:2", CFG)
    multi = MultiDeviceManager(["sim:0", mine], CFG)
    assert multi.manager("sim:2") is mine and multi.manager(1) is mine
    owned = multi.manager("sim:0")
    with multi:
        pass
    assert multi.closed and owned.closed and not mine.closed
    with pytest.raises(ClosedManagerError):
        multi.allocate_on_best_device(MiB)
    with pytest.raises(ClosedManagerError):
        multi.allocate_on_best_device(MiB, name="x")
    multi.close()                                            # idempotent


def test_manager_lookup(sims):
    with MultiDeviceManager(DEVICES, CFG) as multi:
        assert multi.manager("sim:1").device_string == "sim:1"
        assert multi.manager(2).device_string == "sim:2"
        assert [m.device_string for m in multi.managers] == DEVICES
        assert len(multi) == 3 and list(multi) == multi.managers
        for bad in ("sim:7", 5, -1, True, None):
            with pytest.raises(InvalidDeviceError, match="sim:0, sim:1, sim:2"):
                multi.manager(bad)
        assert "MultiDeviceManager" in repr(multi)


# --- routing and statistics -----------------------------------------------------------------------
def test_free_routes_to_the_owner(sims):
    other = MemoryManager("sim:0", CFG)
    with MultiDeviceManager(DEVICES, CFG, policy="round_robin") as multi:
        bufs = [multi.allocate_on_best_device(2 * MiB) for _ in range(3)]
        for b in bufs:
            multi.free(b)
        assert all(not b.alive for b in bufs)
        assert sum(m.stats().active_buffers for m in multi.managers) == 0
        with pytest.raises(ForeignBufferError):
            multi.free(other.malloc(MiB))                    # same device, other manager
        with pytest.raises(TypeError):
            multi.free("buffer")


def test_stats_and_totals(sims):
    with MultiDeviceManager(DEVICES, CFG, policy="round_robin") as multi:
        bufs = [multi.allocate_on_best_device(n * MiB) for n in (20, 40, 60)]
        stats = multi.stats()
        assert list(stats) == DEVICES
        assert [s.in_use_bytes for s in stats.values()] == [20 * MiB, 40 * MiB, 60 * MiB]
        assert multi.total_memory_usage() == (120 * MiB, 120 * MiB)
        bufs[2].free()
        assert multi.total_memory_usage() == (60 * MiB, 120 * MiB)
        assert multi.emergency_cleanup_all() == 60 * MiB
        bufs[0].free()
        assert multi.empty_cache() == 20 * MiB
        assert sum(s.reserved_bytes for s in multi.stats().values()) == 40 * MiB


def test_with_a_real_backend_when_selected(sims):
    real = [n for n in ("cuda", "opencl", "cpu") if n in selected_backends(default=())]
    if not real:
        pytest.skip("no real backend selected by GPUMEM_TEST_BACKENDS")
    name = real[0]
    require_backend(name)
    dev = device_string(name)
    with MultiDeviceManager([dev, "sim:0"], MemoryConfig(min_free_bytes=0),
                            policy="round_robin") as multi:
        a = multi.allocate_on_best_device(MiB, name="w")
        b = multi.allocate_on_best_device(MiB)
        assert where(a) == dev and where(b) == "sim:0"
        assert where(multi.allocate_on_best_device(MiB, name="w")) == dev
        multi.free(a)
        multi.free(b)
        assert set(multi.stats()) == {dev, "sim:0"}
