"""Backend registry: device strings ("cuda:0", "opencl:1", "sim:0", "sim:80GiB", "cpu") to
opened devices, and the default device.

Backends are imported lazily so that importing gpumem never fails for a missing driver or
package; an unavailable backend is listed by :func:`devices` with its reason.

A device string means the same everywhere (API, CLI, ``GPUMEM_DEVICE``): ``"sim:<size>"`` is a
new private simulated device of that size; ``"sim:N"`` an installed one (see gpumem_sim).
:func:`default_device` never picks a simulated device that was not installed.
"""
from __future__ import annotations

import importlib
import os
import threading

from gpumem.backends.base import Backend, Device, DeviceDescription, DeviceProperties
from gpumem.errors import BackendUnavailableError, InvalidDeviceError

__all__ = ["Backend", "Device", "DeviceDescription", "DeviceProperties", "BACKEND_NAMES",
           "get_backend", "parse_device", "canonical_device", "open_device", "devices",
           "default_device", "holds_host_memory", "DEVICE_ENV_VAR"]

#: Names the default device of :func:`default_device` (e.g. ``GPUMEM_DEVICE=opencl:0``).
DEVICE_ENV_VAR = "GPUMEM_DEVICE"

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


def _split(device: str) -> tuple[str, str, str]:
    if not isinstance(device, str):
        raise InvalidDeviceError(
            f"device must be a string such as 'sim:0', 'cuda:0', 'opencl:0' or 'cpu', "
            f"got {type(device).__name__} {device!r}")
    name, sep, idx = device.strip().partition(":")
    name = name.strip().lower()
    if name not in _MODULES:
        raise InvalidDeviceError(
            f"unknown device {device!r}: the backend must be one of {', '.join(BACKEND_NAMES)}; "
            f"devices here: {_device_list()}")
    return name, sep, idx.strip()


def _is_index(idx: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' and '١', which int() refuses."""
    return idx.isascii() and idx.isdigit()


def _is_sim_size(name: str, idx: str) -> bool:
    return name == "sim" and bool(idx) and not _is_index(idx)


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
    return "cpu" if (name, index) == ("cpu", 0) else f"{name}:{index}"


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


def holds_host_memory(device: Device) -> bool:
    """True for devices whose memory is the host's: ``cpu`` and CPU-type OpenCL devices (PoCL).
    Such a device ranks after every accelerator when a device is chosen automatically."""
    if device.backend == "cpu":
        return True
    if device.backend == "opencl":
        try:
            kind = str(device.properties().extra.get("device_type", ""))
        except Exception:
            return False
        return "CPU" in kind.upper() and "GPU" not in kind.upper()
    return False


def _opencl_gpu() -> str | None:
    backend = get_backend("opencl")
    if not backend.availability()[0]:
        return None
    for i in range(backend.device_count()):
        dev = backend.open(i)
        try:
            kind = str(dev.properties().extra.get("device_type", "")).upper()
        finally:
            dev.close()
        if "GPU" in kind:
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
