"""gpumem on opencl:0 against pyopencl's own pool, ``MemoryPool(ImmediateAllocator(queue))``,
on the same device and context. Skipped (NotImplementedError) without pyopencl or an OpenCL
device; PoCL (``pip install pocl-binary-distribution``) provides one on any CPU.

Peers: ``gpumem`` (``mm.free(mm.malloc(n))``), ``gpumem+native`` (the same plus ``buf.native``,
the ``cl.Buffer`` sub-buffer a kernel takes, cached per block range), ``pyopencl``
(``pool.allocate(n).release()``: pyopencl's pool hands out a kernel-ready buffer directly).
``PyOpenCLArrays`` creates and drops ``pyopencl.array.Array`` objects through gpumem's allocator
(``gpumem.integrations.pyopencl``), pyopencl's pool, or none (a ``cl.Buffer`` each).
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


class KernelReady(_OpenCL):
    """malloc + the object a kernel takes + free, written inline (no helper call): gpumem's
    ``buf.native`` against pyopencl's pool, whose ``allocate`` result is already one."""

    params = [["gpumem", "pyopencl"]]
    param_names = ["peer"]

    def setup(self, peer):
        self._open(peer)
        self.time_pairs_1000(peer)

    def teardown(self, peer):
        self._close()

    def time_pairs_1000(self, peer):
        if peer == "pyopencl":
            allocate, release = self.pool.allocate, self.release
            for _ in range(1000):
                b = allocate(4 * KiB)
                release(b)
        else:
            malloc, free = self.mm.malloc, self.mm.free
            for _ in range(1000):
                b = malloc(4 * KiB)
                b.native
                free(b)


class PyOpenCLArrays(_OpenCL):
    """``pyopencl.array.Array(queue, (1024,), float32, allocator=...)`` created and dropped."""

    params = [["gpumem", "pyopencl", "none"]]
    param_names = ["peer"]

    def setup(self, peer):
        self._open(peer)
        import numpy as np
        import pyopencl.array as cla
        self.Array, self.f32 = cla.Array, np.dtype(np.float32)
        self.queue = self.mm.device.queue(0)
        if peer == "gpumem":
            from gpumem.integrations.pyopencl import allocator
            self.allocator = allocator(self.mm)
        else:
            self.allocator = self.pool           # None for "none"
        self.time_create_drop_100(peer)

    def teardown(self, peer):
        self.allocator = None
        self._close()

    def time_create_drop_100(self, peer):
        Array, queue, f32, alloc = self.Array, self.queue, self.f32, self.allocator
        for _ in range(100):
            Array(queue, (1024,), f32, allocator=alloc)


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
