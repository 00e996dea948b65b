"""pyopencl arrays whose memory comes from gpumem's pool.

>>> import pyopencl.array as cla
>>> from gpumem.integrations import pyopencl as gm_cl
>>> alloc = gm_cl.allocator(mm)                      # mm: a MemoryManager on an OpenCL device
>>> a = cla.zeros(alloc.queue, 1000, "float32", allocator=alloc)
>>> del a                                            # the block goes back to mm's pool

:func:`allocator` returns a callable that ``pyopencl.array.Array(..., allocator=...)``,
``empty``, ``zeros`` and ``to_device`` accept. Each call takes a block from the manager's pool
and returns a fresh ``pyopencl.Buffer`` object for it: a retained reference to the block's
cached sub-buffer (``Buffer.native``) that carries the gpumem ``Buffer`` as an attribute. When
pyopencl drops that object (the array and every view of it are gone), the gpumem ``Buffer`` is
collected and its block returns to the pool, as with pyopencl's own ``MemoryPool``.

Ordering: a block freed on a stream is reused by later work on that stream's in-order queue.
Run the arrays' kernels on ``alloc.queue`` (``manager.device.queue(stream)``), as pyopencl's
``MemoryPool`` expects its queue to be used.

:func:`open_manager` puts a manager on a context (and queue) the program already has, so gpumem
fits into an existing pyopencl program instead of owning the context.

Thread safety: an allocator holds no mutable state; each call goes through the manager's
``malloc``, whose contract is in ``gpumem.manager.memory_manager``.
"""
from __future__ import annotations

import functools
from typing import Any

from gpumem._core.buffer import Buffer
from gpumem._core.manager_core import _pyopencl_buffer
from gpumem.config import MemoryConfig
from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.manager.memory_manager import MemoryManager

__all__ = ["PyOpenCLAllocator", "allocator", "open_manager"]


def _allocate(malloc: Any, from_int_ptr: Any, nbytes: int, buf: Any = None) -> Any:
    """One pyopencl buffer backed by a gpumem block: the allocator's path for what its Cython
    body (``gpumem._core.manager_core._pyopencl_buffer``) does not take: sizes that are not a
    positive int (the errors come from here), and `buf`, a block the manager gave in host
    memory (refused)."""
    if buf is None:
        buf = malloc(nbytes)
    if type(buf) is not Buffer:
        buf.free()
        raise OutOfMemoryError(
            nbytes, device=buf.device,
            reason="the device is exhausted and the manager fell back to host memory, which a "
                   "pyopencl array cannot use: turn cpu_fallback_enabled off for managers "
                   "that back pyopencl arrays")
    sub = buf.native
    if sub is None:
        buf.free()
        raise InvalidInputError(f"nbytes must be > 0 for a pyopencl buffer (OpenCL has no "
                                f"empty buffers), got {nbytes!r}")
    # A new Python object on the cached sub-buffer's cl_mem (clRetainMemObject): its death, not
    # the shared sub-buffer's, returns the block.
    mem = from_int_ptr(sub.int_ptr, True)
    mem._gpumem_buffer = buf
    return mem


class PyOpenCLAllocator(functools.partial):
    """``alloc(nbytes) -> pyopencl.Buffer`` from a gpumem manager on an OpenCL device.

    A ``functools.partial`` of the Cython allocation function, so that pyopencl's call reaches
    it with no Python frame at all (each array creation pays for the allocator call)."""

    manager: MemoryManager
    stream: int

    def __new__(cls, manager: MemoryManager, stream: int = 0) -> PyOpenCLAllocator:
        import pyopencl as cl
        malloc = manager.malloc if stream == 0 else functools.partial(manager.malloc,
                                                                     stream=stream)
        from_int_ptr = cl.Buffer.from_int_ptr
        slow = functools.partial(_allocate, malloc, from_int_ptr)
        self = super().__new__(cls, _pyopencl_buffer, manager, stream, from_int_ptr, slow)
        self.manager = manager
        self.stream = stream
        return self

    @property
    def context(self) -> Any:
        """The manager's ``pyopencl.Context``: the arrays' memory lives in it."""
        return self.manager.device.context

    @property
    def queue(self) -> Any:
        """The ``pyopencl.CommandQueue`` of the allocator's stream: give it to the arrays."""
        return self.manager.device.queue(self.stream)

    def __repr__(self) -> str:
        return f"<gpumem pyopencl allocator on {self.manager!r}, stream {self.stream}>"

    def __reduce__(self) -> Any:
        raise TypeError("a gpumem pyopencl allocator belongs to one process's manager and "
                        "cannot be pickled")


def _default_manager() -> MemoryManager:
    """The shared manager (``gpumem.get_manager``) of the default device when that is an
    OpenCL device, else of ``opencl:0``."""
    from gpumem.backends import default_device, get_backend, parse_device
    from gpumem.backends.opencl import BACKEND
    from gpumem.errors import InvalidDeviceError
    from gpumem.placement.shared import get_manager
    try:
        device = default_device()
        on_opencl = get_backend(parse_device(device)[0]) is BACKEND
    except InvalidDeviceError:          # no default device ("sim:80GiB" names no index)
        on_opencl = False
    return get_manager(device if on_opencl else "opencl:0")


def allocator(manager: MemoryManager | None = None, *, stream: int = 0) -> PyOpenCLAllocator:
    """An allocator for ``pyopencl.array`` backed by ``manager``'s pool. None: the shared
    manager (``gpumem.get_manager``) of the default device when that is an OpenCL device
    (``GPUMEM_DEVICE=opencl:N``, or the first OpenCL GPU where there is no CUDA device), else
    of ``opencl:0``. ``stream``: the manager's stream the blocks belong to; its queue is
    ``allocator(...).queue``."""
    if manager is None:
        manager = _default_manager()
    if not isinstance(manager, MemoryManager):
        raise InvalidInputError(f"manager must be a gpumem.MemoryManager or None, got "
                                f"{type(manager).__name__}")
    from gpumem.backends.opencl import OpenCLDevice
    if not isinstance(manager.device, OpenCLDevice):    # its queues and cl.Buffers
        raise InvalidInputError(f"manager is on {manager.device_string}: pyopencl arrays need "
                                f"a manager on an OpenCL device ('opencl:N')")
    if manager.closed:
        raise InvalidInputError(f"the manager for {manager.device_string} is closed")
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise InvalidInputError(f"stream must be an int stream handle of the manager, got "
                                f"{type(stream).__name__} {stream!r}")
    manager.device.queue(stream)        # InvalidInputError for a stream the device lacks
    return PyOpenCLAllocator(manager, stream)


def open_manager(context: Any, queue: Any = None, *, device: Any = None,
                 config: MemoryConfig | None = None) -> MemoryManager:
    """A MemoryManager on an existing ``pyopencl.Context``, with ``queue`` (in-order, of that
    context) as its stream 0, or a new queue when None. ``device``: which of the context's
    devices (default: the queue's, else the context's only one)."""
    from gpumem.backends.opencl import BACKEND
    return MemoryManager(BACKEND.open_context(context, queue, device), config)
