"""The "sim" backend: simulated devices from :mod:`gpumem_sim` (no driver, always available).

The devices themselves live in gpumem_sim's registry (install / GPUMEM_SIM_DEVICES); this module
only adapts that registry to the :class:`~gpumem.backends.base.Backend` protocol, so
``open_device("sim:0")`` returns the very SimDevice a test installed. A simulated device is
never chosen unless asked for: with none installed, :meth:`SimBackend.describe` lists the backend
as having no device, and only an explicit ``"sim:0"`` opens ``gpumem_sim.demo_device()``.
``"sim:<size>"`` (``"sim:80GiB"``) opens a :class:`PrivateSimDevice` of that size.
"""
from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING

from gpumem.backends.base import Backend, DeviceDescription, DeviceKind
from gpumem.errors import InvalidDeviceError, InvalidInputError
from gpumem.units import format_bytes, parse_size

if TYPE_CHECKING:
    from gpumem_sim import SimDevice

__all__ = ["SimBackend", "BACKEND", "SIZE_SPEC", "open_private"]

#: ``sim:<size>``: a private simulated device of that size (the part after ``sim:``).
#: Match with ``fullmatch`` on the stripped text (linear time; surrounding blanks are allowed).
SIZE_SPEC = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)")


class SimBackend(Backend):
    """Backend over ``gpumem_sim.installed()``; the registry is read on every call, so
    installing new devices takes effect at once."""

    name = "sim"
    kind = DeviceKind.SIMULATED

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def device_count(self) -> int:
        import gpumem_sim

        return len(gpumem_sim.installed())

    def open(self, index: int) -> SimDevice:
        import gpumem_sim

        devices = gpumem_sim.installed()
        try:
            i = operator.index(index) if not isinstance(index, bool) else None
        except TypeError:
            i = None
        if not devices and i == 0 and gpumem_sim.nothing_installed():
            return gpumem_sim.demo_device()       # an explicit "sim:0" with nothing installed
        if i is None or not 0 <= i < len(devices):
            present = ", ".join(f"sim:{d.index} ({format_bytes(d.capacity)})" for d in devices)
            raise InvalidDeviceError(
                f"no simulated device {f'sim:{i}' if i is not None else repr(index)}: "
                f"{len(devices)} sim device(s) installed"
                f"{': ' + present if present else ''} (see gpumem_sim.install and "
                f"{gpumem_sim.ENV_VAR})")
        return devices[i]

    def describe(self) -> list[DeviceDescription]:
        """The installed devices, each marked ``simulated``; with none installed, one row that
        says so (the demo device behind an explicit ``"sim:0"`` is not listed)."""
        import gpumem_sim

        devices = gpumem_sim.installed()
        if not devices:
            return [DeviceDescription(
                device="sim", backend="sim", available=False, kind=self.kind,
                reason=f"no simulated device installed (gpumem_sim.install or "
                       f"{gpumem_sim.ENV_VAR}); 'sim:0' opens a "
                       f"{format_bytes(gpumem_sim.DEFAULT_CAPACITY)} demo device, 'sim:<size>' "
                       f"a private one")]
        rows = []
        for dev in devices:
            free, total = dev.mem_get_info()
            rows.append(DeviceDescription(device=dev.device_string, backend="sim", available=True,
                                          name=dev.name, total_memory=total, free_memory=free,
                                          kind=self.kind))
        return rows


def open_private(spec: str) -> SimDevice:
    """A new ``gpumem_sim.PrivateSimDevice`` for the size after ``sim:`` (``"80GiB"``), outside
    the registry: every call makes another device."""
    import gpumem_sim

    m = SIZE_SPEC.fullmatch(spec.strip())
    if m is None:
        raise InvalidDeviceError(f"device 'sim:{spec}': after 'sim:' give an index (sim:0) or a "
                                 f"size (sim:80GiB)")
    canonical = m.group(1) + m.group(2)
    # a unit that is no unit, or a size out of range: InvalidInputError naming the capacity
    capacity = parse_size(canonical, what=f"device 'sim:{spec}' capacity")
    try:
        return gpumem_sim.PrivateSimDevice(capacity, spec=canonical)
    except InvalidInputError as exc:
        raise InvalidInputError(f"device 'sim:{spec}' capacity: {exc}") from None


BACKEND = SimBackend()
