"""MultiDeviceManager placement against a plain MemoryManager on the same simulated device.

Issue target: allocate_on_best_device on one device costs at most 5 % more than malloc."""
import statistics
import timeit

from . import OPS_PER_CALL, KiB, sim_manager


class Placement:
    """Hit pairs, 1000 per call: ``free(allocate_on_best_device(n))`` vs ``free(malloc(n))``."""

    params = [[4 * KiB]]
    param_names = ["nbytes"]

    def setup(self, nbytes):
        from gpumem import MultiDeviceManager
        self.mm = sim_manager()
        self.single = sim_manager()
        self.multi = MultiDeviceManager([self.mm])
        self.multi.free(self.multi.allocate_on_best_device(nbytes))
        self.single.free(self.single.malloc(nbytes))

    def teardown(self, nbytes):
        self.multi.close()
        self.mm.close()
        self.single.close()

    def time_1000_single_manager_pairs(self, nbytes):
        malloc, free = self.single.malloc, self.single.free
        for _ in range(OPS_PER_CALL):
            free(malloc(nbytes))

    def time_1000_multi_device_pairs(self, nbytes):
        alloc, free = self.multi.allocate_on_best_device, self.multi.free
        for _ in range(OPS_PER_CALL):
            free(alloc(nbytes))


class PlacementOverhead:
    """multi-device pair / single-manager pair, both timed in one run (interleaved medians)."""

    unit = "ratio"
    number = 1
    repeat = 1

    def setup(self):
        from gpumem import MultiDeviceManager
        self.single = sim_manager()
        self.mm = sim_manager()
        self.multi = MultiDeviceManager([self.mm])

    def teardown(self):
        self.multi.close()
        self.mm.close()
        self.single.close()

    def track_overhead_ratio(self):
        single, multi = self.single, self.multi

        def one():
            single.free(single.malloc(4096))

        def many():
            multi.free(multi.allocate_on_best_device(4096))

        a, b = [], []
        for _ in range(9):
            a.append(timeit.timeit(one, number=50_000))
            b.append(timeit.timeit(many, number=50_000))
        return statistics.median(b) / statistics.median(a)
