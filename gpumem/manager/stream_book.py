"""Stream bookkeeping of a MemoryManager: which streams the pool serves, and streams that die.

A stream is registered with the pool the first time it is used, after the device has checked
its handle. Blocks cached by one stream go to another only once the device says the first is
idle (``_from_idle_streams``). A stream destroyed through ``Device.destroy_stream`` (the device
tells its managers, see ``Device.add_stream_listener``) or found unknown to the device on a
miss is dead: allocations on it are refused, and its cached blocks are handed to other streams
after one ``synchronize()`` has drained the work it had queued. If the driver later gives the
same handle to a new stream, it is revived after that synchronize.

Mixed into :class:`gpumem.MemoryManager`; every method here runs under the manager's ``_slow``
lock (docs/concurrency.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem.errors import DriverError, InvalidInputError

if TYPE_CHECKING:
    from gpumem._core.buffer import Buffer

__all__ = ["StreamBook"]


class StreamBook:
    """The stream half of MemoryManager (see the module docstring)."""

    def _ensure_stream(self, stream: int) -> None:
        if stream in self._streams:
            return
        with self._slow:
            try:
                self.device.stream_idle(stream)       # the device validates the handle
            except (DriverError, InvalidInputError) as exc:   # drivers differ in which they raise
                gone = " (it was destroyed)" if self._is_dead_stream(stream) else ""
                raise InvalidInputError(f"stream {stream} is not a stream of "
                                        f"{self.device_string}{gone}: {exc}") from None
            if self._is_dead_stream(stream):
                # the driver gave a destroyed stream's handle to a new stream: the old one's
                # cached blocks may be reused only once its last work is done
                self._sync_dead_streams()
                self._stream_revived(stream)
            self.pool.register_stream(stream)
            self._streams.add(stream)

    _check_stream = _ensure_stream            # Buffer.record_stream validates through it

    def _on_stream_destroyed(self, stream: int) -> None:
        """Device listener: `stream` was destroyed. Allocations on it are refused from now on;
        its cached blocks (and blocks of its live buffers, once freed) go to other streams
        after a synchronize has drained what it had queued."""
        with self._slow:
            if stream in self._streams or self.pool.has_stream(stream):
                self._forget_stream(stream)

    def _forget_stream(self, stream: int) -> None:
        self._streams.discard(stream)
        self._unsynced_dead.add(stream)
        self._stream_died(stream)

    def _sync_dead_streams(self) -> None:
        if self._unsynced_dead:
            self.device.synchronize()
            self._unsynced_dead.clear()

    def _from_idle_streams(self, nbytes: int, stream: int, tag: Any) -> Buffer | None:
        """Blocks cached by streams whose work has finished are merged into `stream`'s heaps
        (whole segments reappear, so release_before_grow can see them); then retry the cache.
        A stream the device no longer knows (destroyed) counts as finished after one
        synchronize."""
        idle, dead = [], []
        for s in self.pool.streams_with_free(stream):
            if self._is_dead_stream(s):
                dead.append(s)
                continue
            try:
                if self.device.stream_idle(s):
                    idle.append(s)
            except (DriverError, InvalidInputError):  # destroyed behind this manager's back
                self._forget_stream(s)
                dead.append(s)
        if dead:
            self._sync_dead_streams()
            idle += dead
        if not idle:
            return None
        self.pool.reclaim_idle(idle, stream)
        return self._alloc_cached(nbytes, stream, tag)
