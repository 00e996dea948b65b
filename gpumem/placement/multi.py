"""MultiDeviceManager: one MemoryManager per device, placement policies and name affinity.

Example::

    with MultiDeviceManager(["sim:0", "sim:1"], policy="most_free") as multi:
        w = multi.allocate_on_best_device(1 << 30, name="layer0")   # placed by the policy
        kv = multi.allocate_on_best_device(1 << 28, name="layer0")  # same device as w
        multi.free(kv)

Placement policies (``policy=``):

``"most_free"`` (default)
    The device with the most room, ``hold_limit - in_use_bytes`` of its
    manager: bytes the manager may still hand out, counting its cached free bytes as free. Read
    from the pool's counters: no driver call. Ties go to the earlier device.
``"least_pressure"``
    The device with the lowest :meth:`MemoryManager.pressure_ratio` (reserved over usable).
``"round_robin"``
    Each device in turn.
a callable ``policy(managers, nbytes) -> index``
    Any function of the list of open managers (in device order) and the request size that
    returns the index of the manager to use.

A *name* pins placement: the first allocation under a name fixes its device, later ones go to
the same device whatever the policy says (``affinity(name)``, ``unpin(name)``).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Hashable, Iterable, Sequence

from gpumem._core.buffer import Buffer
from gpumem._core.manager_core import PlacementCore
from gpumem.config import MemoryConfig
from gpumem.errors import (ClosedManagerError, ForeignBufferError, InvalidDeviceError,
                           InvalidInputError)
from gpumem.manager.fallback import FallbackBuffer
from gpumem.manager.live_config import check_live_change
from gpumem.manager.memory_manager import MemoryManager
from gpumem.stats import MemoryStats

__all__ = ["MultiDeviceManager", "PlacementPolicy", "POLICIES"]

#: ``policy(managers, nbytes) -> index`` into ``managers`` (the open managers, in device order).
PlacementPolicy = Callable[[Sequence[MemoryManager], int], int]

#: The built-in policy names.
POLICIES = ("most_free", "least_pressure", "round_robin")

def _available_devices() -> list[str]:
    """Every available device whose memory is not the host's (accelerators, installed
    simulated devices)."""
    from gpumem.backends import DeviceKind, devices
    return [d.device for d in devices() if d.available and d.kind is not DeviceKind.HOST]


class MultiDeviceManager(PlacementCore):
    """A MemoryManager per device with one placement entry point.

    ``devices``: ``None`` (every available cuda and opencl device, and the *installed* sim
    devices: a simulated device is never used unless asked for; no cpu), or a list of
    device strings (a manager is created for each, with ``config``) and/or MemoryManagers (used
    as they are). Managers it created are closed by :meth:`close`; managers passed in belong to
    the caller and are left open.
    """

    def __init__(self, devices: Iterable[str | MemoryManager] | None = None,
                 config: MemoryConfig | None = None,
                 policy: str | PlacementPolicy = "most_free") -> None:
        if config is not None and not isinstance(config, MemoryConfig):
            raise InvalidInputError(
                f"config must be a MemoryConfig (or None), got {type(config).__name__}")
        choose = self._policy_function(policy)          # validated before any manager exists
        if devices is None:
            items: list[Any] = _available_devices()
            if not items:
                raise InvalidDeviceError("no cuda, opencl or sim device is available "
                                         "(see gpumem.devices())")
        elif isinstance(devices, (str, MemoryManager)):
            items = [devices]
        else:
            try:
                items = list(devices)
            except TypeError:
                raise InvalidInputError(
                    f"devices must be None or a list of device strings / MemoryManagers, got "
                    f"{type(devices).__name__}") from None
        if not items:
            raise InvalidInputError("devices is empty: give at least one device string or "
                                    "MemoryManager (or None for every available device)")
        for i, item in enumerate(items):
            if isinstance(item, MemoryManager):
                if item.closed:
                    raise ClosedManagerError(f"devices[{i}]: the manager for "
                                             f"{item.device_string} is closed")
            elif not isinstance(item, str):
                raise InvalidInputError(f"devices[{i}] must be a device string or a "
                                        f"MemoryManager, got {type(item).__name__} {item!r}")
        managers: list[MemoryManager] = []
        owned: list[MemoryManager] = []
        try:
            for item in items:
                if isinstance(item, MemoryManager):
                    managers.append(item)
                else:
                    mgr = MemoryManager(item, config)
                    owned.append(mgr)
                    managers.append(mgr)
            seen: dict[str, int] = {}
            for i, mgr in enumerate(managers):
                if mgr.device_string in seen:
                    first = seen[mgr.device_string]
                    raise InvalidInputError(
                        f"device {mgr.device_string} is given twice (devices[{first}] and "
                        f"devices[{i}]); one manager per device")
                seen[mgr.device_string] = i
        except BaseException:
            for mgr in owned:
                mgr.close()
            raise
        self._managers: tuple[MemoryManager, ...] = tuple(managers)
        self._owned = frozenset(id(m) for m in owned)
        self._by_device = {m.device_string: m for m in managers}
        self._set_members(self._managers)
        self._policy = policy
        self._choose = choose
        self._affinity: dict[Hashable, MemoryManager] = {}
        self._lock = threading.Lock()
        self._rr = itertools.count()
        self._closed = False
        self._refresh()

    # --- policies --------------------------------------------------------------------------
    def _policy_function(self, policy: Any) -> Callable[[int], MemoryManager]:
        if isinstance(policy, str):
            if policy == "most_free":
                return self._most_free
            if policy == "least_pressure":
                return self._least_pressure
            if policy == "round_robin":
                return self._round_robin
            raise InvalidInputError(f"unknown placement policy {policy!r}; policies are "
                                    f"{', '.join(map(repr, POLICIES))} or a callable "
                                    f"policy(managers, nbytes) -> index")
        if callable(policy):
            return lambda nbytes: self._custom(policy, nbytes)
        raise InvalidInputError(f"policy must be one of {', '.join(map(repr, POLICIES))} or a "
                                f"callable policy(managers, nbytes) -> index, got {policy!r}")

    def _refresh(self) -> None:
        """Recompute the open managers (after a manager was found closed)."""
        active = tuple(m for m in self._managers if not m.closed)
        self._active = active
        # usable memory is read at each placement: a manager may be reconfigured meanwhile
        self._counters = tuple((m, m.pool) for m in active)
        self._fast = self._policy == "most_free" and bool(active) and not self._closed
        self._set_fast_path(active if self._fast else None)

    def _most_free(self, nbytes: int) -> MemoryManager:
        best = None
        best_free = -1
        for mgr, pool in self._counters:
            free = mgr.hold_limit - pool.in_use_bytes
            if free > best_free:
                best, best_free = mgr, free
        if best is None:
            raise self._all_closed()
        return best

    def _least_pressure(self, nbytes: int) -> MemoryManager:
        if not self._active:
            raise self._all_closed()
        return min(self._active, key=MemoryManager.pressure_ratio)

    def _round_robin(self, nbytes: int) -> MemoryManager:
        active = self._active
        if not active:
            raise self._all_closed()
        return active[next(self._rr) % len(active)]

    def _custom(self, policy: PlacementPolicy, nbytes: int) -> MemoryManager:
        active = self._active
        if not active:
            raise self._all_closed()
        index = policy(list(active), nbytes)
        if isinstance(index, bool) or not hasattr(index, "__index__") \
                or not 0 <= int(index) < len(active):
            raise InvalidInputError(f"placement policy {policy!r} returned {index!r}; it must "
                                    f"return an index in [0, {len(active)}) into the managers")
        return active[int(index)]

    def _all_closed(self) -> ClosedManagerError:
        return ClosedManagerError("every manager of this MultiDeviceManager is closed")

    @property
    def policy(self) -> str | PlacementPolicy:
        return self._policy

    def set_policy(self, policy: str | PlacementPolicy) -> None:
        """Change the placement policy (pinned names keep their devices)."""
        self._choose = self._policy_function(policy)
        self._policy = policy
        self._refresh()

    # --- allocation --------------------------------------------------------------------------
    def _allocate(self, nbytes: Any, name: Hashable | None, stream: Any, tag: Any) -> Any:
        if self._closed:
            raise ClosedManagerError("this MultiDeviceManager is closed")
        if name is not None:
            mgr = self._affinity.get(name)
            if mgr is not None:
                if mgr.closed:
                    raise ClosedManagerError(
                        f"{name!r} is pinned to {mgr.device_string}, whose manager is closed; "
                        f"unpin({name!r}) to place it again")
                return mgr.malloc(nbytes, stream=stream, tag=tag)
        if type(nbytes) is not int or nbytes < 0:
            nbytes = self._size(nbytes)           # a bad size changes nothing (round robin)
        if any(m.closed for m in self._active):
            self._refresh()
        mgr = self._choose(nbytes)
        buf = mgr.malloc(nbytes, stream=stream, tag=tag)
        if name is not None:
            with self._lock:
                pinned = self._affinity.setdefault(name, mgr)
            if pinned is not mgr:                  # another thread pinned it first
                buf.free()
                return self._allocate(nbytes, name, stream, tag)
        return buf

    @staticmethod
    def _size(nbytes: Any) -> int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__} {nbytes!r}")
        n = int(nbytes)
        if n < 0:
            raise InvalidInputError(f"nbytes must be >= 0, got {n}")
        return n

    def _free_other(self, buf: Buffer | FallbackBuffer) -> None:
        """free() for what PlacementCore.free does not handle at C speed: fallback buffers,
        foreign buffers (an error) and wrong types."""
        if isinstance(buf, (Buffer, FallbackBuffer)):
            mgr = buf.manager
        else:
            raise TypeError(f"free() takes a gpumem Buffer, got {type(buf).__name__}")
        if self._by_device.get(mgr.device_string) is not mgr:
            raise ForeignBufferError(f"buffer {buf.id} was not allocated by this "
                                     f"MultiDeviceManager's managers (it is on "
                                     f"{mgr.device_string})")
        mgr.free(buf)

    # --- affinity ------------------------------------------------------------------------------
    def affinity(self, name: Hashable) -> str | None:
        """The device string ``name`` is pinned to, or None."""
        mgr = self._affinity.get(name)
        return None if mgr is None else mgr.device_string

    def pin(self, name: Hashable, device: str | int) -> None:
        """Pin ``name`` to a device before its first allocation (or move the pin)."""
        mgr = self.manager(device)
        if mgr.closed:
            raise ClosedManagerError(f"cannot pin {name!r} to {mgr.device_string}: its manager "
                                     f"is closed")
        with self._lock:
            self._affinity[name] = mgr

    def unpin(self, name: Hashable) -> bool:
        """Forget the device of ``name``; True if it was pinned."""
        with self._lock:
            return self._affinity.pop(name, None) is not None

    # --- managers and statistics ------------------------------------------------------------------
    @property
    def managers(self) -> list[MemoryManager]:
        """Every manager, in device order (closed ones included)."""
        return list(self._managers)

    @property
    def devices(self) -> list[str]:
        return [m.device_string for m in self._managers]

    def manager(self, device: str | int) -> MemoryManager:
        """The manager of a device string (``"sim:1"``) or of a position in :attr:`devices`."""
        if isinstance(device, str):
            mgr = self._by_device.get(device.strip().lower())
            if mgr is not None:
                return mgr
        elif not isinstance(device, bool) and hasattr(device, "__index__"):
            i = int(device)
            if 0 <= i < len(self._managers):
                return self._managers[i]
        raise InvalidDeviceError(f"no device {device!r} in this MultiDeviceManager; its devices "
                                 f"are {', '.join(self.devices)}")

    def __len__(self) -> int:
        return len(self._managers)

    def __iter__(self):
        return iter(self._managers)

    def stats(self) -> dict[str, MemoryStats]:
        """``{device string: MemoryStats}`` for every manager."""
        return {m.device_string: m.stats() for m in self._managers}

    def total_memory_usage(self) -> tuple[int, int]:
        """``(in use bytes, peak in-use bytes)`` summed over the devices. The summed peak is an
        upper bound: the devices may have peaked at different times."""
        allocated = peak = 0
        for m in self._managers:
            allocated += m.pool.in_use_bytes
            peak += m.peaks()[0]
        return allocated, peak

    def emergency_cleanup_all(self) -> int:
        """``emergency_cleanup()`` on every open manager; the bytes released in all."""
        return sum(m.emergency_cleanup() for m in self._managers if not m.closed)

    def empty_cache(self) -> int:
        """``empty_cache()`` on every open manager; the bytes released in all."""
        return sum(m.empty_cache() for m in self._managers if not m.closed)

    def reconfigure(self, **changes: Any) -> None:
        """``reconfigure(**changes)`` on every open manager (MemoryManager.reconfigure), all or
        none: every manager's new config is checked before any changes, so a field one of them
        refuses (a segment size, an invalid value) raises InvalidInputError and changes
        nothing."""
        active = [m for m in self._managers if not m.closed]
        if not active:
            raise self._all_closed()
        for m in active:
            check_live_change(m.config, m.config.replace(**changes))
        for m in active:
            m.reconfigure(**changes)

    # --- lifetime ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the managers this object created (those passed in stay open). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for m in self._managers:
            if id(m) in self._owned:
                m.close()
        self._refresh()

    def __enter__(self) -> "MultiDeviceManager":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"policy {self._policy!r}"
        return f"<gpumem.MultiDeviceManager {', '.join(self.devices)}; {state}>"
