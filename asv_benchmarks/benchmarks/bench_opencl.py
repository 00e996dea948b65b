"""gpumem on opencl:0 against pyopencl's own pool, ``MemoryPool(ImmediateAllocator(queue))``,
on the same device and context. Skipped (NotImplementedError) without pyopencl or an OpenCL
device; PoCL (``pip install pocl-binary-distribution``) provides one on any CPU.

Peers: ``gpumem`` (``mm.free(mm.malloc(n))``), ``gpumem+native`` (the same plus ``buf.native``,
the ``cl.Buffer`` sub-buffer a kernel would take: pyopencl's pool hands out a usable buffer
directly, gpumem builds the sub-buffer on request), ``pyopencl`` (``pool.allocate(n).release()``).
"""
from . import (OPS_PER_CALL, KiB, MiB, MixedWorkload, device_budget, fitting_live_count, opencl_available,
               pyopencl_pool_for)

PEERS = ["gpumem", "gpumem+native", "pyopencl"]


class _OpenCL:
    def _open(self, peer):
        ok, reason = opencl_available()
        if not ok:
            raise NotImplementedError(f"OpenCL unavailable: {reason}")
        from gpumem import MemoryManager
        self.mm = MemoryManager("opencl:0")
        self.pool = None
        if peer == "pyopencl":
            self.pool, self.queue = pyopencl_pool_for(self.mm)
            buf = self.pool.allocate(1)
            self.release = type(buf).release
            buf.release()

    def _close(self):
        if self.pool is not None:
            self.pool.stop_holding()
        self.mm.close()

    def _alloc_free(self, peer):
        """(alloc, free) callables for the peer."""
        if peer == "pyopencl":
            return self.pool.allocate, self.release
        if peer == "gpumem+native":
            malloc = self.mm.malloc

            def alloc(n):
                buf = malloc(n)
                buf.native
                return buf
            return alloc, self.mm.free
        return self.mm.malloc, self.mm.free


class HitPair(_OpenCL):
    params = [PEERS, [4 * KiB, 1 * MiB]]
    param_names = ["peer", "nbytes"]

    def setup(self, peer, nbytes):
        self._open(peer)
        self.alloc, self.free = self._alloc_free(peer)
        self.free(self.alloc(nbytes))

    def teardown(self, peer, nbytes):
        self._close()

    def time_1000_alloc_free(self, peer, nbytes):
        """1000 pairs per call (asv's time / 1000 = one pair, as compare.py reports)."""
        alloc, free = self.alloc, self.free
        for _ in range(OPS_PER_CALL):
            free(alloc(nbytes))


class Mixed(_OpenCL):
    """Log-uniform random sizes 1 KiB..4 MiB (mean ~492 KiB); 10,000 live, or as many as fit
    in half of what gpumem may take from the device (PoCL reports 3-4 GiB: ~3,000 live).
    1000 steps per call, after 5,000 warmup steps."""

    params = [PEERS]
    param_names = ["peer"]
    timeout = 300

    def setup(self, peer):
        self._open(peer)
        live = fitting_live_count(device_budget(self.mm))
        self.work = MixedWorkload(live=live, lo=1 * KiB, hi=4 * MiB)
        alloc, free = self._alloc_free(peer)
        self.handles = self.work.start(alloc)
        self.run = self.work.runner(alloc, free, self.handles)
        self.run(5_000)

    def teardown(self, peer):
        self.handles.clear()
        self._close()

    def time_steps_1000(self, peer):
        self.run(1000)
