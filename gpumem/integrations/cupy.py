"""CuPy allocates device memory, and pinned host memory, through gpumem.

>>> import cupy
>>> from gpumem.integrations import cupy as gm_cupy
>>> with gm_cupy.use_gpumem():                     # doctest: +SKIP
...     x = cupy.arange(1 << 20)                   # a gpumem Buffer on cupy's current stream

A device allocation is a gpumem Buffer allocated on CuPy's current stream (and device), wrapped
as ``cupy.cuda.UnownedMemory(ptr, size, owner=buffer, device_id)`` in a ``MemoryPointer``; when
CuPy drops the memory, the Buffer goes with it and its block returns to gpumem's pool, filed
under that stream. The request runs in C with no Python frame (``_cupy_alloc.pyx``: CuPy's
device and stream queries and its two classes are called through objects cached when the
allocator is made). The pool, pressure, OOM ladder, tracking and history see CuPy's arrays
(tag ``"cupy"``). CPU-fallback memory cannot back a CuPy array, so device allocations never
fall back: a request the device cannot serve raises :class:`CupyOutOfMemoryError`, which is
both gpumem's ``OutOfMemoryError`` and CuPy's ``cupy.cuda.memory.OutOfMemoryError`` (CuPy
catches the latter to take another way, e.g. in its CUB histogram). Pinned host memory comes
from the ``"cpu"`` manager (pinned where CUDA is present) as a ``cupy.cuda.PinnedMemoryPointer``.

``manager=None`` means ``gpumem.get_manager(f"cuda:{device}")`` for CuPy's current device on
each request (each device has its own manager; the allocator remembers it until gpumem
replaces it, which closes it first). CuPy is imported only inside these functions.

Thread safety: an allocator is configured once, when made; its per-device memory of shared
managers is changed under the GIL (the managers are thread-safe). :func:`use_gpumem` swaps
CuPy's process-wide allocators, so call it from one thread at start-up or around a block of
work.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from gpumem.errors import OutOfMemoryError
from gpumem.integrations._cupy_alloc import CupyAllocatorCore
from gpumem.integrations.manager_checks import cuda_device_index, require_host_memory

if TYPE_CHECKING:
    from gpumem.manager.memory_manager import MemoryManager

# CupyOutOfMemoryError is public too, but made on first access (it derives from a CuPy class):
# left out of __all__ so that `import *` works where CuPy is absent
__all__ = ["allocator", "pinned_allocator", "use_gpumem", "GpumemCupyAllocator",
           "GpumemPinnedAllocator"]

_CUPY_OOM: "type[OutOfMemoryError] | None" = None


def _cupy_out_of_memory_type() -> "type[OutOfMemoryError]":
    """The class behind ``CupyOutOfMemoryError``, made on first use (it derives from a CuPy
    class, and CuPy is imported lazily)."""
    global _CUPY_OOM
    if _CUPY_OOM is None:
        import cupy

        class CupyOutOfMemoryError(cupy.cuda.memory.OutOfMemoryError, OutOfMemoryError):
            """gpumem's OutOfMemoryError (its fields, history and message) that is also CuPy's
            ``cupy.cuda.memory.OutOfMemoryError``, so code written for either catches it."""

            def __init__(self, requested: int, **fields: Any) -> None:
                OutOfMemoryError.__init__(self, requested, **fields)
                self._size, self._total, self._limit = requested, self.in_use, self.limit or 0

            # gpumem's (rebuilt from its fields), not CuPy's (size, total, limit)
            __reduce__ = OutOfMemoryError.__reduce__

        CupyOutOfMemoryError.__qualname__ = "CupyOutOfMemoryError"   # pickled by this name
        _CUPY_OOM = CupyOutOfMemoryError
    return _CUPY_OOM


def __getattr__(name: str) -> Any:
    if name == "CupyOutOfMemoryError":       # pickle finds the class here too
        return _cupy_out_of_memory_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as_cupy_error(exc: OutOfMemoryError) -> OutOfMemoryError:
    """``exc`` (raised by the manager) as a CupyOutOfMemoryError with the same fields."""
    cls = _cupy_out_of_memory_type()
    err = cls.__new__(cls, *exc.args)
    err.__dict__.update(exc.__dict__)
    err._size, err._total, err._limit = exc.requested, exc.in_use, exc.limit or 0
    return err.with_traceback(exc.__traceback__)


class GpumemCupyAllocator(CupyAllocatorCore):
    """``allocator(size) -> cupy.cuda.MemoryPointer``, for ``cupy.cuda.set_allocator``.

    Made once per manager (or for the shared managers, ``manager=None``); each call runs in
    C (``CupyAllocatorCore.__call__``). CuPy's ``runtime.getDevice``,
    ``get_current_stream``, ``UnownedMemory`` and ``MemoryPointer`` are looked up here, once:
    replace them before making an allocator, not after."""

    def __init__(self, manager: "MemoryManager | None" = None) -> None:
        device_id = (-1 if manager is None
                     else cuda_device_index(manager, "CuPy's CUDA device memory needs a "
                                                     "'cuda' manager"))
        import cupy

        import gpumem
        self._configure(manager, device_id, cupy.cuda.runtime.getDevice,
                        cupy.cuda.get_current_stream, cupy.cuda.UnownedMemory,
                        cupy.cuda.MemoryPointer, _as_cupy_error, gpumem.get_manager)

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
