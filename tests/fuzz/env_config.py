"""Harness: ``GPUMEM_*`` environment variables (``gpumem.MemoryConfig.from_env``).

The input decodes (tests.fuzz.Bytes) into an environment: up to 8 variables, each a known
``GPUMEM_<FIELD>`` name (or another ``GPUMEM_`` name, or one near a known name) with a value
of up to 64 bytes, often drawn from values that mean something to the parsers. Allowed
outcomes: a MemoryConfig, or InvalidInputError (GpuMemoryError); UnknownSettingWarning may be
emitted. Property: a result is a valid config (``replace()`` with no change validates it
again) and each variable given for a field is reflected in it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Iterable

from fuzz import Bytes
from gpumem import MemoryConfig
from gpumem.errors import GpuMemoryError, UnknownSettingWarning

_FIELDS = [f.name for f in dataclasses.fields(MemoryConfig)]
_NAMES = ["GPUMEM_" + f.upper() for f in _FIELDS] + ["GPUMEM_DEBUG", "GPUMEM_DEVICE",
                                                      "GPUMEM_MIN_FREE_BYTE", "GPUMEM_"]
_VALUES = ["1", "0", "true", "off", "0.5", "1.0", "nan", "inf", "-0.1", "1e-400", "2GiB",
           "512MB", "none", "", "4096", "0.6,0.8,0.95", "0.9,0.8,0.7", "1,2", "\u00b2", "\u0661",
           "1_000", "  7  ", "18446744073709551617", "4611686018427387905", "0x10", "-1"]


def check(data: bytes) -> None:
    b = Bytes(data)
    env: dict[str, str] = {}
    for _ in range(b.below(9)):
        name = b.pick(_NAMES) if b.byte() < 240 else "GPUMEM_" + b.text(16).upper()
        env[name] = b.pick(_VALUES) if b.byte() < 200 else b.text(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownSettingWarning)
        try:
            cfg = MemoryConfig.from_env(env)
        except GpuMemoryError:
            return
    assert cfg.replace() == cfg
    for field in _FIELDS:
        if "GPUMEM_" + field.upper() in env and env["GPUMEM_" + field.upper()].strip() != "":
            assert getattr(cfg, field) is not None or \
                env["GPUMEM_" + field.upper()].strip().lower() == "none", field


def seeds() -> Iterable[bytes]:
    yield b""
    for k in range(len(_NAMES)):            # one variable: each name with every value
        for v in range(len(_VALUES)):
            yield bytes([1, 0, k, 0, v])
