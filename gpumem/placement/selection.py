"""Choosing a device for a model: which available device can hold it, with the most room.

Example::

    from gpumem.planning.estimate import estimate_model
    from gpumem.placement.selection import select_backend_for_model

    est = estimate_model("llama-2-7b", seq_len=4096)
    backend, index = select_backend_for_model(est)       # e.g. ("cuda", 0)
    mm = gpumem.MemoryManager(f"{backend}:{index}")
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable

from gpumem.backends import Device, DeviceKind, backend_names, get_backend, open_device
from gpumem.config import MemoryConfig
from gpumem.errors import InvalidDeviceError, InvalidInputError, OutOfMemoryError
from gpumem.manager.limits import hard_min_free, hold_limit
from gpumem.planning.estimate import MemoryEstimate
from gpumem.units import format_bytes

__all__ = ["DeviceRoom", "device_room", "select_backend_for_model"]


@dataclass(frozen=True)
class DeviceRoom:
    """What a fresh MemoryManager with a given config could hold on one device.

    ``usable = min(total * gpu_memory_fraction, total - reserve)`` as in MemoryManager, and
    ``room = min(hold, free - min_free_bytes)`` (never below 0) where ``hold`` is the config's
    hard cap (else the device's total) and ``min_free_bytes`` counts only when hard: soft
    limits (the defaults) never refuse what the device can hold. ``host_memory``: the device's memory is the host's (``cpu``, a
    CPU-type OpenCL device such as PoCL).
    """

    device: str
    backend: str
    index: int
    free: int
    total: int
    usable: int
    room: int
    host_memory: bool = False

    def describe(self) -> str:
        return (f"{self.device}{' (host memory)' if self.host_memory else ''}: free "
                f"{format_bytes(self.free)} of {format_bytes(self.total)}, "
                f"usable {format_bytes(self.usable)}, room {format_bytes(self.room)}")


def device_room(device: str | Device, config: MemoryConfig | None = None) -> DeviceRoom:
    """The :class:`DeviceRoom` of one device (a device string or an opened Device)."""
    cfg = _config(config)
    if isinstance(device, Device):
        return _room(device, cfg)
    dev = open_device(device)
    try:
        return _room(dev, cfg)
    finally:
        dev.close()


def _config(config: Any) -> MemoryConfig:
    if config is None:
        return MemoryConfig.from_env()
    if not isinstance(config, MemoryConfig):
        raise InvalidInputError(
            f"config must be a MemoryConfig (or None), got {type(config).__name__}")
    return config


def _room(dev: Device, cfg: MemoryConfig) -> DeviceRoom:
    free, total = dev.mem_get_info()
    reserve = cfg.reserve_bytes
    if reserve is None:
        reserve = dev.recommended_reserve(total)
    usable = max(0, min(int(total * cfg.gpu_memory_fraction), total - reserve))
    # what a manager with cfg can hold there: its hard limits bound it, the soft ones do not
    hold = hold_limit(cfg, total)
    room = max(0, min(total if hold is None else hold, free - hard_min_free(cfg)))
    return DeviceRoom(device=dev.device_string, backend=dev.backend, index=dev.index,
                      free=free, total=total, usable=usable, room=room,
                      host_memory=dev.holds_host_memory)


def _requested(total_bytes: Any) -> int:
    if isinstance(total_bytes, MemoryEstimate):
        return total_bytes.total_bytes
    if isinstance(total_bytes, bool) or not hasattr(type(total_bytes), "__index__"):
        raise InvalidInputError(
            f"total_bytes must be an int number of bytes or a MemoryEstimate, got "
            f"{type(total_bytes).__name__} {total_bytes!r}")
    n = operator.index(total_bytes)
    if n < 0:
        raise InvalidInputError(f"total_bytes must be >= 0, got {n}")
    return n


def _open_all(devices: Iterable[str | Device] | None) -> list[tuple[Device, bool]]:
    """(device, opened here) for the candidates, in order."""
    out: list[tuple[Device, bool]] = []
    try:
        if devices is None:
            for name in backend_names():     # every backend whose memory is not the host's
                try:
                    backend = get_backend(name)
                    if backend.kind is DeviceKind.HOST:
                        continue
                    ok, _ = backend.availability()
                    if not ok:
                        continue
                    for i in range(backend.device_count()):
                        out.append((backend.open(i), True))
                except Exception:
                    continue          # a broken backend must not hide the others
            return out
        if isinstance(devices, (str, Device)):
            devices = [devices]
        for i, d in enumerate(devices):
            if isinstance(d, Device):
                out.append((d, False))
            elif isinstance(d, str):
                out.append((open_device(d), True))
            else:
                raise InvalidInputError(f"devices[{i}] must be a device string or a Device, "
                                        f"got {type(d).__name__} {d!r}")
        return out
    except BaseException:
        _close_all(out)
        raise


def _close_all(opened: list[tuple[Device, bool]]) -> None:
    for dev, mine in opened:
        if mine:
            try:
                dev.close()
            except Exception:
                pass


def select_backend_for_model(total_bytes: int | MemoryEstimate, *,
                             config: MemoryConfig | None = None,
                             devices: Iterable[str | Device] | None = None) -> tuple[str, int]:
    """``(backend, index)`` of the device with the most room that can hold ``total_bytes``.

    ``total_bytes``: an int, or a :class:`gpumem.planning.estimate.MemoryEstimate` (its ``total_bytes``).
    ``devices``: device strings or Devices to consider; None means every available cuda and
    opencl device and the *installed* sim devices (a simulated device is never chosen unless
    asked for; the CPU is considered only when listed). A device's room is what a fresh
    MemoryManager with ``config`` could hold there (see :class:`DeviceRoom`): within usable
    memory, and leaving ``min_free_bytes`` free by the driver's ``mem_get_info``.

    Accelerators come first: a device whose memory is the host's (a CPU-type OpenCL device such
    as PoCL, the CPU) is chosen only when no cuda, OpenCL-GPU or sim device can hold the model.
    Within a rank the device with the most room wins; ties go to the earlier device (cuda
    before opencl before sim).

    Raises OutOfMemoryError when no device has room (its message lists every device with its
    free memory), InvalidDeviceError when there is no device at all, InvalidInputError for a
    negative, bool or non-integer size.
    """
    requested = _requested(total_bytes)
    cfg = _config(config)
    opened = _open_all(devices)
    try:
        rooms = [_room(dev, cfg) for dev, _ in opened]
    finally:
        _close_all(opened)
    if not rooms:
        raise InvalidDeviceError("no device to choose from: no cuda, opencl or sim device is "
                                 "available (see gpumem.devices())" if devices is None
                                 else "devices is empty")
    best = None
    for r in rooms:            # rank: accelerator before host memory, then most room
        if r.room >= requested and (best is None or (not r.host_memory, r.room)
                                    > (not best.host_memory, best.room)):
            best = r
    if best is not None:
        return best.backend, best.index
    widest = max(rooms, key=lambda r: r.room)
    listing = "; ".join(r.describe() for r in rooms)
    raise OutOfMemoryError(
        requested, device=", ".join(r.device for r in rooms), free=widest.free,
        total=widest.total, limit=widest.room,
        reason=f"no device can hold {format_bytes(requested)} with min_free_bytes "
               f"{format_bytes(cfg.min_free_bytes)} and gpu_memory_fraction "
               f"{cfg.gpu_memory_fraction}: {listing} (lower min_free_bytes or raise "
               f"gpu_memory_fraction: MemoryConfig(min_free_bytes=..., gpu_memory_fraction=...)"
               f" or GPUMEM_MIN_FREE_BYTES / GPUMEM_GPU_MEMORY_FRACTION)")
