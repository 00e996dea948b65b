"""Parsing and printing byte sizes ("16GiB", "512MB", 1 << 20).

One convention everywhere, the one of Dask's ``parse_bytes`` and RAPIDS RMM: a bare or SI
prefix is decimal (``"4G"`` = ``"4GB"`` = ``"4gb"`` = 4,000,000,000 bytes, ``"512M"`` = 512e6),
an IEC prefix is binary (``"4GiB"`` = ``"4Gi"`` = 2**32); units are case-insensitive.
:func:`describe_size` shows both readings of a byte count where it matters (``2.00 GB =
1.86 GiB``), so a user sees which one was taken.
"""
from __future__ import annotations

import re
from fractions import Fraction

from gpumem.errors import InvalidInputError

__all__ = ["parse_size", "format_bytes", "format_decimal", "describe_size", "sized_device", "KiB",
           "MiB", "GiB", "TiB", "PiB"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

PiB = 1 << 50

#: unit (lower case) -> bytes, as dask.utils.parse_bytes reads them: bare and SI prefixes
#: decimal, IEC prefixes (with or without the B) binary
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB, "pi": PiB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "pib": PiB,
}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")    # fullmatch of the stripped
                                                                  # text: linear time
_MAX_DIGITS = 64        # far past any memory size; bounds the work of parsing a string


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Return a byte count from an int or a string such as ``"16GiB"``, ``"1.5 GB"`` or ``"4096"``.

    Dask's and RMM's convention, in any case: IEC units (KiB, MiB, GiB, TiB, PiB, or Ki, Mi...)
    are powers of 1024; SI units (kB, MB, GB, TB, PB) and the bare K/M/G/T/P are powers of 1000
    (``"4G"`` is 4,000,000,000 bytes: write ``"4GiB"`` for 2**32). Raises
    :class:`InvalidInputError` naming ``what`` for anything else.
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
            f"(B; binary KiB, MiB, GiB, TiB; decimal kB, MB, GB, TB, or K, M, G, T), "
            f"e.g. '16GiB'")
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


def format_decimal(n: int | float) -> str:
    """Human-readable decimal size: ``format_decimal(2 * 10**9) == '2.00 GB'``."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def describe_size(n: int) -> str:
    """Both readings of a byte count, so a user sees which unit was taken: ``'2.00 GB = 1.86
    GiB'`` (a whole number of binary units reads ``'4.00 GiB = 4.29 GB'``); under 1000
    bytes just ``'512 B'``."""
    if n < 1000:
        return format_bytes(n)
    binary, decimal = format_bytes(n), format_decimal(n)
    whole_binary = n >= KiB and any(n % scale == 0 and n >= scale for scale in (MiB, GiB, TiB)) \
        and n % 10**6 != 0
    return f"{binary} = {decimal}" if whole_binary else f"{decimal} = {binary}"


#: a device string that carries its own size in a unit that is not IEC ("sim:2GB", "sim:2G"):
#: a user may have meant GiB, so the reading taken is worth showing
_SIZED_DEVICE = re.compile(r"[a-z]+:\s*[0-9]+(?:\.[0-9]+)?\s*([a-zA-Z]+)")


def sized_device(device: str, total: int | None) -> str:
    """``device``, with the size it was read as when the string names one in a decimal unit:
    ``sim:2GB (2.00 GB = 1.86 GiB)``; ``sim:2GiB`` (one reading) and any other device string
    (``cuda:0``) as they are."""
    m = _SIZED_DEVICE.fullmatch(device) if isinstance(device, str) else None
    if total is None or m is None or m.group(1).lower().rstrip("b").endswith("i"):
        return device
    return f"{device} ({describe_size(total)})"
