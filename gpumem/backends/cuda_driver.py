"""The CUDA driver through cuda-python: loading it (``cuda.bindings.driver``, with gpumem's
Cython fast path when built), the return-code checker every call goes through, and the
usable-memory reserve a cache leaves to the CUDA runtime. Importing this module touches no
driver."""
from __future__ import annotations

import os
from typing import Any

from gpumem.errors import DriverError, DriverOutOfMemory, InvalidInputError
from gpumem.units import GiB, MiB

__all__ = ["load_driver", "check", "usable_memory_reserve", "usable_memory"]


# --------------------------------------------------------------------------------------------
# Usable-memory reserve
# --------------------------------------------------------------------------------------------
def usable_memory_reserve(total: int, *, driver_overhead: int = 500 * MiB,
                          context_overhead: int = 100 * MiB, fraction: float = 0.10,
                          cap: int = 2 * GiB) -> int:
    """Bytes of a device's ``total`` to leave alone when sizing a cache.

    ``reserve = min(cap, driver_overhead + context_overhead + fraction * total)``, and never
    more than ``total``. The defaults (500 MiB for the driver and its module images, 100 MiB
    per CUDA context, 10 % of the device for other processes and fragmentation, at most 2 GiB)
    keep a cache from taking memory the CUDA runtime itself needs later (cuBLAS workspaces,
    kernel images loaded on first launch).
    """
    if total < 0:
        raise InvalidInputError(f"total must be >= 0 bytes, got {total}")
    if not 0.0 <= fraction <= 1.0:
        raise InvalidInputError(f"fraction must be between 0 and 1, got {fraction}")
    reserve = driver_overhead + context_overhead + int(fraction * total)
    return max(0, min(reserve, cap, total))


def usable_memory(total: int, **kwargs: Any) -> int:
    """``total - usable_memory_reserve(total, **kwargs)``."""
    return total - usable_memory_reserve(total, **kwargs)


# --------------------------------------------------------------------------------------------
# Driver loading and the return-code checker
# --------------------------------------------------------------------------------------------
def load_driver() -> Any:
    """Import and return the ``cuda.bindings.driver`` module (or the older ``cuda.cuda``).

    Raises ImportError when cuda-python is not installed; does not call the driver.
    """
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        from cuda import cuda as driver  # type: ignore[no-redef]  # cuda-python < 12.6
    return driver


def _with_native_calls(drv: Any) -> Any:
    """``drv`` with its busy calls done by gpumem's Cython module when that was built (cuda.h
    and cuda-python present at build time) and GPUMEM_CUDA_NATIVE is not 0; else ``drv``."""
    if os.environ.get("GPUMEM_CUDA_NATIVE", "1") == "0":
        return drv
    try:
        from gpumem.backends._cuda_native import NativeDriver
    except ImportError:
        return drv
    return NativeDriver(drv)


def _error_name(drv: Any, code: Any) -> str:
    """The driver's name for a CUresult, e.g. ``CUDA_ERROR_OUT_OF_MEMORY``."""
    try:
        err, name = drv.cuGetErrorName(code)
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return getattr(code, "name", None) or f"CUresult {int(code)}"


def _error_string(drv: Any, code: Any) -> str:
    try:
        err, text = drv.cuGetErrorString(code)
        if int(err) == 0 and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass
    return ""


def check(drv: Any, result: Any, what: str) -> Any:
    """Check one cuda-python call result ``(CUresult, *outputs)``.

    Returns ``None``, the single output, or a tuple of outputs. A non-success code raises
    :class:`DriverOutOfMemory` for ``CUDA_ERROR_OUT_OF_MEMORY`` and :class:`DriverError`
    otherwise, both carrying ``code`` and ``code_name``.
    """
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if int(code) != 0:
        name = _error_name(drv, code)
        text = _error_string(drv, code)
        msg = f"{what} failed: {name}" + (f" ({text})" if text else "")
        oom = int(drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        cls = DriverOutOfMemory if int(code) == oom else DriverError
        raise cls(msg, code=int(code), code_name=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values

