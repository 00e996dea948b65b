"""Numba's CUDA target allocates device memory through gpumem (an EMM plugin).

Either::

    from numba import cuda
    from gpumem.integrations.numba import GpumemNumbaManager
    cuda.set_memory_manager(GpumemNumbaManager)

or, before Numba initialises CUDA, ``NUMBA_CUDA_MEMORY_MANAGER=gpumem.integrations.numba``
(Numba imports this module and uses its ``_numba_memory_manager``), or
:func:`use_gpumem` with an explicit manager.

Each Numba context (one per CUDA device) allocates from ``gpumem.get_manager(f"cuda:{id}")``
unless :func:`use_gpumem` named a manager for that device. Device arrays become gpumem Buffers
tagged ``"numba"``: the pool, pressure, OOM ladder, tracking and history see them. Memory is
given back when Numba's ``MemoryPointer`` finalizer runs, at once, or, inside
``cuda.defer_cleanup()``, when the outermost such block ends. Pinned and mapped host memory stay
Numba's own (``HostOnlyCUDAMemoryManager``); IPC handles come from ``GetIpcHandleMixin``.

Numba (``numba-cuda``) is imported on first use of :class:`GpumemNumbaManager` (a module
``__getattr__``), not when this module is imported.

Thread safety: the managers chosen by :func:`use_gpumem` are a dict owned by this module under
``_CHOICE_LOCK``; each plugin instance (one per Numba context) keeps its live buffers and its
deferred frees under its own lock.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator

from gpumem.integrations.manager_checks import cuda_device_index

if TYPE_CHECKING:
    from gpumem.manager.memory_manager import MemoryManager

__all__ = ["GpumemNumbaManager", "use_gpumem", "manager_for_device"]

_CHOICE_LOCK = threading.Lock()
_CHOSEN: dict[int, "MemoryManager"] = {}      # CUDA device index -> manager (use_gpumem)
_PLUGIN_CLASS: type | None = None


def manager_for_device(device_id: int) -> "MemoryManager":
    """The manager Numba's context on CUDA device ``device_id`` allocates from."""
    with _CHOICE_LOCK:
        chosen = _CHOSEN.get(device_id)
    if chosen is not None:
        return chosen
    import gpumem
    return gpumem.get_manager(f"cuda:{device_id}")


def use_gpumem(manager: "MemoryManager | None" = None) -> type:
    """Make Numba allocate through gpumem (``manager``'s device from ``manager``, every other
    device from ``gpumem.get_manager``) and return the plugin class. Contexts Numba has already
    created keep their memory manager: call this before the first CUDA array."""
    if manager is not None:
        index = cuda_device_index(manager, "Numba's CUDA target needs a cuda manager")
        with _CHOICE_LOCK:
            _CHOSEN[index] = manager
    from numba import cuda
    plugin = _plugin_class()
    cuda.set_memory_manager(plugin)
    return plugin


def _plugin_class() -> type:
    global _PLUGIN_CLASS
    if _PLUGIN_CLASS is None:
        _PLUGIN_CLASS = _build_plugin_class()
    return _PLUGIN_CLASS


def __getattr__(name: str) -> Any:
    # GpumemNumbaManager subclasses Numba's classes, so it is built (and Numba imported) only
    # when asked for; _numba_memory_manager is the name NUMBA_CUDA_MEMORY_MANAGER looks up.
    if name in ("GpumemNumbaManager", "_numba_memory_manager"):
        return _plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_plugin_class() -> type:
    from numba.cuda import (GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo,
                            MemoryPointer)

    from gpumem._core.buffer import Buffer

    class GpumemNumbaManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
        """Numba EMM plugin (interface version 1) allocating device memory from gpumem."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._manager: MemoryManager | None = None
            self._shared = False                     # from gpumem.get_manager: re-resolve if closed
            self._lock = threading.Lock()
            self._live: dict[int, Buffer] = {}       # address -> Buffer handed to Numba
            self._defer_depth = 0
            self._deferred: list[Buffer] = []

        @property
        def manager(self) -> "MemoryManager":
            mm = self._manager
            if mm is None or (self._shared and mm.closed):
                self.initialize()
            return self._manager

        def initialize(self) -> None:
            mm = self._manager
            if mm is None or (self._shared and mm.closed):
                device_id = self.context.device.id
                with _CHOICE_LOCK:
                    self._shared = device_id not in _CHOSEN
                self._manager = manager_for_device(device_id)

        def memalloc(self, size: int) -> Any:
            mm = self.manager
            buf = mm.malloc(size, tag="numba")
            if type(buf) is not Buffer:   # CPU fallback: host memory is no Numba device array
                buf.free()
                raise mm._oom_error(size)
            ptr = buf.ptr
            with self._lock:
                self._live[ptr] = buf
            finalizer = _free_later(weakref.ref(self), ptr)
            return MemoryPointer(weakref.proxy(self.context), ctypes.c_void_p(ptr), size,
                                 finalizer=finalizer)

        def _release(self, ptr: int) -> None:
            with self._lock:
                buf = self._live.pop(ptr, None)
                if buf is not None and self._defer_depth:
                    self._deferred.append(buf)
                    return
            if buf is not None:
                buf.free()

        def get_memory_info(self) -> Any:
            """``(free, total)``: total is the device's; free is what gpumem can still hand
            out: the driver's free bytes plus the pool's cached bytes, within the manager's
            hard limit (hold_limit: the device's total unless the user capped it)."""
            mm = self.manager
            driver_free, total = mm.memory_info()
            stats = mm.stats()
            free = min(driver_free + stats.cached_bytes,
                       max(0, mm.hold_limit - stats.in_use_bytes))
            return MemoryInfo(free=free, total=total)

        def reset(self) -> None:
            """Numba's context reset: every buffer handed out is returned, then the cache
            is emptied (arrays still referencing them are invalid afterwards, as in Numba)."""
            super().reset()
            with self._lock:
                bufs = list(self._live.values()) + self._deferred
                self._live.clear()
                self._deferred = []
            for buf in bufs:
                buf.free()
            if self._manager is not None and not self._manager.closed:
                self._manager.empty_cache()

        @contextlib.contextmanager
        def defer_cleanup(self) -> Iterator[None]:
            with self._lock:
                self._defer_depth += 1
            try:
                with super().defer_cleanup():
                    yield
            finally:
                with self._lock:
                    self._defer_depth -= 1
                    flush = self._deferred if self._defer_depth == 0 else []
                    if flush:
                        self._deferred = []
                for buf in flush:
                    buf.free()

        @property
        def interface_version(self) -> int:
            return 1

    GpumemNumbaManager.__module__ = __name__
    GpumemNumbaManager.__qualname__ = "GpumemNumbaManager"
    return GpumemNumbaManager


def _free_later(plugin_ref: "weakref.ref", ptr: int):
    """The MemoryPointer finalizer: holds the plugin weakly (it must not keep the context
    alive) and frees by address; never raises (it runs from weakref.finalize)."""
    def finalize() -> None:
        plugin = plugin_ref()
        if plugin is None:
            return
        try:
            plugin._release(ptr)
        except Exception as exc:  # a closed manager at exit: nothing left to return to
            import warnings
            warnings.warn(f"gpumem: could not return Numba's buffer at {ptr:#x}: {exc}",
                          ResourceWarning)
    return finalize
