"""compare.py's peers: the allocators measured side by side (gpumem, pyopencl's MemoryPool,
raw CUDA, cudaMallocAsync, cuda.core, CuPy, torch, and the model of torch's caching allocator),
each made into an ``Inst`` of alloc/free/close/peak; a peer whose package or device is absent
raises Skip with the reason. A peer with ``timed = False`` is a model: it appears in the
fragmentation (peak held / peak live) tables only, never in timings."""
from __future__ import annotations

from compare_timing import Skip, skipped

# =============================================================================================
# allocator instances ("peers"): alloc, free (None: freed when the handle is dropped),
# peak held bytes, close
# =============================================================================================
class Inst:
    def __init__(self, alloc, free, close, peak=None, poll=None):
        self.alloc, self.free, self.close = alloc, free, close
        self.peak = peak                 # () -> peak bytes held since creation, or None
        self.poll = poll                 # () -> bytes held now (polled after each alloc)


class Peer:
    name = "?"
    timed = True                  # False: only its peak bytes are reported

    def open(self) -> None:
        """Raise Skip(reason) when unavailable."""

    def make(self) -> Inst:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class GpumemPeer(Peer):
    def __init__(self, device: str, name: str = "gpumem", config=None, history: bool = True,
                 record: bool = False):
        self.device, self.name, self.config = device, name, config
        self.history = history            # the pool's always-on C history (False: turned off)
        self.record = record              # MemoryManager.record_history() running

    def open(self):
        from gpumem import MemoryManager
        try:
            MemoryManager(self.device, self.config).close()
        except Exception as exc:
            raise Skip(f"{type(exc).__name__}: {exc}") from None

    def make(self) -> Inst:
        from gpumem import MemoryManager
        mm = MemoryManager(self.device, self.config)
        if not self.history:
            mm.pool.set_history(0)
        rec = mm.record_history() if self.record else None
        self.last = mm

        def close():
            if rec is not None:
                rec.stop()
            mm.close()
        return Inst(mm.malloc, mm.free, close,
                    peak=lambda: mm.pool.counters()["peak_reserved_bytes"])


# --- OpenCL --------------------------------------------------------------------------------
class PyOpenCLPeer(Peer):
    name = "pyopencl MemoryPool"

    def __init__(self, device: str):
        self.device = device

    def open(self):
        try:
            import pyopencl  # noqa: F401
            from gpumem import MemoryManager
            self.mm = MemoryManager(self.device)       # only for its context and queue
        except Exception as exc:
            raise Skip(f"{type(exc).__name__}: {exc}") from None
        self.queue = self.mm.device.queue(0)

    def make(self) -> Inst:
        import pyopencl.tools as cl_tools
        pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(self.queue))
        release = type(pool.allocate(1)).release       # PooledBuffer.release
        pool.free_held()
        return Inst(pool.allocate, release, pool.stop_holding,
                    poll=lambda: pool.managed_bytes)

    def shutdown(self):
        self.mm.close()


# --- CUDA (written against the documented APIs; not runnable on the machine the figures in
# docs/benchmarks.md come from) -------------------------------------------------------------
def _cuda_driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver       # cuda-python < 12.6
        except ImportError as exc:
            raise Skip(f"cuda-python is not installed: {exc}") from None
    return driver


def _check(drv, res, what):
    """cuda-python returns (CUresult, outputs...): raise on an error, return the output(s)."""
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    if not isinstance(res, tuple) or len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


class _CudaContext:
    """The primary context of device 0, made current (the one gpumem, CuPy, torch use)."""
    drv = None

    @classmethod
    def get(cls):
        if cls.drv is None:
            drv = _cuda_driver()
            _check(drv, drv.cuInit(0), "cuInit")
            dev = _check(drv, drv.cuDeviceGet(0), "cuDeviceGet")
            ctx = _check(drv, drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check(drv, drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            cls.drv, cls.dev, cls.ctx = drv, dev, ctx
        return cls


class CudaRawPeer(Peer):
    name = "cuMemAlloc/cuMemFree"

    def open(self):
        try:
            self.c = _CudaContext.get()
        except Skip:
            raise
        except Exception as exc:
            raise Skip(f"no CUDA device: {exc}") from None

    def make(self) -> Inst:
        drv = self.c.drv
        cuMemAlloc, cuMemFree = drv.cuMemAlloc, drv.cuMemFree

        def alloc(n):
            err, ptr = cuMemAlloc(n)
            if int(err):
                raise MemoryError(f"cuMemAlloc({n}): {err}")
            return ptr

        def free(ptr):
            (err,) = cuMemFree(ptr)
            if int(err):
                raise RuntimeError(f"cuMemFree: {err}")

        return Inst(alloc, free, lambda: None)


class CudaAsyncPeer(Peer):
    """cuMemAllocAsync/cuMemFreeAsync on one stream, from the device's default memory pool with
    its release threshold raised to the maximum (so the pool caches, as CuPy's and RMM's async
    resources configure it)."""
    name = "cuMemAllocAsync (stream)"

    def open(self):
        try:
            self.c = _CudaContext.get()
            drv = self.c.drv
            self.stream = _check(drv, drv.cuStreamCreate(0), "cuStreamCreate")
            self.pool = _check(drv, drv.cuDeviceGetDefaultMemPool(self.c.dev),
                               "cuDeviceGetDefaultMemPool")
            attr = drv.CUmemPool_attribute
            _check(drv, drv.cuMemPoolSetAttribute(self.pool,
                                                  attr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                                  drv.cuuint64_t(2**64 - 1)),
                   "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
        except Skip:
            raise
        except Exception as exc:
            raise Skip(f"stream-ordered allocator unavailable: {type(exc).__name__}: {exc}") \
                from None

    def _reset_high(self):
        drv = self.c.drv
        attr = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        drv.cuMemPoolSetAttribute(self.pool, attr, drv.cuuint64_t(0))

    def _peak(self):
        """The pool's reserved high-water mark (None if the query fails)."""
        drv = self.c.drv
        attr = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        try:
            return int(_check(drv, drv.cuMemPoolGetAttribute(self.pool, attr),
                              "cuMemPoolGetAttribute"))
        except Exception:
            return None

    def _close(self):
        drv = self.c.drv
        drv.cuStreamSynchronize(self.stream)
        drv.cuMemPoolTrimTo(self.pool, 0)

    def make(self) -> Inst:
        drv, stream = self.c.drv, self.stream
        cuMemAllocAsync, cuMemFreeAsync = drv.cuMemAllocAsync, drv.cuMemFreeAsync
        self._close()
        self._reset_high()

        def alloc(n):
            err, ptr = cuMemAllocAsync(n, stream)
            if int(err):
                raise MemoryError(f"cuMemAllocAsync({n}): {err}")
            return ptr

        def free(ptr):
            (err,) = cuMemFreeAsync(ptr, stream)
            if int(err):
                raise RuntimeError(f"cuMemFreeAsync: {err}")

        return Inst(alloc, free, self._close, peak=self._peak)


class CudaCorePeer(CudaAsyncPeer):
    """cuda.core's DeviceMemoryResource (the driver's stream-ordered pool, as above)."""
    name = "cuda.core DeviceMemoryResource"

    def open(self):
        super().open()
        try:
            try:
                from cuda.core import Device, DeviceMemoryResource
            except ImportError:
                from cuda.core.experimental import Device, DeviceMemoryResource
            dev = Device(0)
            dev.set_current()
            self.core_stream = dev.create_stream()
            self.mr = DeviceMemoryResource(dev.device_id)
            buf = self.mr.allocate(256, stream=self.core_stream)
            buf.close(self.core_stream)
        except Exception as exc:
            raise Skip(f"cuda.core unavailable: {type(exc).__name__}: {exc}") from None

    def make(self) -> Inst:
        self._close()
        self._reset_high()
        allocate, stream = self.mr.allocate, self.core_stream

        def alloc(n):
            return allocate(n, stream=stream)

        def free(buf):
            buf.close(stream)

        def close():
            stream.sync()
            self._close()

        return Inst(alloc, free, close, peak=self._peak)


class CupyPeer(Peer):
    """CuPy's MemoryPool; with a budget, ``set_limit(size=budget)`` (the pool frees its cached
    blocks and retries when a request would pass the limit)."""
    name = "CuPy MemoryPool"

    def __init__(self, budget: int | None = None):
        self.budget = budget

    def open(self):
        try:
            import cupy
            cupy.cuda.Device(0).use()
            self.cupy = cupy
        except Exception as exc:
            raise Skip(f"CuPy unavailable: {type(exc).__name__}: {exc}") from None

    def make(self) -> Inst:
        pool = self.cupy.cuda.MemoryPool()
        if self.budget is not None:
            pool.set_limit(size=self.budget)
        # MemoryPointer objects return to the pool when dropped: free=None
        return Inst(pool.malloc, None, pool.free_all_blocks, poll=pool.total_bytes)


class TorchPeer(Peer):
    """torch's CUDA caching allocator; with a budget, ``set_per_process_memory_fraction`` of
    the device's total (torch frees its cached blocks and retries before failing there)."""
    name = "torch caching allocator"

    def __init__(self, budget: int | None = None):
        self.budget = budget

    def open(self):
        try:
            import torch
            if not torch.cuda.is_available():
                raise Skip("torch has no CUDA device")
            self.torch = torch
        except Skip:
            raise
        except Exception as exc:
            raise Skip(f"torch unavailable: {type(exc).__name__}: {exc}") from None

    def make(self) -> Inst:
        cuda = self.torch.cuda
        cuda.synchronize()
        cuda.empty_cache()
        cuda.reset_peak_memory_stats(0)
        total = cuda.get_device_properties(0).total_memory
        cuda.set_per_process_memory_fraction(
            1.0 if self.budget is None else min(1.0, self.budget / total), 0)
        alloc, free = cuda.caching_allocator_alloc, cuda.caching_allocator_delete
        return Inst(alloc, free, cuda.empty_cache, peak=lambda: cuda.max_memory_reserved(0))



class RmmPeer(Peer):
    """RAPIDS RMM's ``PoolMemoryResource`` over ``CudaMemoryResource`` (the pool RMM users
    configure); with a budget, ``maximum_pool_size=budget`` (RMM's pool then fails a request it
    cannot place: it does not give memory back). Handles are (pointer, size)."""
    name = "RMM PoolMemoryResource"

    def __init__(self, budget: int | None = None):
        self.budget = budget

    def open(self):
        try:
            import rmm.mr
            self.mr_module = rmm.mr
            _CudaContext.get()
        except Skip:
            raise
        except Exception as exc:
            raise Skip(f"RMM unavailable: {type(exc).__name__}: {exc}") from None

    def make(self) -> Inst:
        mr_module = self.mr_module
        kwargs = {} if self.budget is None else {"initial_pool_size": self.budget,
                                                  "maximum_pool_size": self.budget}
        mr = mr_module.PoolMemoryResource(mr_module.CudaMemoryResource(), **kwargs)
        allocate, deallocate = mr.allocate, mr.deallocate

        def alloc(n):
            return (allocate(n), n)

        def free(handle):
            deallocate(handle[0], handle[1])

        return Inst(alloc, free, lambda: None)


class TorchModelPeer(Peer):
    """gpumem.TorchAllocatorModel: PyTorch's caching allocator policy replayed without a GPU
    (docs/torch_model.md), on a device of ``capacity`` bytes with PYTORCH_CUDA_ALLOC_CONF
    ``conf``. Its peak is the bytes torch would reserve (cudaMalloc'd or mapped)."""
    timed = False

    def __init__(self, capacity: int, conf: str = ""):
        self.capacity, self.conf = capacity, conf
        short = {"": "", "expandable_segments:True": "expandable"}.get(conf, conf)
        self.name = "torch model" + (f" ({short})" if short else "")

    def make(self) -> Inst:
        from gpumem import TorchAllocatorModel
        m = TorchAllocatorModel(self.capacity, self.conf)
        return Inst(m.malloc, m.free, lambda: None, peak=lambda: m.peak_reserved_bytes)


def torch_model_peers(capacity: int) -> list[Peer]:
    """The model with torch's default settings and with expandable segments."""
    return [TorchModelPeer(capacity), TorchModelPeer(capacity, "expandable_segments:True")]


def _make_all(bench: str, peers: list[Peer]) -> dict:
    insts = {}
    for peer in peers:
        try:
            insts[peer.name] = peer.make()
        except Exception as exc:
            skipped(bench, peer.name, f"{type(exc).__name__}: {exc}")
    return insts


def open_peers(candidates: list[Peer]) -> list[Peer]:
    peers = []
    for p in candidates:
        try:
            p.open()
            peers.append(p)
            print(f"  peer {p.name}: ok")
        except Skip as exc:
            print(f"  peer {p.name}: SKIPPED ({exc})")
            skipped("(all)", p.name, str(exc))
        except Exception as exc:
            print(f"  peer {p.name}: SKIPPED ({type(exc).__name__}: {exc})")
            skipped("(all)", p.name, f"{type(exc).__name__}: {exc}")
    return peers
