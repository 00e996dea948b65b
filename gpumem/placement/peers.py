"""Every MemoryManager of this process, by physical device, for the cross-manager OOM rung.

Two managers on one device (a shared one from ``gpumem.get_manager`` and one a library built
with ``MemoryManager(...)``) compete for the same driver memory. When one of them cannot grow,
its OOM ladder calls :func:`release_peer_caches`: every other open manager on the same device
gives its wholly free cached segments back to the driver, then the ladder retries growth.

Thread safety: the registry (``_peers``: device key -> weak references to managers) is owned by
this module and guarded by ``_lock``, one ``threading.Lock``. Under it only dict and list work
runs: no manager method, no driver call. Weak references carry no callbacks (dead ones are
pruned under the lock on the next access), so a manager's ``__del__`` never touches this module
and never waits for ``_lock``.

Fork: just before fork() the forking thread takes ``_lock`` and every open manager's pool locks
(C spin locks that a thread without the GIL may hold, e.g. torch's allocator threads), and
releases them in both processes afterwards; a child never inherits a lock held by a thread it
does not have, nor a pool halfway through an update.

A peer is asked only if its own slow-path lock is free at that moment (a non-blocking acquire):
two managers running out of memory at once never wait for each other, so no lock-order deadlock
is possible; a busy peer is skipped.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Hashable, Protocol

from gpumem.backends.base import DeviceKind

if TYPE_CHECKING:
    from gpumem._core.pool import CachingPool
    from gpumem.backends import Device

__all__ = ["Peer", "register", "peers_of", "release_peer_caches"]

log = logging.getLogger("gpumem")



class Peer(Protocol):
    """What the registry calls of a manager (MemoryManager implements it): this module sits
    below the manager and never imports it."""

    @property
    def device(self) -> Device: ...
    @property
    def device_string(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def pool(self) -> CachingPool: ...
    def release_idle_cache(self, reason: str = "") -> int: ...
    def _after_fork_in_child(self) -> None: ...


_lock = threading.Lock()
_peers: dict[Hashable, list[weakref.ref]] = {}


def _device_key(device: Device) -> Hashable:
    """Managers with equal keys share driver memory. A simulated device is an object of its own
    (two SimDevices may both have been "sim:0"), so it is keyed by identity; a real device is
    named by its string within a process. The key holds no reference to the device."""
    if device.kind is DeviceKind.SIMULATED:
        return ("simulated", id(device))
    return device.device_string


def register(manager: Peer) -> None:
    """Called once by every MemoryManager as it is created."""
    key = _device_key(manager.device)
    ref = weakref.ref(manager)
    with _lock:
        refs = [r for r in _peers.get(key, ()) if r() is not None]
        refs.append(ref)
        _peers[key] = refs
        # prune keys whose managers are all gone (a device key can then be reused safely)
        for k in [k for k, rs in _peers.items() if all(r() is None for r in rs)]:
            del _peers[k]


def peers_of(manager: Peer) -> list[Peer]:
    """The other open managers of this process on ``manager``'s device, oldest first."""
    key = _device_key(manager.device)
    with _lock:
        live = [r() for r in _peers.get(key, ())]
    return [m for m in live if m is not None and m is not manager and not m.closed]


def open_managers() -> list[Peer]:
    """Every open manager of this process, on any device (``gpumem info`` reads their
    sleeping tags)."""
    with _lock:
        live = [r() for refs in _peers.values() for r in refs]
    return [m for m in live if m is not None and not m.closed]


def release_peer_caches(manager: Peer) -> int:
    """Ask every peer of ``manager`` (:func:`peers_of`) whose slow path is free to release its
    wholly free cached segments; the bytes they gave back to the driver."""
    released = 0
    for peer in peers_of(manager):
        try:                                      # a peer busy in its slow path gives 0 at once
            released += peer.release_idle_cache(
                reason=f"a peer manager on {manager.device_string} is out of memory")
        except Exception as exc:  # one peer's driver failure must not fail this allocation
            log.warning("%s: a peer manager could not release its cache: %s",
                        manager.device_string, exc)
    if released:
        log.info("%s: peer managers released %d bytes of cached segments",
                 manager.device_string, released)
    return released


_held_for_fork: list = []      # the pools whose C locks the forking thread holds


def _before_fork() -> None:
    """Take the registry lock and every open manager's pool locks (gpumem/_core/pool.pyx
    ``_hold_for_fork``), so that no thread is inside a pool when fork() copies it. Locks of
    different pools are never nested elsewhere, so taking them one after another cannot
    deadlock."""
    _lock.acquire()
    for refs in _peers.values():
        for ref in refs:
            manager = ref()
            if manager is not None and not manager.closed:
                manager.pool._hold_for_fork()
                _held_for_fork.append(manager.pool)


def _release_held() -> None:
    for pool in _held_for_fork:
        pool._release_after_fork()
    _held_for_fork.clear()


def _after_fork_in_parent() -> None:
    _release_held()
    _lock.release()


def _after_fork_in_child() -> None:
    """Only the forking thread exists in a child: the pool locks it took before fork() are
    released; Python locks other threads may have held are rebuilt, and so is every manager's
    per-process state (worker threads, locks; see MemoryManager._after_fork_in_child). Runs
    alone, so it reads the registry unlocked."""
    global _lock
    _release_held()
    _lock = threading.Lock()
    for refs in list(_peers.values()):
        for ref in refs:
            manager = ref()
            if manager is not None:
                manager._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
