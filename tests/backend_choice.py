"""Which backends a test module runs on: GPUMEM_TEST_BACKENDS, or a module's own default.

conftest.selected_backends() serves the conformance fixtures (default: all four, unknown names
kept so they fail loudly); modules whose tests are written for the simulated device first use
chosen_backends(), whose default is sim only.
"""
from __future__ import annotations

import os

ALL_BACKENDS = ("sim", "cpu", "opencl", "cuda")


def chosen_backends(default: tuple[str, ...] = ("sim",)) -> list[str]:
    env = os.environ.get("GPUMEM_TEST_BACKENDS", "").strip()
    names = [n.strip().lower() for n in env.split(",") if n.strip()] or list(default)
    return [n for n in ALL_BACKENDS if n in names]
