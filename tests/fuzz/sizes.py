"""Harness: byte sizes as users write them (``gpumem.parse_size``: "16GiB", "1.5 GB", "4096").

Allowed outcomes: an int >= 0, or InvalidInputError. Properties of a result: a string of
decimal digits (with an optional B unit) is exactly that many bytes, however many digits
(no detour through a float); a number with a unit is that number times the unit, exactly.
"""
from __future__ import annotations

import re
from decimal import Decimal
from typing import Iterable

from gpumem import parse_size
from gpumem.errors import GpuMemoryError

_UNIT = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# the documented grammar, independently: digits, an optional fraction, an optional unit
_GRAMMAR = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", re.ASCII)


def check(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    try:
        n = parse_size(text)
    except GpuMemoryError:
        return
    assert type(n) is int and n >= 0, (text, n)
    m = _GRAMMAR.fullmatch(text)
    assert m is not None and m.group(2).lower() in _UNIT, f"{text!r} accepted as {n}"
    exact = Decimal(m.group(1)) * _UNIT[m.group(2).lower()]
    assert exact == n, f"{text!r} is {exact} bytes, parse_size says {n}"


def seeds() -> Iterable[bytes]:
    for s in ("16GiB", "1.5 GB", "4096", "0", " 2 MiB ", "512MB", "1.25KiB", "3t", "7b",
              "18446744073709551617", "1e3", "0.5", "-1", "GiB", "1.0000000001KiB"):
        yield s.encode()
