"""Stream bookkeeping of a MemoryManager: which streams the pool serves, and streams that die.

A stream is registered with the pool the first time it is used, after the device has checked
its handle. Blocks cached by one stream go to another only once the device says the first is
idle (:meth:`StreamBook.reclaim_idle`). A stream destroyed through ``Device.destroy_stream``
(the device tells its managers, see ``Device.add_stream_listener``) or found unknown to the
device on a miss is dead: allocations on it are refused, and its cached blocks are handed to
other streams after one ``synchronize()`` has drained the work it had queued. If the driver
later gives the same handle to a new stream, it is revived after that synchronize.

The dead-stream marks the hot path tests live in the manager's Cython core, reached through a
:class:`~gpumem._core.manager_core.CoreAccess` (held weakly: this object never keeps its
manager alive).

Thread safety: a StreamBook belongs to one manager; every method runs under that manager's
slow-path lock (``lock``, docs/concurrency.md).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from gpumem.errors import DriverError, InvalidInputError

if TYPE_CHECKING:
    from gpumem._core.manager_core import CoreAccess
    from gpumem._core.pool import CachingPool
    from gpumem.backends.base import Device

__all__ = ["StreamBook"]


class StreamBook:
    """The streams of one manager (see the module docstring)."""

    def __init__(self, core: CoreAccess, pool: CachingPool, device: Device,
                 lock: threading.RLock) -> None:
        self._core = core
        self._pool = pool
        self._device = device
        self.lock = lock                  # the manager's slow-path RLock
        self._streams: set[int] = {0}
        # destroyed streams whose pending work may not have finished yet: their cached blocks
        # go to other streams only after a synchronize
        self._unsynced_dead: set[int] = set()

    def ensure(self, stream: int) -> None:
        """Register ``stream`` with the pool on first use (the device validates the handle);
        InvalidInputError for a handle the device does not know."""
        if stream in self._streams:
            return
        with self.lock:
            try:
                self._device.stream_idle(stream)       # the device validates the handle
            except (DriverError, InvalidInputError) as exc:   # drivers differ in which they raise
                gone = " (it was destroyed)" if self._core.is_dead_stream(stream) else ""
                raise InvalidInputError(f"stream {stream} is not a stream of "
                                        f"{self._device.device_string}{gone}: {exc}") from None
            if self._core.is_dead_stream(stream):
                # the driver gave a destroyed stream's handle to a new stream: the old one's
                # cached blocks may be reused only once its last work is done
                self._sync_dead_streams()
                self._core.stream_revived(stream)
            self._pool.register_stream(stream)
            self._streams.add(stream)

    def on_stream_destroyed(self, stream: int) -> None:
        """Device listener: `stream` was destroyed. Allocations on it are refused from now on;
        its cached blocks (and blocks of its live buffers, once freed) go to other streams
        after a synchronize has drained what it had queued."""
        with self.lock:
            if stream in self._streams or self._pool.has_stream(stream):
                self._forget(stream)

    def usable(self, stream: int) -> bool:
        """Whether the pool serves ``stream`` now (registered and not destroyed)."""
        return self._pool.has_stream(stream) and not self._core.is_dead_stream(stream)

    def _forget(self, stream: int) -> None:
        self._streams.discard(stream)
        self._unsynced_dead.add(stream)
        self._core.stream_died(stream)

    def _sync_dead_streams(self) -> None:
        if self._unsynced_dead:
            self._device.synchronize()
            self._unsynced_dead.clear()

    def reclaim_idle(self, stream: int) -> bool:
        """Blocks cached by streams whose work has finished are merged into `stream`'s heaps
        (whole segments reappear, so release_before_grow can see them); whether any were. A
        stream the device no longer knows (destroyed) counts as finished after one
        synchronize."""
        idle, dead = [], []
        for s in self._pool.streams_with_free(stream):
            if self._core.is_dead_stream(s):
                dead.append(s)
                continue
            try:
                if self._device.stream_idle(s):
                    idle.append(s)
            except (DriverError, InvalidInputError):  # destroyed behind this manager's back
                self._forget(s)
                dead.append(s)
        if dead:
            self._sync_dead_streams()
            idle += dead
        if not idle:
            return False
        self._pool.reclaim_idle(idle, stream)
        return True
