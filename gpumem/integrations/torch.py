"""PyTorch allocates CUDA memory through gpumem.

>>> from gpumem.integrations import torch as gm_torch
>>> gm_torch.use_gpumem()                       # before the first CUDA tensor  # doctest: +SKIP

torch loads two C functions from a shared library with
``torch.cuda.memory.CUDAPluggableAllocator(path, "gpumem_torch_alloc", "gpumem_torch_free")``;
the library is the extension ``gpumem.integrations._torch_alloc`` (see its docstring for what
runs without the GIL and what goes through the manager's Python slow path).

``manager=None`` means ``gpumem.get_manager(f"cuda:{device}")``, resolved for each torch device
on its first request. torch is imported only inside these functions.

Thread safety: :func:`allocator`, :func:`use_gpumem` and :func:`bind` take the GIL and are meant
for start-up; the allocation entry points are thread-safe (see ``_torch_alloc``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem.integrations.manager_checks import cuda_device_index

if TYPE_CHECKING:
    from gpumem.manager.memory_manager import MemoryManager

__all__ = ["ALLOC_SYMBOL", "FREE_SYMBOL", "TorchAllocatorError", "library_path", "bind",
           "allocator", "use_gpumem", "counters", "live_blocks", "manager_for", "region",
           "sleep", "wake"]

ALLOC_SYMBOL = "gpumem_torch_alloc"
FREE_SYMBOL = "gpumem_torch_free"


class TorchAllocatorError(RuntimeError):
    """torch cannot switch to gpumem's allocator (typically: it already allocated with its own)."""


def _native():
    from gpumem.integrations import _torch_alloc
    return _torch_alloc


def library_path() -> str:
    """The shared library exporting ``gpumem_torch_alloc``/``gpumem_torch_free``, imported
    (and so linked to gpumem's pool) before anyone dlopen()s it."""
    return _native().__file__


def bind(manager: "MemoryManager", device: int | None = None) -> None:
    """Serve torch's CUDA device ``device`` (default: the manager's own CUDA index) from
    ``manager``. Any manager can be bound to an explicit index, which is how the tests drive the
    entry points on a simulated device."""
    if device is None:
        device = cuda_device_index(manager, "torch tensors live on CUDA devices",
                                   " (pass device= to bind it anyway)")
    _native().bind(manager, device)


def allocator(manager: "MemoryManager | None" = None) -> Any:
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` that allocates from gpumem; with a
    manager, torch's device of that manager's index is bound to it first."""
    if manager is not None:
        bind(manager)
    path = library_path()
    from torch.cuda.memory import CUDAPluggableAllocator
    return CUDAPluggableAllocator(path, ALLOC_SYMBOL, FREE_SYMBOL)


def use_gpumem(manager: "MemoryManager | None" = None) -> Any:
    """Make gpumem torch's CUDA allocator for this process and return the allocator.

    torch allows this only before its own caching allocator has been initialised, i.e. before
    the first CUDA tensor (and before anything that initialises CUDA in torch, such as
    ``torch.cuda.memory_allocated()``). Called later it raises TorchAllocatorError."""
    alloc = allocator(manager)
    import torch
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as exc:
        raise TorchAllocatorError(
            "torch has already initialised its own CUDA caching allocator, and it can be "
            "replaced only before that: call gpumem.integrations.torch.use_gpumem() at the start "
            "of the process, before the first CUDA tensor or torch.cuda call. "
            f"(torch said: {exc})") from exc
    return alloc


def counters() -> dict[str, int]:
    """What the C entry points did in this process, in gpumem.stats' vocabulary
    (docs/statistics.md): ``num_allocs`` requests served, of which ``nogil_allocs`` from the
    pool without the GIL (pool hits) and ``through_python`` the rest (misses, first use of a
    stream, observers on: hits or misses, see the bound manager's ``stats().pool_hits``);
    ``num_frees`` (``nogil_frees`` + ``python_frees``), ``num_ooms``, ``fallbacks_refused``
    (CPU fallback memory cannot back a CUDA tensor), ``unknown_frees`` (pointers gpumem did
    not hand out), ``bad_frees``, ``bad_requests``, ``errors``, ``dropped_at_exit``. The old
    keys ``hits``, ``frees``, ``ooms`` still read, with a DeprecationWarning."""
    return _native().counters()


def live_blocks(device: int | None = None) -> int:
    """Pointers handed to torch and not freed yet (on ``device``, or on every device)."""
    return _native().live_blocks(device)


# --- sleep and wake (docs/sleep_and_wake.md) --------------------------------------------------
def manager_for(device: int | None = None) -> "MemoryManager":
    """The manager serving torch's CUDA device ``device`` (None: torch's current device): the
    one bound to it, else ``gpumem.get_manager(f"cuda:{device}")``."""
    if device is None:
        import torch
        device = torch.cuda.current_device()
    bound = _native().bound_manager(device)
    if bound is not None:
        return bound
    import gpumem
    return gpumem.get_manager(f"cuda:{device}")


def region(tag: Any, device: int | None = None) -> Any:
    """``with gm_torch.region("weights"): model = build().cuda()``: tensors torch allocates in
    this thread inside the block carry ``tag`` and can sleep with it (MemoryManager.region)."""
    return manager_for(device).region(tag)


def sleep(tags: Any, *, backup: Any = True, device: int | None = None) -> int:
    """MemoryManager.sleep of the manager serving ``device``: the tags' tensors keep their
    ``data_ptr()``, their memory goes back to the device; the bytes released."""
    return manager_for(device).sleep(tags, backup=backup)


def wake(tags: Any = None, *, device: int | None = None) -> int:
    """MemoryManager.wake of the manager serving ``device``; the bytes mapped."""
    return manager_for(device).wake(tags)
