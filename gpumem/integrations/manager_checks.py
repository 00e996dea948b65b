"""What a framework bridge requires of a manager, read from its device's declarations
(gpumem.backends.base.Device), never from a backend's name: CUDA device memory (CuPy, Numba,
torch), host memory (CuPy's pinned allocator).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gpumem.backends.base import DLPACK_CUDA, DeviceKind
from gpumem.errors import InvalidInputError

if TYPE_CHECKING:
    from gpumem.manager.memory_manager import MemoryManager

__all__ = ["cuda_device_index", "require_host_memory"]


def _refused(manager: "MemoryManager", what: str, hint: str) -> InvalidInputError:
    return InvalidInputError(f"{what}; {manager!r} is on {manager.device_string!r}{hint}")


def cuda_device_index(manager: "MemoryManager", what: str, hint: str = "") -> int:
    """The CUDA device index of ``manager``'s memory. When its device's memory is not CUDA's:
    InvalidInputError saying ``what`` the bridge needs (e.g. "Numba's CUDA target needs a cuda
    manager"), where the manager is, then ``hint``."""
    device = manager.device
    if device.dlpack_device_type != DLPACK_CUDA:
        raise _refused(manager, what, hint)
    return device.index


def require_host_memory(manager: "MemoryManager", what: str) -> None:
    """InvalidInputError (saying ``what`` is needed) unless ``manager`` holds host memory."""
    if manager.device.kind is not DeviceKind.HOST:
        raise _refused(manager, what, "")
