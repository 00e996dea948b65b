"""Host copies of a sleeping tag's live buffers (docs/sleep_and_wake.md).

:class:`Backups` copies each live block of a tag pool to host memory before its pages go back
(page-locked memory on a CUDA device, so the copies run at full speed; plain host memory on
sim), restores the blocks still live at wake, and frees every copy then. The copies share host
buffers of up to :data:`CHUNK` bytes (one page-locked allocation each, not one per tensor). A
buffer freed while its tag sleeps drops its copy at once (the tag pool's observer, installed
only while asleep: its hot path pays nothing otherwise); a host buffer goes back with its last
copy.

Thread safety: a Backups belongs to one sleeping tag; ``take`` and ``restore`` run under the
tag pool's slow-path lock; ``on_free`` (any thread, a Buffer's destructor too) only pops one
entry of a dict under the GIL and frees its host memory, never raising.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from gpumem.backends.base import DLPACK_CUDA

if TYPE_CHECKING:
    from gpumem.backends.base import Device

__all__ = ["Backups"]


class _HostCopy:
    """``nbytes`` of host memory: page-locked on a CUDA device, a bytearray elsewhere."""

    __slots__ = ("nbytes", "_pinned", "view")

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self._pinned = 0
        if pinned:
            from gpumem.backends.cuda_host import pinned_alloc
            self._pinned = pinned_alloc(nbytes)
            self.view = memoryview((ctypes.c_char * nbytes).from_address(self._pinned)).cast("B")
        else:
            self.view = memoryview(bytearray(nbytes))

    def free(self) -> None:
        try:
            self.view.release()
        except BufferError:     # a slice still exported (never here): the memory stays valid
            return
        if self._pinned:
            ptr, self._pinned = self._pinned, 0
            try:
                from gpumem.backends.cuda_host import pinned_free
                pinned_free(ptr)
            except Exception:  # noqa: BLE001 - a free in a destructor path never raises
                pass


#: live blocks are copied into host buffers of up to this many bytes each (a larger block gets
#: one of its own): a page-locked allocation costs a driver call, so a model's thousands of
#: small tensors share a few; a buffer is freed once every block copied into it is freed
CHUNK = 64 << 20


class _Chunk:
    """One host buffer holding the copies of several blocks; freed with its last one."""

    __slots__ = ("copy", "live")

    def __init__(self, nbytes: int, pinned: bool, live: int) -> None:
        self.copy = _HostCopy(nbytes, pinned)
        self.live = live

    def drop_one(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.copy.free()


class Backups:
    """The host copies of one sleeping tag (see the module docstring)."""

    def __init__(self) -> None:
        # buffer id -> (segment handle, offset, bytes, its chunk, where in the chunk)
        self._copies: dict[int, tuple[int, int, int, _Chunk, int]] = {}
        self._pool: Any = None

    @classmethod
    def empty(cls) -> "Backups":
        return cls()

    @classmethod
    def take(cls, pool: Any, device: Device) -> "Backups":
        """Copy every live block of ``pool`` to host memory (the device is idle). On failure
        the copies made are freed and the error propagates."""
        self = cls()
        pinned = device.dlpack_device_type == DLPACK_CUDA      # a CUDA device (not sim)
        blocks = [(b["id"], seg["handle"], b["offset"], b["requested"])
                  for seg in pool.pool.segments() for b in seg["blocks"]
                  if b["state"] == "allocated" and b["requested"]]
        try:
            group: list[tuple[int, int, int, int]] = []
            size = 0
            for i, block in enumerate(blocks):
                group.append(block)
                size += block[3]
                if i + 1 == len(blocks) or size + blocks[i + 1][3] > CHUNK:
                    self._copy_group(group, size, pinned, device)
                    group, size = [], 0
        except BaseException:
            self.drop()
            raise
        if self._copies:
            self._pool = pool
            pool.add_observer(self)             # a free while asleep drops its copy
        return self

    def _copy_group(self, group: list[tuple[int, int, int, int]], size: int, pinned: bool,
                    device: Device) -> None:
        chunk = _Chunk(size, pinned, len(group))
        at = 0
        for ident, handle, offset, n in group:
            self._copies[ident] = (handle, offset, n, chunk, at)
            at += n
        at = 0
        for ident, handle, offset, n in group:
            device.copy_to_host(handle, offset, chunk.copy.view[at:at + n], 0)
            at += n

    @property
    def nbytes(self) -> int:
        """Host bytes of the copies of blocks still live."""
        return sum(e[2] for e in list(self._copies.values()))

    def __len__(self) -> int:
        return len(self._copies)

    # --- the tag pool's observer while asleep ---------------------------------------------------
    def on_alloc(self, buf: Any) -> None:
        pass                                    # never while asleep: requests are refused

    def on_free(self, buf: Any) -> None:
        entry = self._copies.pop(buf.id, None)
        if entry is not None:
            entry[3].drop_one()

    # --- wake ------------------------------------------------------------------------------------
    def restore(self, pool: Any, device: Device) -> None:
        """Copy each saved block back (it is mapped again), then free every host copy."""
        self._unobserve()
        try:
            for handle, offset, n, chunk, at in list(self._copies.values()):
                device.copy_from_host(handle, offset, chunk.copy.view[at:at + n], 0)
            if self._copies:
                device.synchronize()
        finally:
            self.drop()

    def drop(self) -> None:
        """Free every host copy (a sleep that failed, a closed manager, a restore done)."""
        self._unobserve()
        copies, self._copies = self._copies, {}
        for entry in copies.values():
            entry[3].drop_one()

    def _unobserve(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and not pool.closed and self in pool._observers:
            pool.remove_observer(self)
