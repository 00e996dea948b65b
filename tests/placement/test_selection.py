"""select_backend_for_model: the device with the most room that can hold a model.

Room on a device is what a fresh MemoryManager with the same config could hold there:
``min(usable, free - min_free_bytes)`` with ``usable = min(total * fraction, total - reserve)``.
"""
from __future__ import annotations

import numpy as np
import pytest

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import InvalidDeviceError, InvalidInputError, OutOfMemoryError
from gpumem.planning.estimate import MemoryEstimate, estimate_model
from gpumem.placement.selection import DeviceRoom, device_room, select_backend_for_model
from gpumem.units import format_bytes
from gpumem_sim import SimDevice

MiB = 1 << 20
GiB = 1 << 30
CFG = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0, reserve_bytes=0)
SIMS = ["sim:0", "sim:1", "sim:2"]


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


@pytest.fixture
def sims():
    return gpumem_sim.install(SimDevice(2 * GiB), SimDevice(8 * GiB), SimDevice(4 * GiB))


def test_most_room_wins(sims):
    assert select_backend_for_model(GiB, config=CFG, devices=SIMS) == ("sim", 1)
    assert select_backend_for_model(0, config=CFG, devices=SIMS) == ("sim", 1)


def test_only_devices_that_fit(sims):
    assert select_backend_for_model(3 * GiB, config=CFG, devices=["sim:0", "sim:2"]) == ("sim", 2)
    assert select_backend_for_model(2 * GiB, config=CFG, devices=["sim:0"]) == ("sim", 0)


def test_free_memory_from_the_driver_counts(sims):
    sims[1].set_other_process_bytes(7 * GiB)            # 1 GiB free on the biggest device
    assert select_backend_for_model(GiB, config=CFG, devices=SIMS) == ("sim", 2)
    sims[2].set_other_process_bytes(3 * GiB + 512 * MiB)
    assert select_backend_for_model(GiB, config=CFG, devices=SIMS) == ("sim", 0)


def test_min_free_bytes(sims):
    cfg = CFG.with_min_free_bytes("5GiB")
    # room: sim:0 0, sim:1 3 GiB, sim:2 0
    assert select_backend_for_model(3 * GiB, config=cfg, devices=SIMS) == ("sim", 1)
    with pytest.raises(OutOfMemoryError):
        select_backend_for_model(3 * GiB + 1, config=cfg, devices=SIMS)


def test_fraction_and_reserve(sims):
    cfg = CFG.with_gpu_memory_fraction(0.5)             # usable 1, 4, 2 GiB
    assert select_backend_for_model(4 * GiB, config=cfg, devices=SIMS) == ("sim", 1)
    with pytest.raises(OutOfMemoryError):
        select_backend_for_model(4 * GiB + 1, config=cfg, devices=SIMS)
    cfg = CFG.with_reserve_bytes("7GiB")                # usable 0, 1, 0 GiB
    assert select_backend_for_model(GiB, config=cfg, devices=SIMS) == ("sim", 1)
    with pytest.raises(OutOfMemoryError):
        select_backend_for_model(GiB + 1, config=cfg, devices=SIMS)


def test_room_matches_memory_manager(sims):
    cfg = MemoryConfig(min_free_bytes=256 * MiB, gpu_memory_fraction=0.8, reserve_bytes=GiB)
    for d in SIMS:
        room = device_room(d, cfg)
        assert isinstance(room, DeviceRoom)
        assert room.usable == MemoryManager(d, cfg).usable_memory
        assert room.room == min(room.usable, room.free - cfg.min_free_bytes)


def test_chosen_device_can_hold_the_request(sims):
    cfg = CFG.with_min_free_bytes("1GiB")
    need = 6 * GiB
    backend, index = select_backend_for_model(need, config=cfg, devices=SIMS)
    mm = MemoryManager(f"{backend}:{index}", cfg.with_cpu_fallback(False))
    assert mm.malloc(need).alive


def test_ties_go_to_the_earlier_device():
    gpumem_sim.install(SimDevice(4 * GiB), SimDevice(4 * GiB))
    assert select_backend_for_model(GiB, config=CFG, devices=["sim:1", "sim:0"]) == ("sim", 1)
    assert select_backend_for_model(GiB, config=CFG, devices=["sim:0", "sim:1"]) == ("sim", 0)


def test_devices_none_considers_every_available_device():
    gpumem_sim.install(SimDevice(GiB), SimDevice(256 * GiB))   # bigger than any real GPU
    assert select_backend_for_model(100 * GiB, config=CFG) == ("sim", 1)


def test_device_objects(sims):
    assert select_backend_for_model(GiB, config=CFG, devices=[sims[0], sims[2]]) == ("sim", 2)
    assert select_backend_for_model(GiB, config=CFG, devices=sims[0]) == ("sim", 0)
    assert select_backend_for_model(GiB, config=CFG, devices="sim:2") == ("sim", 2)


def test_memory_estimate():
    gpumem_sim.install(SimDevice(8 * GiB), SimDevice(16 * GiB), SimDevice(24 * GiB))
    est = estimate_model("llama-2-7b", seq_len=2048)    # ~13.9 GiB in float16
    assert isinstance(est, MemoryEstimate) and 8 * GiB < est.total_bytes < 16 * GiB
    assert select_backend_for_model(est, config=CFG, devices=["sim:0", "sim:1"]) == ("sim", 1)
    assert select_backend_for_model(est, config=CFG, devices=SIMS) == ("sim", 2)
    with pytest.raises(OutOfMemoryError):
        select_backend_for_model(est, config=CFG, devices=["sim:0"])
    small = estimate_model("gpt2", seq_len=128)
    assert select_backend_for_model(small, config=CFG, devices=["sim:0"]) == ("sim", 0)


def test_error_lists_every_device_and_its_free_memory(sims):
    sims[2].set_other_process_bytes(GiB)
    with pytest.raises(OutOfMemoryError) as info:
        select_backend_for_model(9 * GiB, config=CFG, devices=SIMS)
    e = info.value
    text = str(e)
    assert e.requested == 9 * GiB
    for d, free in (("sim:0", 2 * GiB), ("sim:1", 8 * GiB), ("sim:2", 3 * GiB)):
        assert f"{d}: free {format_bytes(free)}" in text
    assert e.limit == 8 * GiB                            # the largest room
    assert "no device can hold" in e.reason


@pytest.mark.parametrize("bad", [-1, True, False, 1.5, "1GiB", None, [1]])
def test_bad_sizes(sims, bad):
    with pytest.raises(InvalidInputError, match="total_bytes"):
        select_backend_for_model(bad, config=CFG, devices=SIMS)


def test_numpy_integer_size(sims):
    assert select_backend_for_model(np.int64(GiB), config=CFG, devices=SIMS) == ("sim", 1)


def test_bad_devices_and_config(sims):
    with pytest.raises(InvalidDeviceError):
        select_backend_for_model(GiB, config=CFG, devices=[])
    with pytest.raises(InvalidDeviceError):
        select_backend_for_model(GiB, config=CFG, devices=["sim:7"])
    with pytest.raises(InvalidInputError, match=r"devices\[1\]"):
        select_backend_for_model(GiB, config=CFG, devices=["sim:0", 3])
    with pytest.raises(InvalidInputError, match="config"):
        select_backend_for_model(GiB, config={"min_free_bytes": 0}, devices=SIMS)


def test_selection_allocates_nothing(sims):
    select_backend_for_model(GiB, config=CFG, devices=SIMS)
    assert all(d.alloc_calls == 0 and d.live_bytes == 0 for d in sims)


def _pocl_or_skip() -> str:
    from gpumem.backends import get_backend, holds_host_memory, open_device
    ok, reason = get_backend("opencl").availability()
    if not ok:
        pytest.skip(f"opencl unavailable: {reason}")
    if not holds_host_memory(open_device("opencl:0")):
        pytest.skip("opencl:0 is not a CPU-type device (PoCL)")
    return "opencl:0"


def test_accelerators_rank_before_a_cpu_opencl_device():
    """Issue 10 item 4 (real, PoCL): with PoCL present, a 600 MiB model on sim:0 (1 GiB) and
    sim:1 (256 MiB) goes to sim:0, not to the CPU-type OpenCL device with more room."""
    pocl = _pocl_or_skip()
    gpumem_sim.install(SimDevice(GiB), SimDevice(256 * MiB))
    from gpumem.backends import get_backend
    got = select_backend_for_model(600 * MiB, config=CFG)
    if get_backend("cuda").availability()[0]:      # the fake-driver pass: a cuda device competes
        assert got[0] in ("cuda", "sim")
    else:
        assert got == ("sim", 0)
    # devices named: a CUDA device (ci/test.sh's fake-driver run, or a GPU) would rank first
    assert select_backend_for_model(600 * MiB, config=CFG,
                                    devices=[pocl, "sim:0", "sim:1"]) == ("sim", 0)
    assert select_backend_for_model(100 * MiB, config=CFG, devices=[pocl, "sim:1"]) == ("sim", 1)
    # host memory is still chosen when no accelerator can hold the model
    assert select_backend_for_model(512 * MiB, config=CFG, devices=[pocl, "sim:1"]) == ("opencl", 0)
    assert device_room(pocl, CFG).host_memory and not device_room("sim:0", CFG).host_memory


def test_devices_none_never_picks_an_uninstalled_sim_device():
    """Issue 15 item 2 (real): with no sim device installed, automatic placement sees real
    devices only (here PoCL, if present)."""
    try:
        backend, _ = select_backend_for_model(MiB, config=CFG)
    except InvalidDeviceError as exc:
        assert "no cuda, opencl or sim device" in str(exc)
    else:
        assert backend != "sim"
