"""The good neighbour: cached memory goes back when someone else needs the device.

When the device's free memory drops below a manager's ``min_free_bytes`` because someone else
allocated (another process, a library calling the driver directly), the manager releases cached
memory until the device has that much free again or its cache is empty. This happens within
:data:`POLL_PERIOD` plus one release even while the manager is idle: one daemon thread per
process asks the driver for its free memory (``mem_get_info``) every period, for each open
manager that holds releasable cached memory. The hit path does no work for it. (The shared
budget's watcher does the same for gpumem peers of a shared group; this is for everyone else.)

Thread safety: the registry (a WeakSet of managers) has one owner, this module, and one lock,
``_lock``, held only to add, remove or copy; it never is held while a manager is polled. A poll
takes the manager's slow-path lock with a timeout (a manager busy in its miss path is polled
again next period) and runs the release under it, as every release does. The thread holds a
manager strongly only while it polls it, so it never keeps one alive; it ends when no manager
is registered, and a forked child starts without it.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from gpumem.units import format_bytes

__all__ = ["POLL_PERIOD", "watch", "unwatch", "poll", "watched"]

log = logging.getLogger("gpumem")

#: seconds between two looks at the device: short against what a neighbour waits for memory
#: (the 2 s the docs promise leave room for a loaded machine), long against cuMemGetInfo's
#: few microseconds (one call per manager holding cache per period)
POLL_PERIOD = 0.25

#: how long a poll waits for a manager busy in its miss path before trying next period
_LOCK_WAIT = 0.05

_lock = threading.Lock()
_managers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_thread: threading.Thread | None = None
_wake = threading.Event()


def watch(manager: Any) -> None:
    """Look after ``manager`` from now on (a manager with ``min_free_bytes=0`` is skipped at
    each poll: it keeps nothing free for others)."""
    global _thread
    with _lock:
        _managers.add(manager)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="gpumem-neighbour", daemon=True)
            _thread.start()


def unwatch(manager: Any) -> None:
    """Stop looking after ``manager`` (close()); the thread ends once none is left. Never
    blocks: close() runs from ``__del__`` too, and the cyclic GC can finalize a manager in a
    thread that holds ``_lock`` (it deadlocked so). When the lock is busy the closed manager is
    left in the set, where every poll skips it and the thread drops it."""
    if not _lock.acquire(blocking=False):
        return
    try:
        _managers.discard(manager)
        if not _managers:
            _wake.set()
    finally:
        _lock.release()


def watched() -> int:
    """How many open managers are looked after now (tests, ``gpumem info``)."""
    with _lock:
        refs = _managers.data.copy()
    return sum(1 for ref in refs if (m := ref()) is not None and not m.closed)


def poll(manager: Any) -> int:
    """One look at ``manager``'s device: when its free memory is below ``min_free_bytes`` and
    the manager holds releasable cached memory, release up to the shortfall. The bytes
    released (0 when nothing was short, nothing could go, or the manager was busy)."""
    growth = manager._growth
    min_free = growth.config.min_free_bytes
    pool = growth.pool
    if not min_free or manager.closed or pool.reserved_bytes == pool.in_use_bytes:
        return 0                                  # nothing kept free, or nothing cached
    if not growth.lock.acquire(timeout=_LOCK_WAIT):
        return 0
    try:
        if manager.closed:
            return 0
        free, _ = growth.device.mem_get_info()
        short = min_free - free
        if short <= 0:
            return 0
        released = 0
        if growth.expandable is not None:
            # pages first: only as much as the device lacks (a wholly free segment would go
            # back whole through release_cached)
            released = growth.expandable.trim(short)
            if released:
                growth.reserved_changed()
        if released < short:
            released += growth.release_cached(short - released,
                                              reason="good neighbour: the device's free "
                                                     "memory fell below min_free_bytes")
    finally:
        growth.lock.release()
    if released:
        log.info("%s: gave %s of cache back: the device had %s free, below min_free_bytes=%s",
                 manager.device_string, format_bytes(released), format_bytes(free),
                 format_bytes(min_free))
    return released


def _run() -> None:
    global _thread
    while True:
        _wake.wait(POLL_PERIOD)
        _wake.clear()
        with _lock:
            # weak references only: a strong one dropped under the lock could finalize a
            # manager here, whose close() needs the lock (set.copy runs no Python code)
            refs = _managers.data.copy()
            if not refs:
                if _thread is threading.current_thread():
                    _thread = None
                return
        for ref in refs:
            manager = ref()
            if manager is None:
                continue
            if manager.closed:                # its unwatch found the lock busy
                with _lock:
                    _managers.discard(manager)
            else:
                try:
                    poll(manager)
                except Exception as exc:  # a failing driver must not end the thread for others
                    log.debug("gpumem: neighbour poll of %r failed: %s", manager, exc)
            del manager                   # hold no manager between polls (dropped unlocked)


def _after_fork_in_child() -> None:
    global _lock, _thread, _managers
    _lock = threading.Lock()
    _thread = None
    _managers = weakref.WeakSet()         # the parent's managers are the parent's
    _wake.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
