"""Which simulated devices exist: the ones installed with :func:`install`, else those described
by ``GPUMEM_SIM_DEVICES``, else none.

A simulated device is never chosen unless asked for: with nothing installed, :func:`installed` is
empty, so ``gpumem.devices()``, ``get_manager()`` and automatic placement see no sim device. Only
an explicit ``"sim:0"`` still opens something then: :func:`demo_device`, one 16 GiB device kept
outside the registry (it is not listed and never picked by a default).

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
           "devices_from_env", "demo_device", "nothing_installed", "PrivateSimDevice"]

ENV_VAR = "GPUMEM_SIM_DEVICES"
#: Capacity of :func:`demo_device`, what an explicit ``"sim:0"`` opens when nothing is installed
#: and ENV_VAR is unset, so that demos work out of the box.
DEFAULT_CAPACITY = 16 * GiB

_lock = threading.Lock()
_devices: tuple[SimDevice, ...] | None = None   # None: not decided yet (read the env lazily)
_demo: SimDevice | None = None                  # made on the first explicit "sim:0", then kept


def devices_from_env(value: str | None) -> tuple[SimDevice, ...]:
    """Devices for a ``GPUMEM_SIM_DEVICES`` value: comma-separated capacities
    (``"16GiB,8GiB"``). ``None`` (unset) and an empty value give no devices. They are backed by
    host memory (``back_memory=True``; pages are only used once written) so demos can copy data
    in and out."""
    if value is None or not value.strip():
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
    was installed (raising InvalidInputError naming the variable if it is malformed); with the
    variable unset too, there are none."""
    global _devices
    with _lock:
        if _devices is None:
            value = os.environ.get(ENV_VAR)
            if value is None:
                return ()                   # not decided yet: the variable may still be set
            devices = devices_from_env(value)
            _assign(devices)
            _devices = devices
        return _devices


def nothing_installed() -> bool:
    """True while no device was installed (not even ``install()`` of none) and
    ``GPUMEM_SIM_DEVICES`` is unset: the only state in which ``"sim:0"`` opens
    :func:`demo_device`."""
    with _lock:
        return _devices is None and os.environ.get(ENV_VAR) is None


def demo_device() -> SimDevice:
    """The device an explicit ``"sim:0"`` opens while nothing is installed and ENV_VAR is unset:
    one host-backed device of ``DEFAULT_CAPACITY``, made on first use and then kept, so every
    manager opened on ``"sim:0"`` shares it. It is not part of :func:`installed`, so nothing
    that chooses a device by default ever picks it."""
    global _demo
    with _lock:
        if _demo is None:
            _demo = SimDevice(DEFAULT_CAPACITY, back_memory=True, name="demo SimDevice")
            _demo.index = 0
        return _demo


class PrivateSimDevice(SimDevice):
    """A host-backed SimDevice of its own, named ``sim:<spec>`` as it was asked for
    (``"sim:80GiB"``), outside the registry: never listed, never picked by a default."""

    def __init__(self, capacity: int | str, *, spec: str) -> None:
        super().__init__(capacity, back_memory=True)
        self._spec = spec

    @property
    def device_string(self) -> str:
        return f"sim:{self._spec}"


def uninstall() -> None:
    """Forget the installed devices and the demo device (the environment is read again, and a
    fresh demo device made, on next use). The device objects are left untouched for whoever
    still holds them."""
    global _devices, _demo
    with _lock:
        _devices = None
        _demo = None


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
