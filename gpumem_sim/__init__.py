"""gpumem_sim: a deterministic simulated GPU driver for testing gpumem without a GPU.

``SimDevice`` implements :class:`gpumem.backends.base.Device` (a fake *driver*: raw segments,
exact ``mem_get_info``, seeded fault injection, optional host-backed bytes, a drivable stream
model). The registry decides which devices ``"sim:0"``, ``"sim:1"``... name:

- :func:`install` (replacing earlier ones), :func:`installed`, :func:`uninstall`, :func:`using`;
- when nothing is installed, ``GPUMEM_SIM_DEVICES="16GiB,8GiB"`` is read on first use;
- when that is unset too, there is no simulated device: defaults (``gpumem.get_manager()``,
  ``MemoryManager()``, placement) never pick one. An explicit ``"sim:0"`` then opens
  :func:`demo_device` (16 GiB, outside the registry) so demos still work, and ``"sim:<size>"``
  (``"sim:80GiB"``) opens a private device of that size.

Example::

    import gpumem_sim
    dev = gpumem_sim.SimDevice("1GiB", other_process_bytes="256MiB", fail_after=3, seed=7)
    gpumem_sim.install(dev)          # now "sim:0"

Each device charges its driver calls a modeled CUDA time (``dev.modeled_driver_seconds``;
:mod:`gpumem_sim.driver_costs`, ``driver_costs=False`` turns it off).
"""
from __future__ import annotations

from gpumem_sim.device import (
    CALL_LOG_LIMIT,
    MAX_ALIGNMENT,
    MAX_CAPACITY,
    SIM_ERROR_INJECTED,
    SIM_ERROR_OUT_OF_MEMORY,
    SimCall,
    SimDevice,
    SimSegment,
)
from gpumem_sim.driver_costs import (CALLS, CUDA_DRIVER_COSTS, CUDA_DRIVER_COSTS_A100,
                                     DriverCostModel)
from gpumem_sim.registry import (
    DEFAULT_CAPACITY,
    PrivateSimDevice,
    ENV_VAR,
    demo_device,
    devices_from_env,
    install,
    installed,
    nothing_installed,
    uninstall,
    using,
)
from gpumem_sim.shared_card import SharedCard

__all__ = [
    "SimDevice", "SimCall", "SimSegment", "SharedCard", "PrivateSimDevice",
    "install", "installed", "uninstall", "using", "devices_from_env", "demo_device",
    "nothing_installed",
    "ENV_VAR", "DEFAULT_CAPACITY", "MAX_CAPACITY", "MAX_ALIGNMENT", "CALL_LOG_LIMIT",
    "SIM_ERROR_OUT_OF_MEMORY", "SIM_ERROR_INJECTED",
    "DriverCostModel", "CALLS", "CUDA_DRIVER_COSTS", "CUDA_DRIVER_COSTS_A100",
]
