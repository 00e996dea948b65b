"""Pieces shared by the simulated device's modules: address windows, host backing, the call
record and argument checks (one place, so device.py and vmm.py do not import each other)."""
from __future__ import annotations

import math
import mmap
import numbers
import operator
import platform
import sys
import threading
from typing import Any, NamedTuple

from gpumem.errors import InvalidInputError
from gpumem.units import parse_size

_UNSET: Any = object()

# --- process-wide address windows ---------------------------------------------------------------
# Each SimDevice reserves its own window when it is constructed, so no two devices ever share an
# address (installed or not, replaced or not), and the first device of a process always starts at
# 0x7f0000000000. Windows are whole TiB and separated by a 1 TiB guard gap.
_WINDOW_UNIT = 1 << 40
_FIRST_WINDOW = 0x7F00_0000_0000
_ADDRESS_LIMIT = 1 << 63
_window_lock = threading.Lock()
_next_window = _FIRST_WINDOW


def _reserve_window(capacity: int) -> int:
    global _next_window
    span = -(-capacity // _WINDOW_UNIT) * _WINDOW_UNIT
    with _window_lock:
        if _next_window + span > _ADDRESS_LIMIT:  # after ~8 million devices: wrap around
            _next_window = _FIRST_WINDOW
        base = _next_window
        _next_window += span + _WINDOW_UNIT
    return base


# Anonymous mappings are zero-filled lazily by the OS, so backing a large segment costs host
# memory only for the pages a test actually writes. MAP_NORESERVE (Linux x86-64/arm64 value)
# keeps the kernel from refusing a large, mostly untouched mapping.
_MMAP_KW: dict[str, int] = {}
if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64", "AMD64"):
    _MMAP_KW = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000}


class SimCall(NamedTuple):
    """One driver call in :attr:`SimDevice.calls`, so tests can check the order of a recovery
    ladder. ``op`` is ``"alloc"``, ``"free"`` or ``"synchronize"``; ``nbytes`` is the requested
    size (alloc) or the segment's size (free); ``outcome`` is ``"ok"``, ``"oom"`` (genuine),
    ``"injected_oom"``, ``"injected_error"``."""

    op: str
    nbytes: int
    handle: int | None
    outcome: str


# --- argument validation ------------------------------------------------------------------------
def _int_arg(value: Any, what: str, *, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or isinstance(value, str) or not hasattr(type(value), "__index__"):
        raise InvalidInputError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    v = operator.index(value)
    if minimum is not None and v < minimum:
        raise InvalidInputError(f"{what} must be >= {minimum}, got {v}")
    return v


def _size_arg(value: Any, what: str) -> int:
    if not isinstance(value, (bool, str, int)) and hasattr(type(value), "__index__"):
        value = operator.index(value)  # numpy integers
    return parse_size(value, what=what)


def _rate_arg(value: Any, what: str = "fail_rate") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(
            f"{what} must be a probability (a float in [0, 1]), got {type(value).__name__} {value!r}")
    v = float(value)
    if math.isnan(v) or not 0.0 <= v <= 1.0:
        raise InvalidInputError(f"{what} must be a probability in [0, 1], got {value!r}")
    return v


def _fail_after_arg(value: Any) -> int | None:
    if value is None:
        return None
    return _int_arg(value, "fail_after")


def _fail_free_arg(value: Any) -> float:
    """Number of frees still to fail: ``inf`` for True, ``0`` for False."""
    if value is True:
        return math.inf
    if value is False or value is None:
        return 0
    return _int_arg(value, "fail_free (True, False or a number of frees to fail)")


def _fail_kind_arg(value: Any) -> str:
    if value not in ("oom", "error"):
        raise InvalidInputError(f"fail_kind must be 'oom' or 'error', got {value!r}")
    return value


def _bytes_view(buf: Any, what: str, *, writable: bool) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise InvalidInputError(
            f"{what} must support the buffer protocol (bytes, bytearray, memoryview, numpy "
            f"array), got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise InvalidInputError(f"{what} must be C-contiguous")
    if writable and mv.readonly:
        raise InvalidInputError(f"{what} is read-only; copy_to_host needs a writable buffer")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except (TypeError, ValueError) as e:
        raise InvalidInputError(
            f"{what} cannot be viewed as bytes ({e}); pass a byte view such as "
            f"arr.view(numpy.uint8)") from None
