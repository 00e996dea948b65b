"""Type stubs for CuPy's allocator hot path (see _cupy_alloc.pyx); the public class is
gpumem.integrations.cupy.GpumemCupyAllocator, which configures it."""
from typing import Any, Callable

from gpumem.manager.memory_manager import MemoryManager

class CupyAllocatorCore:
    @property
    def manager(self) -> MemoryManager | None: ...
    @property
    def device_id(self) -> int: ...
    def _configure(self, manager: MemoryManager | None, device_id: int,
                   get_device: Callable[[], int], get_stream: Callable[[int], Any],
                   memory_type: Callable[..., Any], pointer_type: Callable[..., Any],
                   convert_oom: Callable[[BaseException], BaseException],
                   get_manager: Callable[[str], MemoryManager]) -> None: ...
    def __call__(self, size: int) -> Any: ...
