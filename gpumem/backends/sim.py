"""The "sim" backend: simulated devices from :mod:`gpumem_sim` (no driver, always available).

The devices themselves live in gpumem_sim's registry (install / GPUMEM_SIM_DEVICES / one 16 GiB
default); this module only adapts that registry to the :class:`~gpumem.backends.base.Backend`
protocol, so ``open_device("sim:0")`` returns the very SimDevice a test installed.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from gpumem.backends.base import Backend
from gpumem.errors import InvalidDeviceError
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem_sim import SimDevice

__all__ = ["SimBackend", "BACKEND"]


class SimBackend(Backend):
    """Backend over ``gpumem_sim.installed()``; the registry is read on every call, so
    installing new devices takes effect at once."""

    name = "sim"

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
        if i is None or not 0 <= i < len(devices):
            present = ", ".join(f"sim:{d.index} ({format_bytes(d.capacity)})" for d in devices)
            raise InvalidDeviceError(
                f"no simulated device {index!r}: {len(devices)} sim device(s) installed"
                f"{': ' + present if present else ''} (see gpumem_sim.install and "
                f"{gpumem_sim.ENV_VAR})")
        return devices[i]


BACKEND = SimBackend()
