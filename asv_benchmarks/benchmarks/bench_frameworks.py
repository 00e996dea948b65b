"""Framework integrations: the torch allocator's C entry points on a hit.

``gpumem_torch_alloc`` + ``gpumem_torch_free`` (what torch's CUDAPluggableAllocator calls) in a
nogil C loop (``_cbench.entry_pair_ns``), on a simulated device, against the pool's own C hit
pair (``gm_alloc`` + ``gm_free`` through pool.pxd) in the same run: the difference is the
pointer table and its lock. The comparison against torch's, CuPy's and Numba's own pools needs a
GPU: ``ci/gpu.sh`` runs ``asv_benchmarks/frameworks_gpu.py``.
"""
import ctypes
import statistics

from . import MiB, load_cbench, sim_manager

PAIRS = 200_000
REPEATS = 7
DEVICE = 0


class TorchEntryPoints:
    params = [[4096, 1 * MiB]]
    param_names = ["nbytes"]

    def setup(self, nbytes):
        cb = load_cbench()
        from gpumem.integrations import _torch_alloc
        self.cb = cb
        self.native = _torch_alloc
        if _torch_alloc.live_blocks(DEVICE):
            raise NotImplementedError("torch device 0 is in use in this process")
        self.mm = sim_manager()
        _torch_alloc.bind(self.mm, DEVICE)
        lib = ctypes.CDLL(_torch_alloc.__file__)
        self.alloc = ctypes.cast(lib.gpumem_torch_alloc, ctypes.c_void_p).value
        self.free = ctypes.cast(lib.gpumem_torch_free, ctypes.c_void_p).value
        cb.entry_pair_ns(self.alloc, self.free, nbytes, 1000, DEVICE)   # the segment: later hits
        self.pool = self.mm.pool

    def teardown(self, nbytes):
        self.native.unbind(DEVICE)
        self.mm.close()

    def _interleaved(self, nbytes):
        """(median entry pair, median pool pair), the two measured alternately so that both
        see the same machine load."""
        entry, pool = [], []
        for _ in range(REPEATS):
            entry.append(self.cb.entry_pair_ns(self.alloc, self.free, nbytes, PAIRS, DEVICE))
            pool.append(self.cb.hit_pair_ns(self.pool, [nbytes], PAIRS))
        return statistics.median(entry), statistics.median(pool)

    def track_entry_hit_pair_ns(self, nbytes):
        """ns per gpumem_torch_alloc + gpumem_torch_free pair (a hit)."""
        return self._interleaved(nbytes)[0]
    track_entry_hit_pair_ns.unit = "ns"

    def track_pool_hit_pair_ns(self, nbytes):
        """ns per gm_alloc + gm_free pair on the same pool (the peer)."""
        return self._interleaved(nbytes)[1]
    track_pool_hit_pair_ns.unit = "ns"

    def track_entry_over_pool_ratio(self, nbytes):
        """entry-point pair / pool pair, measured alternately in this run."""
        entry, pool = self._interleaved(nbytes)
        return entry / pool
    track_entry_over_pool_ratio.unit = "ratio"
