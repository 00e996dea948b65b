"""Process-wide managers: one shared :class:`MemoryManager` per device.

Every part of a program (a framework allocator, a Dask worker plug-in, user code) that asks
``get_manager("cuda:0")`` gets the same manager, so they share one cache instead of each holding
its own::

    mm = gpumem.get_manager()              # the default device's shared manager
    gpumem.configure("cuda:0", gpu_memory_fraction=0.8)   # replace it (like rmm.reinitialize)
    gpumem.get_manager("cuda:0").reconfigure(gpu_memory_fraction=0.8)   # or change it in place

Managers built directly with ``MemoryManager(...)`` are not shared and keep working as before;
all managers on one device still help each other when one runs out of memory (gpumem.placement.peers).

Thread safety: the registry (``_shared``: canonical device string -> manager, and ``_fast``:
the device argument as given -> manager) is owned by this module and guarded by ``_lock``, one
``threading.Lock``. Every write happens under the lock; a manager is created and a replaced one
closed while it is held, so two threads asking at once get the same object and a ``configure``
is never half seen (``get_manager`` for another device waits meanwhile, once per device). The
one read without the lock is ``get_manager``'s fast path: a single ``dict.get`` on ``_fast``
(atomic under the GIL) of a manager that is then checked to be open, so a repeat call costs a
lookup, not a parse of the device string (framework allocators call it per allocation).
Nothing else takes ``_lock``: managers do not call into this module, so neither their
``__del__`` nor their OOM ladder can wait for it.

``get_manager()`` resolves the default device once and remembers it (in ``_fast[None]``) until
``configure`` or ``close_shared_managers`` runs: setting ``GPUMEM_DEVICE`` later does not move
an existing default manager.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterable, Iterator

from gpumem.backends import canonical_device, default_device
from gpumem.config import MemoryConfig
from gpumem.errors import InvalidInputError
from gpumem.manager.memory_manager import MemoryManager

__all__ = ["get_manager", "configure", "shared_managers", "close_shared_managers"]

_lock = threading.Lock()
_shared: dict[str, MemoryManager] = {}
_fast: dict[str | None, MemoryManager] = {}     # spelling as given -> its shared manager
#: MemoryConfig changes for the shared managers made on these canonical devices (the pytest
#: plug-in turns tracking on, so that a leak report names tags); set by config_changes_for
_changes: dict[str, dict[str, Any]] = {}


def _key(device: str | None) -> str:
    if device is None:
        return default_device()
    if not isinstance(device, str):
        raise InvalidInputError(
            f"device must be a device string such as 'cuda:0', 'opencl:0', 'cpu' or 'sim:0', or "
            f"None for the default device; got {type(device).__name__} {device!r}")
    return canonical_device(device)


def get_manager(device: str | None = None) -> MemoryManager:
    """The shared manager of ``device`` (None: ``gpumem.backends.default_device()``), created on
    first use with ``MemoryConfig.from_env()``. Device strings are compared in their canonical
    spelling (``"CUDA:0"`` and ``"cuda:0"`` share one manager). A shared manager that was closed
    is replaced by a new one on the next call."""
    try:
        mgr = _fast.get(device)                   # no lock: one atomic dict read
    except TypeError:                             # unhashable: _key raises the clear error
        mgr = None
    if mgr is not None and not mgr._closed:       # the C attribute: no property call
        return mgr
    key = _key(device)
    with _lock:
        mgr = _shared.get(key)
        if mgr is None or mgr.closed:
            mgr = MemoryManager(key, MemoryConfig.from_env().replace(**_changes.get(key, {})))
            _shared[key] = mgr
        _fast[device] = mgr
        return mgr


def configure(device: str | None = None, config: MemoryConfig | None = None, *,
              force: bool = False, **knobs: Any) -> MemoryManager:
    """Replace ``device``'s shared manager by a new one with ``config`` (None:
    ``MemoryConfig.from_env()``) changed by ``knobs`` (MemoryConfig fields, e.g.
    ``gpu_memory_fraction=0.8``); returns the new manager.

    The old manager is closed (its cache goes back to the driver). While it still has live
    buffers this is refused with InvalidInputError, unless ``force=True``: then those buffers
    become invalid. On any error nothing changes.
    """
    if config is not None and not isinstance(config, MemoryConfig):
        raise InvalidInputError(
            f"config must be a MemoryConfig (or None for MemoryConfig.from_env()), got "
            f"{type(config).__name__}")
    if not isinstance(force, bool):
        raise InvalidInputError(f"force must be True or False, got {force!r}")
    key = _key(device)
    cfg = config if config is not None else MemoryConfig.from_env()
    if knobs:
        cfg = cfg.replace(**knobs)          # unknown or invalid knobs: InvalidInputError
    extra = {k: v for k, v in _changes.get(key, {}).items() if k not in knobs}
    if extra:
        cfg = cfg.replace(**extra)
    with _lock:
        old = _shared.get(key)
        if old is not None and not old.closed and not force:
            live = old.stats().active_buffers
            if live:
                raise InvalidInputError(
                    f"configure({key!r}): the shared manager still has {live} live buffer(s); "
                    f"free them first, or pass force=True to invalidate them (a setting a live "
                    f"manager can change: get_manager({key!r}).reconfigure(...) keeps them)")
        mgr = MemoryManager(key, cfg)       # made before the old one closes: a failure keeps it
        _shared[key] = mgr
        _fast.clear()                       # other spellings (and None) are looked up again
        if old is not None:
            old.close()
        return mgr


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()          # another parent thread may have held it at fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def config_changes_for(devices: Iterable[str], **changes: Any) -> Iterator[None]:
    """While inside, every shared manager made for ``devices`` (by get_manager, or configure
    where its knobs do not name the field) gets these MemoryConfig ``changes``. The pytest
    plug-in's devices use it to turn tracking on, so that a leak names its buffers."""
    keys = [_key(d) for d in devices]
    MemoryConfig().replace(**changes)       # unknown or invalid changes fail here
    with _lock:
        before = {k: _changes.get(k) for k in keys}
        for k in keys:
            _changes[k] = dict(changes)
    try:
        yield
    finally:
        with _lock:
            for k, old in before.items():
                if old is None:
                    _changes.pop(k, None)
                else:
                    _changes[k] = old


def shared_managers() -> dict[str, MemoryManager]:
    """The open shared managers by canonical device string (a copy)."""
    with _lock:
        return {k: m for k, m in _shared.items() if not m.closed}


def close_shared_managers() -> int:
    """Close every shared manager and forget them (the next ``get_manager`` makes new ones);
    how many were open. For the end of a test, or before a fork."""
    with _lock:
        managers = list(_shared.values())
        _shared.clear()
        _fast.clear()
        open_ones = [m for m in managers if not m.closed]
        for m in open_ones:
            m.close()
    return len(open_ones)
