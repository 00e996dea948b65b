"""CPU fallback: host memory handed out when the device (or a user's hard limit) refuses.

A manager's first fallback emits a :class:`gpumem.CpuFallbackWarning` (each one is logged);
``malloc(..., fallback=False)`` or ``MemoryConfig(cpu_fallback_enabled=False)`` refuse it. The
manager's miss path (:class:`gpumem.manager.miss_path.MissPath`) makes FallbackBuffers and keeps
their accounting; a FallbackBuffer reports back to it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem.backends import HOST_DEVICE
from gpumem.buffer_protocol import AnyBuffer
from gpumem.errors import BufferInUseError, ClosedManagerError, DoubleFreeError, InvalidInputError

if TYPE_CHECKING:
    from gpumem._core.buffer import Buffer
    from gpumem._core.view import BufferView
    from gpumem.manager.interfaces import FallbackLedger, ManagerHandle

__all__ = ["FallbackBuffer"]


class FallbackBuffer(AnyBuffer):
    """Host memory standing in for a device buffer the device could not hold.

    It shares :class:`gpumem.AnyBuffer` with :class:`gpumem.Buffer` (``ptr``, ``nbytes``, ``id``,
    ``tag``, ``stream``, ``free()``, context manager) with ``location == "cpu"``, and
    :meth:`migrate_to_device` moves the data onto the device once memory allows.
    """

    __slots__ = ("_manager", "_miss", "_host", "tag", "stream", "__weakref__")
    location = "cpu"

    def __init__(self, manager: "ManagerHandle", miss: "FallbackLedger", host: "Buffer",
                 stream: int, tag: Any) -> None:
        self._manager = manager
        self._miss = miss                 # the manager's miss path: accounting, migration
        self._host = host
        self.stream = stream
        self.tag = tag

    # One owner for the host block and its accounting: a copy's collection would release the
    # original's fallback bytes (and a pickle names an address of this process).
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a gpumem FallbackBuffer cannot be copied or pickled: it owns memory "
                        "that has one owner; use copy_to_host() for the bytes")

    def __copy__(self) -> Any:
        self.__reduce_ex__(0)

    def __deepcopy__(self, memo: Any) -> Any:
        self.__reduce_ex__(0)

    def _check_usable(self) -> None:
        if self._manager.closed:
            raise ClosedManagerError(f"fallback buffer {self.id}: the manager for "
                                     f"{self._manager.device_string} is closed")

    @property
    def ptr(self) -> int:
        self._check_usable()
        return self._host.ptr

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    @property
    def id(self) -> int:
        return self._host.id

    @property
    def device(self) -> str:
        return HOST_DEVICE

    @property
    def manager(self) -> "ManagerHandle":
        """The device's manager that handed this buffer out (not the host manager)."""
        return self._manager

    @property
    def alive(self) -> bool:
        return self._host.alive

    # --- zero-copy views: those of the host Buffer (kDLCPU, or kDLCUDAHost when pinned) ------
    def view(self, dtype: Any = "uint8", shape: Any = None, strides: Any = None,
             offset: int = 0, *, readonly: bool = False) -> "BufferView":
        """A typed zero-copy view of the host memory (see ``Buffer.view``)."""
        return self._host.view(dtype, shape, strides, offset, readonly=readonly)

    @property
    def exports(self) -> int:
        """Live views of the host memory; ``free()`` is refused while > 0."""
        return self._host.exports

    @property
    def __array_interface__(self) -> dict:
        return self._host.__array_interface__

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        return self._host.__dlpack__(stream=stream, max_version=max_version,
                                     dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple:
        return self._host.__dlpack_device__()

    def _check_no_views(self, what: str) -> None:
        if self._host.exports:
            raise BufferInUseError(f"cannot {what} fallback buffer {self.id}: "
                                   f"{self._host.exports} view(s) of it are alive; drop them "
                                   f"first")

    def copy_from_host(self, src: Any) -> None:
        self._check_usable()
        self._host.copy_from_host(src)

    def copy_to_host(self, out: Any = None) -> Any:
        self._check_usable()
        return self._host.copy_to_host(out)

    def memset(self, value: int) -> None:
        self._check_usable()
        self._host.memset(value)

    def record_stream(self, stream: Any) -> None:
        """Accepted for code written against Buffer: the stream is validated, nothing waits.
        Host memory is read and written synchronously, so its free is never early."""
        self._check_usable()
        if not self._host.alive:
            raise InvalidInputError(f"fallback buffer {self.id} has been freed")
        self._miss.validate_stream(stream)

    def free(self) -> None:
        self._check_usable()
        if not self._host.alive:
            raise DoubleFreeError(f"fallback buffer {self.id} was already freed")
        self._check_no_views("free")
        self._miss.fallback_released(self)
        self._host.free()

    def migrate_to_device(self) -> "Buffer":
        """Copy the data into a new device buffer of the manager and free this host copy.

        Raises OutOfMemoryError (and keeps this buffer) if the device still has no room.
        """
        if not self._host.alive:
            raise InvalidInputError(f"cannot migrate fallback buffer {self.id}: it was freed")
        self._check_no_views("migrate")
        dev = self._miss.malloc_device_only(self.nbytes, self.stream, self.tag)
        try:
            dev.copy_from_host(self._host.copy_to_host())
        except BaseException:
            dev.free()
            raise
        self.free()
        return dev

    def __enter__(self) -> "FallbackBuffer":
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._host.alive:
            self.free()
        return False

    def __del__(self) -> None:
        try:
            if self._host.alive:
                self._miss.fallback_released(self)
        except Exception:
            pass  # the host Buffer returns its own block when collected

    def __repr__(self) -> str:
        state = "" if self.alive else ", freed"
        return f"<gpumem.FallbackBuffer id={self.id} {self.nbytes} B on cpu (for " \
               f"{self._manager.device_string}){state}>"
