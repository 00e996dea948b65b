"""Backend registry: device strings ("cuda:0", "opencl:1", "sim:0", "sim:80GiB", "cpu") to
opened devices, and the default device.

Backends are imported lazily so that importing gpumem never fails for a missing driver or
package; an unavailable backend is listed by :func:`devices` with its reason.

A backend is one module whose ``BACKEND`` is a :class:`Backend` (with its :class:`Device`
subclass), plus one row of ``_REGISTRY`` below (name -> module); from outside the package,
:func:`register_backend` adds the row. What gpumem needs to know about a device (its kind,
DLPack type, pinned segments...) it reads from the Device's declarations (backends/base.py),
never from its name (docs/architecture.md has a worked example).

Thread safety: the registry and the cache of backend objects are guarded by ``_lock``.

A device string means the same everywhere (API, CLI, ``GPUMEM_DEVICE``): ``"sim:<size>"`` is a
new private simulated device of that size; ``"sim:N"`` an installed one (see gpumem_sim).
:func:`default_device` never picks a simulated device that was not installed.
"""
from __future__ import annotations

import importlib
import os
import re
import threading

from gpumem.backends.base import (Backend, Device, DeviceDescription, DeviceKind,
                                  DeviceProperties)
from gpumem.errors import BackendUnavailableError, InvalidDeviceError, InvalidInputError

__all__ = ["Backend", "Device", "DeviceDescription", "DeviceKind", "DeviceProperties",
           "BACKEND_NAMES", "HOST_DEVICE", "backend_names", "register_backend",
           "unregister_backend", "get_backend", "parse_device", "canonical_device",
           "private_device_size",
           "open_device", "devices", "default_device", "holds_host_memory", "DEVICE_ENV_VAR"]

#: Names the default device of :func:`default_device` (e.g. ``GPUMEM_DEVICE=opencl:0``).
DEVICE_ENV_VAR = "GPUMEM_DEVICE"
#: The host's memory as a device (CPU fallback serves from it).
HOST_DEVICE = "cpu"

#: The registry: one row per backend, name -> the module holding its ``BACKEND``, in order of
#: preference when listing and when choosing a default device.
_REGISTRY: dict[str, str | Backend] = {
    "cuda": "gpumem.backends.cuda",
    "opencl": "gpumem.backends.opencl",
    "sim": "gpumem.backends.sim",
    "cpu": "gpumem.backends.host",
}
#: The bundled backends' names (:func:`backend_names` includes registered ones too).
BACKEND_NAMES = tuple(_REGISTRY)
_BUNDLED = dict(_REGISTRY)
_backends: dict[str, Backend] = {}
_lock = threading.Lock()
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def backend_names() -> tuple[str, ...]:
    """Every backend's name, bundled and registered, in order of preference."""
    with _lock:
        return tuple(_REGISTRY)


def register_backend(name: str, backend: str | Backend) -> None:
    """Add a backend from outside the package: ``backend`` is a :class:`Backend` or the name of
    a module whose ``BACKEND`` is one (imported on first use). Its devices are then opened by
    ``"<name>:<index>"`` everywhere (MemoryManager, get_manager, the CLI, ``GPUMEM_DEVICE``)
    and listed by :func:`devices`. Registering a name again replaces the row; a bundled
    backend's name is refused (InvalidInputError), as is a bad name or object."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInputError(f"backend name must be lower-case letters, digits and '_', "
                                f"starting with a letter; got {name!r}")
    if name in _BUNDLED:
        raise InvalidInputError(f"{name!r} is a bundled backend; choose another name")
    if not isinstance(backend, (str, Backend)):
        raise InvalidInputError(f"backend must be a gpumem.backends.Backend or a module name, "
                                f"got {type(backend).__name__}")
    if isinstance(backend, Backend) and backend.name != name:
        raise InvalidInputError(f"backend {backend!r} is named {backend.name!r}, not {name!r}")
    with _lock:
        _REGISTRY[name] = backend
        _backends.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend` (bundled ones stay)."""
    if name in _BUNDLED:
        raise InvalidInputError(f"{name!r} is a bundled backend and cannot be removed")
    with _lock:
        if _REGISTRY.pop(name, None) is None:
            raise InvalidInputError(f"no registered backend {name!r}")
        _backends.pop(name, None)


def get_backend(name: str) -> Backend:
    """The backend object for ``name`` (see :func:`backend_names`); it may report itself
    unavailable."""
    with _lock:
        row = _REGISTRY.get(name)
        if row is None:
            raise InvalidDeviceError(
                f"unknown backend {name!r}; backends are {', '.join(_REGISTRY)}")
        backend = _backends.get(name)
        if backend is None:
            backend = row if isinstance(row, Backend) else importlib.import_module(row).BACKEND
            _backends[name] = backend
        return backend


def _split(device: str) -> tuple[str, str, str]:
    if not isinstance(device, str):
        raise InvalidDeviceError(
            f"device must be a string such as 'sim:0', 'cuda:0', 'opencl:0' or 'cpu', "
            f"got {type(device).__name__} {device!r}")
    name, sep, idx = device.strip().partition(":")
    name = name.strip().lower()
    if name not in _REGISTRY:
        raise InvalidDeviceError(
            f"unknown device {device!r}: the backend must be one of "
            f"{', '.join(backend_names())}; devices here: {_device_list()}")
    return name, sep, idx.strip()


def _is_index(idx: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' and '١', which int() refuses."""
    return idx.isascii() and idx.isdigit()


def _is_sim_size(name: str, idx: str) -> bool:
    return name == "sim" and bool(idx) and not _is_index(idx)


def private_device_size(device: str) -> str | None:
    """The size part of a device string naming a new private simulated device (``"sim:80GiB"``
    -> ``"80GiB"``); None for any other string."""
    if not isinstance(device, str):
        return None
    name, _, idx = device.strip().partition(":")
    name, idx = name.strip().lower(), idx.strip()
    return idx if name in _REGISTRY and _is_sim_size(name, idx) else None


def parse_device(device: str) -> tuple[str, int]:
    """Split ``"cuda:1"`` into ``("cuda", 1)``; ``"cpu"`` is ``("cpu", 0)``; ``"sim"`` is sim:0.
    (``"sim:80GiB"`` names no index: see :func:`canonical_device` and :func:`open_device`.)"""
    name, sep, idx = _split(device)
    if not sep:
        return name, 0
    if not _is_index(idx) or len(idx) > 9:
        raise InvalidDeviceError(
            f"device {device!r}: the index after ':' must be a non-negative integer "
            f"(at most 9 digits)")
    return name, int(idx)


def canonical_device(device: str) -> str:
    """The one spelling of a device string: ``" CUDA : 1 "`` -> ``"cuda:1"``, ``"sim"`` ->
    ``"sim:0"``, ``"cpu:0"`` -> ``"cpu"``, ``"sim: 80 GiB"`` -> ``"sim:80GiB"``."""
    name, _, idx = _split(device)
    if _is_sim_size(name, idx):
        from gpumem.backends.sim import SIZE_SPEC
        m = SIZE_SPEC.fullmatch(idx)
        if m is None:
            raise InvalidDeviceError(f"device {device!r}: after 'sim:' give an index (sim:0) or "
                                     f"a size (sim:80GiB)")
        return f"sim:{m.group(1)}{m.group(2)}"
    name, index = parse_device(device)
    return HOST_DEVICE if (name, index) == (HOST_DEVICE, 0) else f"{name}:{index}"


def open_device(device: str) -> Device:
    """Open a device by its string; InvalidDeviceError lists the devices that exist.
    ``"sim:<size>"`` opens a new private simulated device of that size."""
    name, _, idx = _split(device)
    if _is_sim_size(name, idx):
        from gpumem.backends.sim import open_private
        return open_private(idx)
    name, index = parse_device(device)
    backend = get_backend(name)
    ok, reason = backend.availability()
    if not ok:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    if name == "sim":
        return backend.open(index)      # explicit "sim:0" may open the demo device; it lists
    count = backend.device_count()
    if index >= count:
        raise InvalidDeviceError(
            f"no device {device!r}: backend {name!r} has {count} device(s); "
            f"devices here: {_device_list()}")
    return backend.open(index)


def devices() -> list[DeviceDescription]:
    """Every device of every backend, with an 'unavailable' row (and reason) per missing one."""
    rows: list[DeviceDescription] = []
    for name in backend_names():
        try:
            rows.extend(get_backend(name).describe())
        except Exception as exc:  # a broken driver must not hide the other backends
            rows.append(DeviceDescription(device=name, backend=name, available=False,
                                          reason=f"{type(exc).__name__}: {exc}"))
    return rows


def _device_list() -> str:
    names = [d.device for d in devices() if d.available]
    return ", ".join(names) if names else "none"


def holds_host_memory(device: Device) -> bool:
    """True for devices whose memory is the host's (:attr:`Device.holds_host_memory`: ``cpu``,
    CPU-type OpenCL devices such as PoCL). Such a device ranks after every accelerator when a
    device is chosen automatically."""
    return device.holds_host_memory


def _opencl_gpu() -> str | None:
    backend = get_backend("opencl")
    if not backend.availability()[0]:
        return None
    for i in range(backend.device_count()):
        dev = backend.open(i)
        try:
            on_host = dev.holds_host_memory
        finally:
            dev.close()
        if not on_host:
            return dev.device_string
    return None


def default_device() -> str:
    """The device used when none is named (``MemoryManager()``, ``gpumem.get_manager()``):
    ``GPUMEM_DEVICE`` if set; else the first CUDA device; else the first OpenCL GPU; else
    ``sim:0`` only when simulated devices are installed (``gpumem_sim.install`` or
    ``GPUMEM_SIM_DEVICES``). Otherwise InvalidDeviceError listing :func:`devices`: a simulated
    device, or the CPU, is never chosen silently."""
    env = os.environ.get(DEVICE_ENV_VAR)
    if env is not None and env.strip():
        try:
            return canonical_device(env)
        except InvalidDeviceError as exc:
            raise InvalidDeviceError(f"{DEVICE_ENV_VAR}={env!r}: {exc}") from None
    cuda = get_backend("cuda")
    try:
        if cuda.availability()[0] and cuda.device_count() > 0:
            return "cuda:0"
    except Exception:
        pass                       # a broken driver must not hide the other backends
    try:
        gpu = _opencl_gpu()
    except Exception:
        gpu = None
    if gpu is not None:
        return gpu
    import gpumem_sim
    if gpumem_sim.installed():
        return "sim:0"
    listing = "; ".join(f"{d.device}: {d.reason}" if not d.available else
                        f"{d.device} ({d.name}{', simulated' if d.simulated else ''})"
                        for d in devices())
    raise InvalidDeviceError(
        f"no default device: no CUDA device, no OpenCL GPU and no installed simulated device. "
        f"Name one (MemoryManager('cpu'), get_manager('opencl:0')), set {DEVICE_ENV_VAR}, or "
        f"install simulated devices (gpumem_sim.install, GPUMEM_SIM_DEVICES). Devices: {listing}")
