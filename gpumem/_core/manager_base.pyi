from gpumem._core.pool import CachingPool
from gpumem.backends.base import Device

NOT_COPYABLE: str

class ManagerBase:
    pool: CachingPool
    device: Device
    device_string: str
    pending_free_bytes: int
    @property
    def pending_free_count(self) -> int: ...
    def pending_free_ids(self) -> frozenset[int]: ...
    def collect_pending_frees(self, wait: bool = ...) -> int: ...
