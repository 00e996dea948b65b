"""What the parts of a manager, and the modules that read one, need of a MemoryManager.

Each part (batches, CPU fallback, measure(), the miss path) and each reader (the summary, the
peers registry) names one of these Protocols for the manager it is handed, never
:class:`~gpumem.manager.memory_manager.MemoryManager` itself: no module imports
``memory_manager.py`` back, even for types, so the manager can be reworked without its parts
seeing it, and no import circle runs through it (tests/test_layout.py checks both).
MemoryManager implements all of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    from gpumem._core.buffer import Buffer
    from gpumem._core.pool import CachingPool
    from gpumem.backends.base import Device
    from gpumem.manager.pressure import MemoryPressure
    from gpumem.stats import MemoryStats

__all__ = ["ManagerHandle", "Allocator", "MeasuredManager", "HostAllocator", "SummarySource",
           "FallbackLedger", "OomCallback"]

#: called as ``callback(manager, requested_bytes)`` when a request cannot be served; it may
#: free memory, after which the request is retried once.
OomCallback = Callable[[Any, int], None]


class ManagerHandle(Protocol):
    """A manager named by what a buffer keeps of it: its device, and whether it is closed."""

    @property
    def device_string(self) -> str: ...
    @property
    def closed(self) -> bool: ...


class Allocator(ManagerHandle, Protocol):
    """What batches and warm-up call (gpumem.manager.batch)."""

    @property
    def pool(self) -> CachingPool: ...
    def malloc(self, nbytes: int, *, stream: Any = None, tag: Any = None,
               fallback: bool = True) -> Any: ...
    def allocate_batch(self, sizes: Iterable[int], *, stream: Any = None,
                       tag: Any = None) -> list: ...
    def warmup(self, sizes: Sequence[int], counts: Sequence[int] | int = 1, *,
               stream: Any = None) -> int: ...


class MeasuredManager(ManagerHandle, Protocol):
    """What measure() reads (gpumem.manager.measure)."""

    @property
    def pool(self) -> CachingPool: ...


class HostAllocator(ManagerHandle, Protocol):
    """The host-memory manager the miss path serves CPU fallbacks from."""

    def malloc(self, nbytes: int, *, stream: Any = None, tag: Any = None,
               fallback: bool = True) -> Any: ...
    def close(self) -> None: ...


class SummarySource(ManagerHandle, Protocol):
    """What a summary (gpumem.observe.summary) and the peers registry read of a manager."""

    @property
    def device(self) -> Device: ...
    @property
    def pool(self) -> CachingPool: ...
    total_memory: int
    tracker: Any
    @property
    def usable_memory(self) -> int: ...
    @property
    def hold_limit(self) -> int: ...
    def stats(self) -> MemoryStats: ...
    def memory_info(self) -> tuple[int, int]: ...
    def pressure(self) -> MemoryPressure: ...
    def pressure_ratio(self) -> float: ...


class FallbackLedger(Protocol):
    """What a FallbackBuffer calls of its manager's miss path (gpumem.manager.miss_path
    implements it): the accounting of host bytes, and device memory to migrate to."""

    def validate_stream(self, stream: Any) -> None: ...
    def fallback_released(self, fb: Any) -> None: ...
    def malloc_device_only(self, nbytes: int, stream: int, tag: Any) -> Buffer: ...
