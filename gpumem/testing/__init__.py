"""gpumem.testing: run the tests of code that uses gpumem on simulated GPUs, then on real ones.

The pytest plug-in (:mod:`gpumem.testing.plugin`, registered through the ``pytest11`` entry point,
so installing gpumem makes it available) is off until a test asks for it: it adds options, a
marker and fixtures, and touches no other test.

- ``--gpumem-devices "sim:16GiB,sim:8GiB"`` (or ``GPUMEM_TEST_DEVICES``): the devices each test
  gets; default one ``sim:16GiB``. ``--gpumem-backend cuda`` maps the i-th simulated device to
  ``cuda:i`` (likewise ``opencl``, ``cpu``), so the same tests run on real hardware.
- fixtures ``gpumem_devices`` (fresh devices for the test, removed after it), ``gpumem_manager``
  (a fresh manager on the first device, closed after, the test failing if it leaked),
  ``gpumem_faults`` (driver faults: fail after n allocations, at a rate, failing frees);
- marker ``@pytest.mark.gpumem(devices="sim:1GiB", faults={"fail_after": 2}, config=...)``.

The helpers here are plain functions a test suite can also call itself.
"""
from __future__ import annotations

from gpumem.testing.devices import (DEFAULT_DEVICES, ENV_VAR, FaultInjector, GpumemDevices,
                                    map_to_backend, parse_device_specs)
from gpumem.testing.leaks import assert_no_leaks, leak_report

__all__ = ["DEFAULT_DEVICES", "ENV_VAR", "FaultInjector", "GpumemDevices", "map_to_backend",
           "parse_device_specs", "assert_no_leaks", "leak_report"]
