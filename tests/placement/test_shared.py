"""Process-wide shared managers (gpumem.get_manager / configure), the default device, and the
cross-manager OOM rung (gpumem.placement.peers).

Level: **real** (the real Cython pool and MemoryManager on gpumem_sim devices, real threads),
except ``test_default_device_is_cuda_when_present``: **fake driver** (it runs in ci/test.sh's
second pass, on tests/fake_cuda under the real cuda-python, and skips elsewhere).
"""
from __future__ import annotations

import gc
import threading
import time

import pytest

import gpumem
import gpumem_sim
from gpumem import MemoryConfig, MemoryManager, configure, get_manager
from gpumem.backends import DEVICE_ENV_VAR, default_device, get_backend
from gpumem.errors import InvalidDeviceError, InvalidInputError, OutOfMemoryError
from gpumem.placement.peers import peers_of
from gpumem.placement.shared import close_shared_managers, shared_managers
from gpumem.units import MiB
from gpumem_sim import SimDevice
from invariants import require_backend, selected_backends

#: the whole device, no CPU fallback: an out-of-memory is an error the test can see
EXACT = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False,
                     track_allocations=False)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, clean_registry):
    """No shared manager, no GPUMEM_DEVICE and no simulated device before or after each test."""
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    close_shared_managers()
    yield
    close_shared_managers()


def _accelerator_present() -> bool:
    cuda = get_backend("cuda")
    if cuda.availability()[0] and cuda.device_count():
        return True
    cl = get_backend("opencl")
    if not cl.availability()[0]:
        return False
    return any("GPU" in str(cl.open(i).properties().extra.get("device_type", "")).upper()
               for i in range(cl.device_count()))


# --- get_manager --------------------------------------------------------------------------------
def test_one_shared_manager_per_device_in_any_spelling():
    a, b = gpumem_sim.install(SimDevice("256MiB"), SimDevice("256MiB"))
    mm = get_manager("sim:0")
    assert get_manager(" SIM : 0 ") is mm and get_manager("sim") is mm
    assert get_manager("sim") is mm                   # again, through the fast path
    assert mm.device is a and get_manager("sim:1").device is b
    assert get_manager("sim:1") is not mm
    assert set(shared_managers()) == {"sim:0", "sim:1"}


def test_two_threads_asking_at_once_get_the_same_manager(monkeypatch):
    """A slow constructor widens the race: without the registry's lock every thread would build
    its own manager."""
    gpumem_sim.install(SimDevice("256MiB"))
    made = []

    class SlowManager(MemoryManager):
        def __init__(self, *args, **kwargs):
            made.append(self)
            time.sleep(0.05)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gpumem.placement.shared, "MemoryManager", SlowManager)
    start = threading.Barrier(8)
    got = []

    def ask():
        start.wait()
        got.append(get_manager("sim:0"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(got) == 8 and all(m is made[0] for m in got)


def test_shared_manager_reads_the_environment(monkeypatch):
    gpumem_sim.install(SimDevice("256MiB"))
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "0.5")
    mm = get_manager("sim:0")
    assert mm.config.gpu_memory_fraction == 0.5
    assert mm.usable_memory <= 128 * MiB


def test_a_closed_shared_manager_is_replaced():
    gpumem_sim.install(SimDevice("256MiB"))
    old = get_manager("sim:0")
    old.close()
    new = get_manager("sim:0")
    assert new is not old and not new.closed


def test_sim_size_string_is_one_private_device_per_shared_manager():
    """Device strings mean the same in the API as in the CLI: "sim:80GiB" is a private device."""
    mm = get_manager("sim:80GiB")
    assert mm.total_memory == 80 << 30 and mm.device_string == "sim:80GiB"
    assert get_manager("sim: 80 GiB") is mm
    assert gpumem_sim.installed() == ()


@pytest.mark.parametrize("bad", [0, 1.5, b"sim:0", ["sim:0"]])
def test_get_manager_rejects_a_non_string_device(bad):
    with pytest.raises(InvalidInputError, match="device must be a device string"):
        get_manager(bad)
    assert shared_managers() == {}


def test_get_manager_rejects_unknown_devices():
    with pytest.raises(InvalidDeviceError, match="unknown device"):
        get_manager("tpu:0")
    with pytest.raises(InvalidDeviceError, match="cpu:1"):
        get_manager("cpu:1")                             # as MemoryManager("cpu:1") does
    with pytest.raises(InvalidDeviceError, match="sim:3"):
        get_manager("sim:3")
    assert shared_managers() == {}


# --- the default device ----------------------------------------------------------------------
def test_default_device_comes_from_the_environment(monkeypatch):
    gpumem_sim.install(SimDevice("256MiB"), SimDevice("128MiB"))
    monkeypatch.setenv(DEVICE_ENV_VAR, " SIM:1 ")
    assert default_device() == "sim:1"
    assert get_manager() is get_manager("sim:1")
    assert MemoryManager(config=EXACT).device is gpumem_sim.installed()[1]
    monkeypatch.setenv(DEVICE_ENV_VAR, "tpu:0")
    assert get_manager() is get_manager("sim:1")      # the default is resolved once...
    close_shared_managers()                           # ...until the registry is reset
    with pytest.raises(InvalidDeviceError, match=DEVICE_ENV_VAR):
        get_manager()
    with pytest.raises(InvalidDeviceError, match=DEVICE_ENV_VAR):
        MemoryManager()                               # a direct manager reads it every time


def test_without_an_accelerator_the_default_is_an_installed_sim_device_only():
    """Issue 15 item 2: no accelerator and no installed sim device -> a clear error listing the
    devices, never the demo sim device; once installed, sim:0 is the default."""
    if _accelerator_present():
        pytest.skip("a CUDA device or an OpenCL GPU is present: it is the default here")
    for make in (get_manager, MemoryManager):
        with pytest.raises(InvalidDeviceError, match="no default device") as info:
            make()
        assert "GPUMEM_SIM_DEVICES" in str(info.value) and "cpu" in str(info.value)
    (dev,) = gpumem_sim.install(SimDevice("256MiB"))
    assert default_device() == "sim:0" and get_manager().device is dev
    assert MemoryManager().device is dev


def test_default_placement_never_uses_an_uninstalled_sim_device():
    """MultiDeviceManager() and select_backend_for_model(devices=None) see real devices only,
    and sim devices once installed."""
    try:
        multi = gpumem.MultiDeviceManager(config=EXACT)
    except InvalidDeviceError:
        multi = None                                  # no real device at all here
    if multi is not None:
        assert not any(m.device.backend == "sim" for m in multi.managers)
        multi.close()
    try:
        assert gpumem.select_backend_for_model(MiB, config=EXACT)[0] != "sim"
    except InvalidDeviceError:
        pass
    (dev,) = gpumem_sim.install(SimDevice("256MiB"))
    with gpumem.MultiDeviceManager(config=EXACT) as multi:
        assert any(m.device is dev for m in multi.managers)


def test_sim_devices_from_the_environment_count_as_installed(monkeypatch):
    if _accelerator_present():
        pytest.skip("a CUDA device or an OpenCL GPU is present: it is the default here")
    monkeypatch.setenv(gpumem_sim.ENV_VAR, "512MiB")
    assert default_device() == "sim:0"
    assert get_manager().total_memory == 512 * MiB


def test_devices_marks_simulated_devices():
    rows = [d for d in gpumem.devices() if d.backend == "sim"]
    assert [(r.available, r.simulated) for r in rows] == [(False, True)]
    gpumem_sim.install(SimDevice("256MiB"))
    rows = [d for d in gpumem.devices() if d.simulated]
    assert [(r.device, r.available) for r in rows] == [("sim:0", True)]
    assert not any(d.simulated for d in gpumem.devices() if d.backend != "sim")


def test_default_device_is_cuda_when_present():
    """Fake driver: with the cuda backend available, get_manager() opens cuda:0."""
    if "cuda" not in selected_backends(default=()):
        pytest.skip("GPUMEM_TEST_BACKENDS does not name cuda")
    require_backend("cuda")
    gpumem_sim.install(SimDevice("256MiB"))          # an installed sim device does not win
    assert default_device() == "cuda:0"
    assert get_manager().device_string == "cuda:0"


# --- configure ---------------------------------------------------------------------------------
def test_configure_replaces_the_shared_manager_with_knobs():
    (dev,) = gpumem_sim.install(SimDevice("4GiB"))
    old = get_manager("sim:0")
    with old.malloc(MiB):
        pass                                             # a cached segment, no live buffer
    assert old.pool.reserved_bytes > 0
    new = configure("sim:0", EXACT, gpu_memory_fraction=0.25, max_pool_size=4 * MiB)
    assert get_manager("sim:0") is new is not old and old.closed
    assert new.config.gpu_memory_fraction == 0.25 and new.config.max_pool_size == 4 * MiB
    assert new.config.cpu_fallback_enabled is False      # the rest from the config given
    assert dev.live_segments == 0                        # the old cache went back to the driver
    fresh = configure("sim:0")                           # no config: MemoryConfig.from_env()
    assert fresh.config == MemoryConfig.from_env() and new.closed
    assert get_manager("SIM:0") is fresh and get_manager("sim") is fresh   # no stale spelling


def test_configure_refuses_while_buffers_are_live_unless_forced():
    gpumem_sim.install(SimDevice("256MiB"))
    old = get_manager("sim:0")
    buf = old.malloc(MiB)
    with pytest.raises(InvalidInputError, match="1 live buffer.*force=True"):
        configure("sim:0", gpu_memory_fraction=0.5)
    assert get_manager("sim:0") is old and not old.closed   # nothing changed
    buf.free()
    buf = old.malloc(MiB)
    new = configure("sim:0", force=True, gpu_memory_fraction=0.5)
    assert old.closed and get_manager("sim:0") is new


@pytest.mark.parametrize("kwargs, match", [
    (dict(config={"gpu_memory_fraction": 0.5}), "config must be a MemoryConfig"),
    (dict(gpu_memory_fractoin=0.5), "unknown MemoryConfig field"),
    (dict(gpu_memory_fraction=7.0), "gpu_memory_fraction"),
    (dict(force="yes"), "force must be True or False"),
])
def test_configure_rejects_bad_input_and_changes_nothing(kwargs, match):
    gpumem_sim.install(SimDevice("256MiB"))
    old = get_manager("sim:0")
    with pytest.raises(InvalidInputError, match=match):
        configure("sim:0", **kwargs)
    assert get_manager("sim:0") is old and not old.closed


def test_configure_on_a_device_that_cannot_open_keeps_the_old_manager():
    gpumem_sim.install(SimDevice("256MiB"))
    old = get_manager("sim:0")
    gpumem_sim.install()                                 # sim:0 no longer exists
    with pytest.raises(InvalidDeviceError):
        configure("sim:0")
    assert shared_managers() == {"sim:0": old} and not old.closed


# --- peers: the cross-manager OOM rung ---------------------------------------------------------
def _cached(mm: MemoryManager, nbytes: int) -> None:
    mm.malloc(nbytes).free()
    assert mm.pool.reserved_bytes >= nbytes and mm.pool.in_use_bytes == 0


def test_oom_asks_other_managers_on_the_device_to_release_their_cache():
    """Two managers on one 64 MiB sim device: A caches 40 MiB, B needs 40 MiB. Without the
    rung B would fail (no CPU fallback); with it A gives its cache back and B's growth works."""
    (dev,) = gpumem_sim.install(SimDevice("64MiB"))
    a = MemoryManager("sim:0", EXACT)
    b = get_manager("sim:0")                      # shared and direct managers are peers alike
    b = configure("sim:0", EXACT)
    _cached(a, 40 * MiB)
    assert peers_of(b) == [a] and peers_of(a) == [b]
    with b.malloc(40 * MiB) as buf:
        assert buf.nbytes == 40 * MiB
        assert a.pool.reserved_bytes == 0 and a.stats().segments_released >= 1
        assert dev.live_bytes == b.pool.reserved_bytes
    a.close()


def test_managers_on_other_devices_are_not_asked():
    d0, d1 = gpumem_sim.install(SimDevice("64MiB"), SimDevice("64MiB"))
    a = MemoryManager("sim:0", EXACT)
    b = MemoryManager("sim:1", EXACT)
    _cached(a, 40 * MiB)
    d1_used = b.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError):
        b.malloc(40 * MiB)
    assert a.pool.reserved_bytes >= 40 * MiB and peers_of(b) == []
    d1_used.free()
    a.close()
    b.close()


def test_a_busy_peer_is_skipped_not_waited_for():
    """A peer whose slow path is held by another thread is skipped: the OOM comes at once (no
    deadlock when two managers run out together) and the peer keeps its cache."""
    gpumem_sim.install(SimDevice("64MiB"))
    a = MemoryManager("sim:0", EXACT)
    b = MemoryManager("sim:0", EXACT)
    _cached(a, 40 * MiB)
    held, done = threading.Event(), threading.Event()

    def hold():
        with a._slow:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(5)
        with pytest.raises(OutOfMemoryError):
            b.malloc(40 * MiB)
        assert a.pool.reserved_bytes >= 40 * MiB
    finally:
        done.set()
        t.join()
    with b.malloc(40 * MiB):                      # free again: now A is asked and releases
        assert a.pool.reserved_bytes == 0
    a.close()
    b.close()


def test_peers_are_weak_and_closed_ones_are_ignored():
    gpumem_sim.install(SimDevice("64MiB"))
    a = MemoryManager("sim:0", EXACT)
    b = MemoryManager("sim:0", EXACT)
    c = MemoryManager("sim:0", EXACT)
    assert peers_of(a) == [b, c]
    c.close()
    del b
    gc.collect()
    assert peers_of(a) == []
    a.close()


def test_peers_release_on_every_backend(backend_name, sim_device):
    """The peer rung through each backend's own free-memory figure. Level: **real** on sim and
    PoCL (opencl counts the bytes this process holds), **fake driver** on cuda (cuMemGetInfo of
    tests/fake_cuda). B may only grow while ``min_free_bytes`` stays free, which holds only once
    A has given its 64 MiB cache back. cpu is left out: the OS's free memory moves with other
    processes by more than the margin."""
    if backend_name == "cpu":
        pytest.skip("host free memory moves with other processes: no exact margin")
    if backend_name == "sim":
        sim_device("1GiB")
    device = "sim:0" if backend_name == "sim" else f"{backend_name}:0"
    a = MemoryManager(device, EXACT)
    try:
        _cached(a, 64 * MiB)
        free, _ = a.memory_info()
        b = MemoryManager(device, EXACT.replace(min_free_bytes=free - 32 * MiB))
        try:
            assert a in peers_of(b)
            with b.malloc(64 * MiB) as buf:            # needs A's cache back at the driver
                assert buf.nbytes == 64 * MiB and a.pool.reserved_bytes == 0
        finally:
            b.close()
    finally:
        a.close()


def test_canonical_device_strings():
    """One spelling per device, so get_manager shares one manager across spellings (real)."""
    from gpumem.backends import canonical_device
    assert [canonical_device(d) for d in ("cpu", "CPU:0", "sim", " Sim : 2 ", "sim:1.5 GiB",
                                          "OpenCL:0")] == [
        "cpu", "cpu", "sim:0", "sim:2", "sim:1.5GiB", "opencl:0"]
    for bad in ("sim:lots", "cuda:-1", "gpu:0", 3):
        with pytest.raises(InvalidDeviceError):
            canonical_device(bad)
