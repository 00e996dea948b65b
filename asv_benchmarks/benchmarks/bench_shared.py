"""Shared managers and measure(): what a framework allocator pays to find its manager on each
allocation, and what a ``measure()`` block costs around the work it measures.

The peer in the same run is the allocation itself: a hit pair on the same manager.
"""
from . import KiB, sim_device_string


class SharedManager:
    def setup(self):
        import gpumem
        from gpumem.placement.shared import close_shared_managers
        close_shared_managers()
        self.device = sim_device_string()
        self.mm = gpumem.get_manager(self.device)
        self.get_manager = gpumem.get_manager
        self.mm.free(self.mm.malloc(4 * KiB))

    def teardown(self):
        from gpumem.placement.shared import close_shared_managers
        close_shared_managers()

    def time_get_manager_repeat(self):
        """A repeat call with the same device string: the lock-free fast path."""
        self.get_manager(self.device)

    def time_hit_pair(self):
        """The peer: one malloc + free hit pair on the shared manager."""
        self.mm.free(self.mm.malloc(4 * KiB))

    def time_empty_measure_block(self):
        with self.mm.measure():
            pass
