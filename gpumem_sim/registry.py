"""Which simulated devices exist: the ones installed with :func:`install`, else those described
by ``GPUMEM_SIM_DEVICES``, else one 16 GiB device.

The registry only ever swaps a tuple: devices are never modified on replacement or uninstall,
because managers opened earlier keep using the device objects they hold.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from gpumem.errors import InvalidInputError
from gpumem.units import GiB
from gpumem_sim.device import SimDevice

__all__ = ["ENV_VAR", "DEFAULT_CAPACITY", "install", "installed", "uninstall", "using",
           "devices_from_env"]

ENV_VAR = "GPUMEM_SIM_DEVICES"
#: Capacity of the one device present when nothing is installed and ENV_VAR is unset, so that
#: ``"sim:0"`` works out of the box in demos.
DEFAULT_CAPACITY = 16 * GiB

_lock = threading.Lock()
_devices: tuple[SimDevice, ...] | None = None   # None: not decided yet (read the env lazily)


def devices_from_env(value: str | None) -> tuple[SimDevice, ...]:
    """Devices for a ``GPUMEM_SIM_DEVICES`` value: comma-separated capacities
    (``"16GiB,8GiB"``). ``None`` (unset) gives one device of ``DEFAULT_CAPACITY``; an empty
    value gives no devices. They are backed by host memory (``back_memory=True``; pages are only
    used once written) so demos can copy data in and out."""
    if value is None:
        return (SimDevice(DEFAULT_CAPACITY, back_memory=True),)
    if not value.strip():
        return ()
    devices = []
    for i, item in enumerate(value.split(",")):
        if not item.strip():
            raise InvalidInputError(
                f"{ENV_VAR}={value!r}: item {i} is empty; expected comma-separated capacities "
                f"such as '16GiB,8GiB'")
        try:
            devices.append(SimDevice(item.strip(), back_memory=True))
        except InvalidInputError as e:
            raise InvalidInputError(
                f"{ENV_VAR}={value!r}: bad item {i} {item.strip()!r}: {e}; expected "
                f"comma-separated capacities such as '16GiB,8GiB'") from None
    return tuple(devices)


def _assign(devices: tuple[SimDevice, ...]) -> None:
    for i, dev in enumerate(devices):
        dev.index = i


def install(*devices: SimDevice) -> tuple[SimDevice, ...]:
    """Make ``devices`` the simulated devices ``sim:0``, ``sim:1``... replacing any installed
    before (or read from the environment). ``install()`` with no devices leaves none.

    A device keeps the index it was first installed at (managers name it by that string), so
    installing it again is allowed only at the same index. Returns the installed tuple.
    """
    for i, dev in enumerate(devices):
        if not isinstance(dev, SimDevice):
            raise InvalidInputError(
                f"install() takes SimDevice objects; argument {i} is {type(dev).__name__} {dev!r}")
    global _devices
    with _lock:
        _check_new(devices)
        _assign(devices)
        _devices = tuple(devices)
        return _devices


def _check_new(devices: tuple[SimDevice, ...]) -> None:
    seen: set[int] = set()
    for i, dev in enumerate(devices):
        if id(dev) in seen:
            raise InvalidInputError(
                f"install(): the same SimDevice was given twice (again as argument {i}); "
                f"create one SimDevice per simulated device")
        seen.add(id(dev))
        if dev.index not in (-1, i):
            raise InvalidInputError(
                f"install(): {dev!r} was installed as sim:{dev.index} and cannot become sim:{i}; "
                f"create a new SimDevice instead")


def installed() -> tuple[SimDevice, ...]:
    """The simulated devices, by index. Reads ``GPUMEM_SIM_DEVICES`` on first use when nothing
    was installed (raising InvalidInputError naming the variable if it is malformed)."""
    global _devices
    with _lock:
        if _devices is None:
            devices = devices_from_env(os.environ.get(ENV_VAR))
            _assign(devices)
            _devices = devices
        return _devices


def uninstall() -> None:
    """Forget the installed devices (the environment is read again on next use). The device
    objects are left untouched for whoever still holds them."""
    global _devices
    with _lock:
        _devices = None


@contextlib.contextmanager
def using(*devices: SimDevice) -> Iterator[tuple[SimDevice, ...]]:
    """``with using(SimDevice("1GiB")) as (dev,):`` installs devices and restores the previous
    registry state (including "not decided yet") on exit."""
    global _devices
    with _lock:
        previous = _devices
    result = install(*devices)
    try:
        yield result
    finally:
        with _lock:
            _devices = previous
