"""The gpumem pytest plug-in (entry point ``pytest11: gpumem``): simulated GPUs for a user's
test suite, the same tests on real GPUs with ``--gpumem-backend cuda``, driver faults and leak
checks. See :mod:`gpumem.testing` and docs/testing.md.

Off unless asked: the hooks below only add the options and the marker; a test is affected only
when it requests one of the fixtures ``gpumem_devices``, ``gpumem_manager``, ``gpumem_faults``.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, NamedTuple

import pytest

from gpumem.errors import InvalidInputError
from gpumem.testing.devices import (DEFAULT_DEVICES, ENV_VAR, DevicesUnavailable, DeviceSpec,
                                    FaultInjector, GpumemDevices, backend_choices,
                                    check_backend, install_devices, map_to_backend,
                                    parse_device_specs)
from gpumem.testing.leaks import (close_shared_managers_on, leak_report, shared_config_changes,
                                  shared_managers_on)

MARKER_KEYS = ("devices", "faults", "config")


class _Settings(NamedTuple):
    specs: list[DeviceSpec]
    backend: str
    shared: tuple[str, int | float] | None     # (group, budget) the managers join, or None


_SETTINGS = pytest.StashKey[_Settings]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpumem", "gpumem: simulated and real GPUs for tests")
    group.addoption("--gpumem-devices", default=None, metavar="SPECS",
                    help=f"devices each gpumem test gets, e.g. 'sim:16GiB,sim:8GiB' (also "
                         f"${ENV_VAR}; default {DEFAULT_DEVICES})")
    group.addoption("--gpumem-backend", default="sim", metavar="NAME",
                    help=f"run the simulated devices on this backend instead: one of "
                         f"{', '.join(backend_choices())} (default sim)")
    group.addoption("--gpumem-shared-budget", default=None, metavar="BUDGET",
                    help="under pytest-xdist, the workers' gpumem_manager managers join one "
                         "shared group per device with this budget (a fraction of the device "
                         "or a size; 'off' to keep each worker to itself; default 1.0)")
    parser.addini("gpumem_shared_budget", default="",
                  help="--gpumem-shared-budget's value when the option is not given")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpumem(devices=None, faults=None, config=None): the gpumem fixtures' devices "
                   "for this test ('sim:1GiB,sim:512MiB'), driver faults for its first device "
                   "({'fail_after': 2}) and the MemoryConfig of gpumem_manager")
    option = config.getoption("--gpumem-devices")
    text, what = (option, "--gpumem-devices") if option is not None else \
        (os.environ.get(ENV_VAR), ENV_VAR)
    try:
        specs = parse_device_specs(text if text is not None else DEFAULT_DEVICES, what=what)
        backend = check_backend(config.getoption("--gpumem-backend"))
    except InvalidInputError as exc:
        raise pytest.UsageError(str(exc)) from None
    try:
        shared = _shared_group(config)
    except InvalidInputError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_SETTINGS] = _Settings(specs, backend, shared)


def _shared_group(config: pytest.Config) -> tuple[str, int | float] | None:
    """(group, budget) for this xdist worker's managers: one group per test run (xdist's
    ``testrunuid``, the same in every worker), so the workers share a budget on each device
    and hand cached memory to each other; None outside xdist or when turned off."""
    from gpumem.config import parse_shared_budget
    raw = config.getoption("--gpumem-shared-budget")
    what = "--gpumem-shared-budget"
    if raw is None:
        raw, what = config.getini("gpumem_shared_budget") or "1.0", "gpumem_shared_budget (ini)"
    text = str(raw).strip().lower()
    if text in ("off", "none", "no", "0", "false"):
        return None
    try:
        budget = parse_shared_budget(text)
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise InvalidInputError(f"a fraction must be in (0, 1], got {budget}")
    except InvalidInputError as exc:
        raise InvalidInputError(f"{what}={raw!r}: {exc}; give a fraction of the device, a size "
                                f"or 'off'") from None
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None                             # one process: nobody to share with
    from gpumem.manager.group_advice import PLUGIN_GROUP_PREFIX   # the OOM's advice names it
    return f"{PLUGIN_GROUP_PREFIX}{workerinput['testrunuid'][:16]}", budget


def _marker_kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    marker = request.node.get_closest_marker("gpumem")
    if marker is None:
        return {}
    if marker.args:
        raise InvalidInputError(f"@pytest.mark.gpumem takes keyword arguments only "
                                f"({', '.join(MARKER_KEYS)}); got positional {marker.args!r}")
    unknown = sorted(set(marker.kwargs) - set(MARKER_KEYS))
    if unknown:
        raise InvalidInputError(f"@pytest.mark.gpumem: unknown argument(s) {unknown}; allowed: "
                                f"{', '.join(MARKER_KEYS)}")
    return dict(marker.kwargs)


@pytest.fixture
def gpumem_devices(request: pytest.FixtureRequest) -> Iterator[GpumemDevices]:
    """Fresh devices for this test (``devices[0] == "sim:0"``...), removed afterwards. Shared
    managers (``gpumem.get_manager``) of these devices start fresh and are closed after the
    test, which fails if one of them still holds live buffers."""
    settings = request.config.stash[_SETTINGS]
    marker = _marker_kwargs(request)
    specs = settings.specs
    if marker.get("devices") is not None:
        specs = parse_device_specs(marker["devices"], what="@pytest.mark.gpumem(devices=...)")
    specs = map_to_backend(specs, settings.backend)
    faults = marker.get("faults")
    try:
        with install_devices(specs) as devices:
            if faults is not None:
                if not devices.simulated:
                    pytest.skip(f"the test injects driver faults, which need simulated devices; "
                                f"these are real: {list(devices)}")
                FaultInjector(devices).apply(faults, what="@pytest.mark.gpumem(faults=...)")
            close_shared_managers_on(devices)       # made on earlier tests' devices
            try:
                # shared managers of these devices track allocations: a leak names its tags
                with shared_config_changes(devices, track_allocations=True):
                    yield devices
            finally:
                leaks = [leak_report(m) for m in shared_managers_on(devices)]
                close_shared_managers_on(devices)
    except DevicesUnavailable as exc:
        pytest.skip(str(exc))
    leaks = [text for text in leaks if text]
    if leaks:
        pytest.fail("gpumem: the test left buffers alive on a shared manager:\n"
                    + "\n".join(leaks), pytrace=False)


@pytest.fixture
def gpumem_manager(gpumem_devices: GpumemDevices, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh MemoryManager on the test's first device, closed afterwards; the test fails if
    buffers are still alive then. Its config is the marker's ``config=``, else
    ``MemoryConfig.from_env()`` with allocation tracking on (so a leak names its buffers).
    Under pytest-xdist it joins the workers' shared group on its device
    (``--gpumem-shared-budget``) unless its config names a group of its own."""
    from gpumem import MemoryConfig, MemoryManager

    config = _marker_kwargs(request).get("config")
    if config is None:
        config = MemoryConfig.from_env().replace(track_allocations=True)
    elif not isinstance(config, MemoryConfig):
        raise InvalidInputError(f"@pytest.mark.gpumem(config=...) must be a MemoryConfig, got "
                                f"{type(config).__name__}")
    shared = request.config.stash[_SETTINGS].shared
    if shared is not None and config.shared_group is None:
        config = config.replace(shared_group=shared[0], shared_budget=shared[1])
    manager = MemoryManager(gpumem_devices[0], config)
    try:
        yield manager
        text = leak_report(manager)
    finally:
        if manager.tracker is not None:
            manager.tracker.clear()     # reported here, not again by close()
        manager.close()
    if text:
        pytest.fail(f"gpumem: the test leaked:\n{text}", pytrace=False)


@pytest.fixture
def gpumem_faults(gpumem_devices: GpumemDevices) -> FaultInjector:
    """Inject driver faults into the test's simulated devices (see FaultInjector); skips the
    test on real devices, which cannot be made to fail on demand."""
    if not gpumem_devices.simulated:
        pytest.skip(f"gpumem_faults needs simulated devices; these are real: "
                    f"{list(gpumem_devices)}")
    return FaultInjector(gpumem_devices)
