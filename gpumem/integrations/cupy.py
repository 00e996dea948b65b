"""CuPy allocates device memory, and pinned host memory, through gpumem.

>>> import cupy
>>> from gpumem.integrations import cupy as gm_cupy
>>> with gm_cupy.use_gpumem():                     # doctest: +SKIP
...     x = cupy.arange(1 << 20)                   # a gpumem Buffer on cupy's current stream

A device allocation is a gpumem Buffer allocated on CuPy's current stream (and device), wrapped
as ``cupy.cuda.UnownedMemory(ptr, size, owner=buffer, device_id)`` in a ``MemoryPointer``; when
CuPy drops the memory, the Buffer goes with it and its block returns to gpumem's pool, filed
under that stream. The pool, pressure, OOM ladder, tracking and history see CuPy's arrays
(tag ``"cupy"``). CPU-fallback memory cannot back a CuPy array: such a request raises gpumem's
OutOfMemoryError instead. Pinned host memory comes from the ``"cpu"`` manager (pinned where
CUDA is present) as a ``cupy.cuda.PinnedMemoryPointer``.

``manager=None`` means ``gpumem.get_manager(f"cuda:{device}")`` for CuPy's current device,
looked up on every request (each device has its own manager). CuPy is imported only inside
these functions.

Thread safety: an allocator holds no mutable state (the managers are thread-safe);
:func:`use_gpumem` swaps CuPy's process-wide allocators, so call it from one thread at start-up
or around a block of work.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from gpumem._core.buffer import Buffer
from gpumem.errors import InvalidInputError
from gpumem.integrations.manager_checks import cuda_device_index, require_host_memory

if TYPE_CHECKING:
    from gpumem.manager.memory_manager import MemoryManager

__all__ = ["allocator", "pinned_allocator", "use_gpumem", "GpumemCupyAllocator",
           "GpumemPinnedAllocator"]


def _refuse_fallback(manager: "MemoryManager", buf: Any, size: int) -> None:
    # Buffer is imported once, at module level: a `from ... import` here cost ~0.65 us per
    # allocation, half of what CuPy's own pool takes for a whole hit (GPU run of 2026-11-27)
    if type(buf) is not Buffer:
        buf.free()
        raise manager._oom_error(size)


class GpumemCupyAllocator:
    """``allocator(size) -> cupy.cuda.MemoryPointer``, for ``cupy.cuda.set_allocator``."""

    def __init__(self, manager: "MemoryManager | None" = None) -> None:
        self.manager = manager
        self._device_id = (None if manager is None
                           else cuda_device_index(manager, "CuPy's CUDA device memory needs a "
                                                       "'cuda' manager"))

    def __call__(self, size: int) -> Any:
        import cupy
        device_id = cupy.cuda.runtime.getDevice()
        mm = self.manager
        if mm is None:
            import gpumem
            mm = gpumem.get_manager(f"cuda:{device_id}")
        elif device_id != self._device_id:
            raise InvalidInputError(
                f"CuPy's current device is {device_id} but this allocator serves "
                f"{mm.device_string}; use one allocator per device or manager=None")
        stream = cupy.cuda.get_current_stream(device_id).ptr
        buf = mm.malloc(size, stream=stream, tag="cupy")
        _refuse_fallback(mm, buf, size)
        mem = cupy.cuda.UnownedMemory(buf.ptr, size, buf, device_id)
        return cupy.cuda.MemoryPointer(mem, 0)

    def __repr__(self) -> str:
        return f"<gpumem CuPy allocator, manager={self.manager!r}>"


class _PinnedBlock:
    """What ``PinnedMemoryPointer`` needs of its memory (ptr, size), owning the Buffer."""

    __slots__ = ("ptr", "size", "buffer")

    def __init__(self, buffer: Any, size: int) -> None:
        self.ptr = buffer.ptr
        self.size = size
        self.buffer = buffer

    def __int__(self) -> int:
        return self.ptr


class GpumemPinnedAllocator:
    """``allocator(size) -> cupy.cuda.PinnedMemoryPointer`` from a ``"cpu"`` manager, for
    ``cupy.cuda.set_pinned_memory_allocator``."""

    def __init__(self, manager: "MemoryManager | None" = None) -> None:
        if manager is not None:
            require_host_memory(manager, "CuPy's pinned host memory needs a 'cpu' manager")
        self.manager = manager

    def __call__(self, size: int) -> Any:
        import cupy
        mm = self.manager
        if mm is None:
            import gpumem
            mm = gpumem.get_manager("cpu")
        buf = mm.malloc(size, tag="cupy-pinned")
        return cupy.cuda.PinnedMemoryPointer(_PinnedBlock(buf, size), 0)

    def __repr__(self) -> str:
        return f"<gpumem CuPy pinned allocator, manager={self.manager!r}>"


def allocator(manager: "MemoryManager | None" = None) -> Callable[[int], Any]:
    """A device allocator for ``cupy.cuda.set_allocator``."""
    return GpumemCupyAllocator(manager)


def pinned_allocator(manager: "MemoryManager | None" = None) -> Callable[[int], Any]:
    """A pinned host allocator for ``cupy.cuda.set_pinned_memory_allocator``."""
    return GpumemPinnedAllocator(manager)


class use_gpumem:
    """Route CuPy's device (and, with ``pinned=True``, pinned host) allocations to gpumem.

    A plain call switches for good; as a context manager the previous device allocator comes
    back on exit, and the pinned one becomes CuPy's default pinned pool again (CuPy has no
    getter for the pinned allocator that was set)::

        gm_cupy.use_gpumem()                  # from now on
        with gm_cupy.use_gpumem(mm):          # only inside the block
            ...
    """

    def __init__(self, manager: "MemoryManager | None" = None, *, pinned: bool = True,
                 pinned_manager: "MemoryManager | None" = None) -> None:
        import cupy
        self.allocator = GpumemCupyAllocator(manager)
        self.pinned_allocator = GpumemPinnedAllocator(pinned_manager) if pinned else None
        self._previous = cupy.cuda.get_allocator()
        self._previous_pinned = cupy.get_default_pinned_memory_pool().malloc
        cupy.cuda.set_allocator(self.allocator)
        if self.pinned_allocator is not None:
            cupy.cuda.set_pinned_memory_allocator(self.pinned_allocator)

    def __enter__(self) -> "use_gpumem":
        return self

    def __exit__(self, *exc: Any) -> bool:
        import cupy
        cupy.cuda.set_allocator(self._previous)
        if self.pinned_allocator is not None:
            cupy.cuda.set_pinned_memory_allocator(self._previous_pinned)
        return False
