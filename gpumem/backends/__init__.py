"""Backend registry: device strings ("cuda:0", "opencl:1", "sim:0", "cpu") to opened devices.

Backends are imported lazily so that importing gpumem never fails for a missing driver or
package; an unavailable backend is listed by :func:`devices` with its reason.
"""
from __future__ import annotations

import importlib
import threading

from gpumem.backends.base import Backend, Device, DeviceDescription, DeviceProperties
from gpumem.errors import BackendUnavailableError, InvalidDeviceError

__all__ = ["Backend", "Device", "DeviceDescription", "DeviceProperties", "BACKEND_NAMES",
           "get_backend", "parse_device", "open_device", "devices"]

# Order of preference when listing and when choosing a default device.
BACKEND_NAMES = ("cuda", "opencl", "sim", "cpu")
_MODULES = {"cuda": "gpumem.backends.cuda", "opencl": "gpumem.backends.opencl",
            "sim": "gpumem.backends.sim", "cpu": "gpumem.backends.host"}
_backends: dict[str, Backend] = {}
_lock = threading.Lock()


def get_backend(name: str) -> Backend:
    """The backend object for ``name`` (one of BACKEND_NAMES); it may report itself unavailable."""
    if name not in _MODULES:
        raise InvalidDeviceError(
            f"unknown backend {name!r}; backends are {', '.join(BACKEND_NAMES)}")
    with _lock:
        backend = _backends.get(name)
        if backend is None:
            backend = importlib.import_module(_MODULES[name]).BACKEND
            _backends[name] = backend
        return backend


def parse_device(device: str) -> tuple[str, int]:
    """Split ``"cuda:1"`` into ``("cuda", 1)``; ``"cpu"`` is ``("cpu", 0)``; ``"sim"`` is sim:0."""
    if not isinstance(device, str):
        raise InvalidDeviceError(
            f"device must be a string such as 'sim:0', 'cuda:0', 'opencl:0' or 'cpu', "
            f"got {type(device).__name__} {device!r}")
    name, sep, idx = device.strip().partition(":")
    name = name.lower()
    if name not in _MODULES:
        raise InvalidDeviceError(
            f"unknown device {device!r}: the backend must be one of {', '.join(BACKEND_NAMES)}; "
            f"devices here: {_device_list()}")
    if not sep:
        return name, 0
    if not idx.isdigit():
        raise InvalidDeviceError(
            f"device {device!r}: the index after ':' must be a non-negative integer")
    return name, int(idx)


def open_device(device: str) -> Device:
    """Open a device by its string; InvalidDeviceError lists the devices that exist."""
    name, index = parse_device(device)
    backend = get_backend(name)
    ok, reason = backend.availability()
    if not ok:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    count = backend.device_count()
    if index >= count:
        raise InvalidDeviceError(
            f"no device {device!r}: backend {name!r} has {count} device(s); "
            f"devices here: {_device_list()}")
    return backend.open(index)


def devices() -> list[DeviceDescription]:
    """Every device of every backend, with an 'unavailable' row (and reason) per missing one."""
    rows: list[DeviceDescription] = []
    for name in BACKEND_NAMES:
        try:
            rows.extend(get_backend(name).describe())
        except Exception as exc:  # a broken driver must not hide the other backends
            rows.append(DeviceDescription(device=name, backend=name, available=False,
                                          reason=f"{type(exc).__name__}: {exc}"))
    return rows


def _device_list() -> str:
    names = [d.device for d in devices() if d.available]
    return ", ".join(names) if names else "none"
