"""AnyBuffer: the one public base of what ``MemoryManager.malloc`` returns.

malloc returns a device :class:`gpumem.Buffer` (a Cython class) or, when the device is exhausted
and CPU fallback is on, a :class:`gpumem.FallbackBuffer` in host memory. Both are instances of
:class:`AnyBuffer`, so ``isinstance(buf, gpumem.AnyBuffer)`` holds for either and type checkers
see one interface.
"""
from __future__ import annotations

import abc
from typing import Any

from gpumem._core.buffer import Buffer

__all__ = ["AnyBuffer"]


class AnyBuffer(abc.ABC):
    """Memory handed out by a manager: on the device (Buffer) or in host memory
    (FallbackBuffer, ``location == "cpu"``)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def ptr(self) -> int:
        """The address (device address, or host address for a fallback)."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """The bytes requested."""

    @property
    @abc.abstractmethod
    def id(self) -> int:
        """A number unique within the process."""

    @property
    @abc.abstractmethod
    def device(self) -> str:
        """The device string of the memory ("cpu" for a fallback)."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once freed (or once its manager is closed)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Return the memory; a second free raises DoubleFreeError."""

    @abc.abstractmethod
    def record_stream(self, stream: Any) -> None:
        """Declare that work on `stream` also uses these bytes."""

    @abc.abstractmethod
    def copy_from_host(self, src: Any) -> None:
        """Copy a host buffer (bytes-like or numpy array) into this memory."""

    @abc.abstractmethod
    def copy_to_host(self, out: Any = None) -> Any:
        """Copy this memory to the host (a new uint8 numpy array, or into `out`)."""

    @abc.abstractmethod
    def memset(self, value: int) -> None:
        """Set every byte to `value` (0..255)."""


AnyBuffer.register(Buffer)
