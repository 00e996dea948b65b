"""Parsing and printing byte sizes ("16GiB", "512MB", 1 << 20)."""
from __future__ import annotations

import re
from fractions import Fraction

from gpumem.errors import InvalidInputError

__all__ = ["parse_size", "format_bytes", "KiB", "MiB", "GiB", "TiB"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")    # fullmatch of the stripped
                                                                  # text: linear time
_MAX_DIGITS = 64        # far past any memory size; bounds the work of parsing a string


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Return a byte count from an int or a string such as ``"16GiB"``, ``"1.5 GB"`` or ``"4096"``.

    Binary units (KiB, MiB, GiB, TiB and the bare K/M/G/T) are powers of 1024; KB/MB/GB/TB are
    powers of 1000. Raises :class:`InvalidInputError` naming ``what`` for anything else.
    """
    if isinstance(value, bool):
        raise InvalidInputError(f"{what} must be a byte count, got the bool {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidInputError(f"{what} must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise InvalidInputError(
            f"{what} must be an int or a string such as '16GiB', got {type(value).__name__} {value!r}")
    m = _SIZE_RE.fullmatch(value.strip())
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidInputError(
            f"{what}: cannot parse {value!r}; expected a number with an optional unit "
            f"(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '16GiB'")
    digits = m.group(1)
    if len(digits) > _MAX_DIGITS:
        raise InvalidInputError(f"{what}: {value[:40]!r}... has more than {_MAX_DIGITS} digits")
    # exact arithmetic: a float would turn "18446744073709551617" into ...616
    nbytes = Fraction(digits) * _UNITS[m.group(2).lower()]
    if nbytes.denominator != 1:
        raise InvalidInputError(f"{what}: {value!r} is not a whole number of bytes")
    return int(nbytes)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: ``format_bytes(3 << 30) == '3.00 GiB'``."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
