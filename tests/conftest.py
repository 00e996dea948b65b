"""Shared fixtures: simulated devices, managers on them, and managers on every selected backend.

- ``sim_device(capacity="4GiB", count=1, **SimDevice kwargs)`` installs fresh SimDevice(s) as
  ``sim:0``.. and restores the registry afterwards. pytest-xdist runs each worker in its own
  process, and the registry is per process, so this is safe under ``-n``.
- ``make_manager(device="sim:0", config=None, **config changes)`` builds MemoryManagers (closed
  at teardown) with a permissive config (``PERMISSIVE``): the whole device, nothing held back,
  no CPU fallback (so an out-of-memory is an error a test can see), no tracking.
- ``manager``: ``make_manager()`` on a fresh 4 GiB host-backed sim device.
- ``backend_manager``: the same test on each backend of ``GPUMEM_TEST_BACKENDS`` (comma list
  among sim, cpu, opencl, cuda); unset: all four, each unavailable one skipped with its reason.
- ``clean_registry``: no simulated devices and no GPUMEM_SIM_DEVICES during the test.
- ``fallback``: ``(manager, held, fb)``: a 64 MiB sim device whose manager (CPU fallback on)
  holds 48 MiB in ``held`` and served ``fb`` (32 MiB) from host memory; closed afterwards.
- ``fake``: the helpers of tests/fake_cuda when this process's cuda backend runs on that fake
  driver (ci/test.sh's fake-driver passes); skips elsewhere.

Plain helpers (backend selection, ``sim_manager``) are in invariants.py.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # `import invariants` from any test module

import gpumem_sim  # noqa: E402
from gpumem import MemoryConfig, MemoryManager  # noqa: E402
from invariants import (TEST_SEGMENTS, config_over, device_string, libcuda_is_fake,  # noqa: E402
                        require_backend, selected_backends)

#: A config that uses the whole device and makes out-of-memory visible (with the segment policy
#: of invariants.TEST_SEGMENTS).
PERMISSIVE = dict(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False,
                  track_allocations=False, segments=TEST_SEGMENTS)


def permissive_config(**changes) -> MemoryConfig:
    return MemoryConfig(**config_over(PERMISSIVE, changes))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes several seconds (compiles or runs long)")
    config.addinivalue_line("markers", "handle_size(n): MemoryConfig(expandable_handle_size=n) "
                            "for the vm fixture (tests/vm_managers.py)")
    if os.environ.get("GPUMEM_TEST_INSTALLED") == "1":
        require_installed_gpumem()


def require_installed_gpumem() -> None:
    """GPUMEM_TEST_INSTALLED=1 (ci/package.sh): the gpumem under test must be the one installed
    in this interpreter's site-packages (from a wheel), not a checkout found on sys.path, or the
    run would prove nothing about the package; stop the session before any test otherwise."""
    import sysconfig
    from pathlib import Path

    import gpumem._core.pool
    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    for module in (gpumem_sim, gpumem._core.pool, sys.modules["gpumem"]):
        where = Path(module.__file__).resolve()
        if not any(where.is_relative_to(s) for s in site):
            raise pytest.UsageError(
                f"GPUMEM_TEST_INSTALLED=1 but {module.__name__} comes from {where}, not from "
                f"site-packages ({', '.join(map(str, sorted(site)))})")


class SimFactory:
    """``factory(capacity="4GiB", count=1, **kwargs)`` installs ``count`` fresh SimDevices (same
    kwargs) as sim:0.. and returns the device (or a tuple when count > 1). Each call replaces
    the devices installed by the previous one; ``devices`` holds the last ones."""

    def __init__(self) -> None:
        self.devices: tuple[gpumem_sim.SimDevice, ...] | None = None

    def __call__(self, capacity="4GiB", *, count: int = 1, **kwargs):
        devs = tuple(gpumem_sim.SimDevice(capacity, **kwargs) for _ in range(count))
        gpumem_sim.install(*devs)
        self.devices = devs
        return devs[0] if count == 1 else devs


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch):
    """No simulated devices and no GPUMEM_SIM_DEVICES during the test (the module installs its
    own); the registry is emptied again afterwards."""
    monkeypatch.delenv(gpumem_sim.ENV_VAR, raising=False)
    gpumem_sim.uninstall()
    yield
    gpumem_sim.uninstall()


@pytest.fixture
def sim_device():
    """A SimFactory; the registry (and GPUMEM_SIM_DEVICES) is restored afterwards."""
    saved_env = os.environ.pop(gpumem_sim.ENV_VAR, None)
    gpumem_sim.uninstall()
    yield SimFactory()
    gpumem_sim.uninstall()
    if saved_env is not None:
        os.environ[gpumem_sim.ENV_VAR] = saved_env


@pytest.fixture
def make_manager(sim_device):
    """Factory: ``make_manager(device="sim:0", config=None, **config_changes)``; the managers are
    closed at teardown. For a sim device, a 4 GiB host-backed SimDevice is installed first
    unless the test installed its own with ``sim_device(...)``."""
    made: list[MemoryManager] = []

    def make(device="sim:0", config: MemoryConfig | None = None, **changes) -> MemoryManager:
        if isinstance(device, str) and device.startswith("sim") and sim_device.devices is None:
            sim_device("4GiB", back_memory=True)
        if config is None:
            config = permissive_config(**changes)
        elif changes:
            config = config.replace(**changes)
        mm = MemoryManager(device, config)
        made.append(mm)
        return mm

    yield make
    for mm in made:
        mm.close()


@pytest.fixture
def manager(make_manager) -> MemoryManager:
    return make_manager()


@pytest.fixture
def fallback(sim_device):
    sim_device("64MiB", back_memory=True)
    mm = MemoryManager("sim:0", MemoryConfig(cpu_fallback_enabled=True, min_free_bytes=0,
                                             gpu_memory_fraction=1.0))
    try:
        held = mm.malloc(48 << 20)
        fb = mm.malloc(32 << 20)                             # does not fit: host memory
        yield mm, held, fb
    finally:
        mm.close()


@pytest.fixture
def fake():
    """The fake's helpers when this process's cuda backend runs on it; else skip."""
    import fake_cuda
    from gpumem.backends import cuda as cuda_mod
    if "cuda" not in selected_backends(()):
        pytest.skip("GPUMEM_TEST_BACKENDS does not name cuda")
    ok, reason = cuda_mod.BACKEND.availability()
    if not ok:
        pytest.skip(f"backend 'cuda' unavailable: {reason}")
    if not libcuda_is_fake():
        pytest.skip("a real NVIDIA driver is loaded, not the fake")
    return fake_cuda.helpers()


# unknown names are kept: require_backend fails them loudly (a typo must not pass silently)
@pytest.fixture(params=selected_backends(keep_unknown=True))
def backend_name(request) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture
def backend_manager(backend_name, sim_device):
    """A permissive MemoryManager on device 0 of each selected backend (sim: a 2 GiB
    host-backed SimDevice)."""
    if backend_name == "sim":
        sim_device("2GiB", back_memory=True)
    mm = MemoryManager(device_string(backend_name), permissive_config())
    yield mm
    mm.close()
