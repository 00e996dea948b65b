"""Harness: byte sizes as users write them (``gpumem.parse_size``: "16GiB", "1.5 GB", "4096").

Allowed outcomes: an int >= 0, or InvalidInputError. Properties of a result: a string of
decimal digits (with an optional B unit) is exactly that many bytes, however many digits
(no detour through a float); a number with a unit is that number times the unit, exactly.
"""
from __future__ import annotations

import re
from typing import Iterable

from gpumem import parse_size
from gpumem.errors import GpuMemoryError

# Dask's parse_bytes / RMM convention: bare and SI prefixes decimal, IEC prefixes binary
_UNIT = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
         "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
         "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40, "pi": 1 << 50,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50}
# the documented grammar: blanks (str.strip's), digits, an optional fraction, an optional unit
_GRAMMAR = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")


def check(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    try:
        n = parse_size(text)
    except GpuMemoryError:
        return
    assert type(n) is int and n >= 0, (text, n)
    m = _GRAMMAR.fullmatch(text.strip())
    assert m is not None and m.group(2).lower() in _UNIT, f"{text!r} accepted as {n}"
    whole, _, fraction = m.group(1).partition(".")      # integer arithmetic, independently
    scaled = int(whole + fraction) * _UNIT[m.group(2).lower()]
    assert scaled % 10 ** len(fraction) == 0 and scaled // 10 ** len(fraction) == n, \
        f"{text!r} is {scaled} / 10**{len(fraction)} bytes, parse_size says {n}"


def seeds() -> Iterable[bytes]:
    for s in ("16GiB", "1.5 GB", "4096", "0", " 2 MiB ", "512MB", "1.25KiB", "3t", "7b",
              "18446744073709551617", "1e3", "0.5", "-1", "GiB", "1.0000000001KiB"):
        yield s.encode()
