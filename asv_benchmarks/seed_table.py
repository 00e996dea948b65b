"""The seed's benchmark table, measured: five allocation scenarios, every allocator in one run.

    python asv_benchmarks/compare.py --seed-table [--quick]                  # PoCL (OpenCL)
    python asv_benchmarks/compare.py --seed-table --backend cuda [--quick]   # a GPU (ci/gpu.sh)

The seed (a segment-block allocator) reported a table against PyTorch's caching allocator:
same-size allocations 1.43x, large allocations over 1 MiB 3.92x, transformer training 1.89x,
memory pressure 4.83x, variable sizes 0.83x, without saying what each row was. The scenarios
below are gpumem's definitions of those five rows (docs/benchmarks.md, "The seed table"): each
is a fixed stream of allocations and frees (seeded, the same for every allocator), built here
as a ``Trace`` and replayed through each allocator's alloc/free.

Peers on OpenCL: gpumem with the sub-buffer a kernel takes (``malloc`` + ``.native``, the row
the ratios are taken against), gpumem by address only (``malloc``), pyopencl's
``MemoryPool(ImmediateAllocator)``, and no pool (a ``cl.Buffer`` created and released per
allocation: one driver call each way). On CUDA: gpumem, torch's caching allocator, CuPy's
``MemoryPool``, RMM's ``PoolMemoryResource`` and no pool (``cuMemAlloc``/``cuMemFree``); each
is skipped with the reason when its package or the GPU is absent.

Method: one untimed pass per peer first (pools warm, as in a training loop's second step), then
R timed passes per peer, peers interleaved pass by pass (A B C A B C ...); each pass starts and
ends with nothing live. Figures: median ns per event (an allocation or a free) and the paired
ratio peer / gpumem (the median over passes of the two passes' ratio): above 1, gpumem is faster.
"""
from __future__ import annotations

import gc
import math
import random
import statistics
import time

from benchmarks import KiB, MiB, Trace, log_uniform_sizes, read_trace, replay
from compare_peers import (CudaRawPeer, CupyPeer, Inst, Peer, RmmPeer, TorchPeer)
from compare_timing import NOTES, RESULTS, Skip, record, skipped

#: the pressure scenario's budget: every allocator is held to it (see `pressure`)
PRESSURE_BUDGET = 256 * MiB
#: the transformer trace is scaled so that its peak live bytes fit this (OpenCL: PoCL's
#: "device" is this machine's RAM, shared); on CUDA the trace runs unscaled when it fits
TRAINING_PEAK = 512 * MiB
BASE_ROW = "gpumem"


# =============================================================================================
# the five scenarios: (alloc flags, ids, sizes) streams
# =============================================================================================
class _Builder:
    """Builds a Trace from slot operations: alloc(slot, n), free(slot)."""

    def __init__(self, name: str):
        self.name = name
        self.alloc: list[bool] = []
        self.ids: list[int] = []
        self.sizes: list[int] = []
        self.live: dict[int, tuple[int, int]] = {}        # slot -> (id, size)
        self.next_id = 0

    def add(self, slot: int, n: int) -> None:
        self.alloc.append(True)
        self.ids.append(self.next_id)
        self.sizes.append(n)
        self.live[slot] = (self.next_id, n)
        self.next_id += 1

    def free(self, slot: int) -> None:
        i, n = self.live.pop(slot)
        self.alloc.append(False)
        self.ids.append(i)
        self.sizes.append(n)

    def trace(self) -> Trace:
        for slot in list(self.live):                      # every pass ends with nothing live
            self.free(slot)
        return Trace(self.name, self.alloc, self.ids, self.sizes)


def same_size(quick: bool) -> Trace:
    """64 buffers of 256 KiB allocated, then all freed; 200 rounds (quick: 50)."""
    b = _Builder("same-size")
    for _ in range(50 if quick else 200):
        for s in range(64):
            b.add(s, 256 * KiB)
        for s in range(64):
            b.free(s)
    return b.trace()


def large(quick: bool) -> Trace:
    """16 live buffers of log-uniform sizes in (1 MiB, 32 MiB]; each step frees a random one
    and allocates a new size in its place; 4,000 steps (quick: 1,000)."""
    rng = random.Random(21)
    b = _Builder("large")
    steps = 1000 if quick else 4000
    sizes = log_uniform_sizes(rng, 16 + steps, MiB + 1, 32 * MiB)
    for s in range(16):
        b.add(s, sizes[s])
    for k in range(steps):
        s = rng.randrange(16)
        b.free(s)
        b.add(s, sizes[16 + k])
    return b.trace()


def training(quick: bool, peak: int = TRAINING_PEAK) -> Trace:
    """The gpt2_train trace (PyTorch GPT-2-small training, 3 steps, 15,284 events; see
    gpumem/data/traces/README.md), sizes scaled down so its peak live bytes fit `peak`."""
    t = read_trace("gpt2_train")
    if t.peak_live > peak:
        t = t.scaled(math.floor(peak / t.peak_live * 1000) / 1000)
    t.name = "transformer training"
    return t


def pressure(quick: bool, budget: int = PRESSURE_BUDGET) -> Trace:
    """Log-uniform sizes in [64 KiB, 8 MiB]; live bytes are driven to 70 % of `budget`, then
    each step frees random buffers until the new one fits under 70 % again (and, while above
    55 %, frees more at random) and allocates it. 3,000 steps (quick: 800). Every allocator is
    held to `budget` (gpumem: its usable memory; pyopencl: its held blocks freed when a request
    would pass it; on CUDA: torch's memory fraction, CuPy's pool limit, RMM's maximum pool
    size), so what cannot be served from the cache must be given back and asked for again.
    (Driven to 80 % instead, gpumem fails the quick stream with OutOfMemoryError: the
    budget is split between live blocks and cached pieces of partly used segments, none as
    large as the request; 75 % passes. docs/benchmarks.md, "The seed table".)"""
    rng = random.Random(48)
    b = _Builder("memory pressure")
    high, low = int(0.70 * budget), int(0.55 * budget)
    steps = 800 if quick else 3000
    sizes = log_uniform_sizes(rng, steps + 4096, 64 * KiB, 8 * MiB)
    live = 0
    slot = 0
    k = 0
    while live + sizes[k] <= high:                     # fill
        b.add(slot, sizes[k])
        live += sizes[k]
        slot += 1
        k += 1
    for _ in range(steps):
        n = sizes[k]
        k += 1
        while live + n > high or (live > low and rng.random() < 0.5):
            s = rng.choice(list(b.live))
            live -= b.live[s][1]
            b.free(s)
        b.add(slot, n)
        live += n
        slot += 1
    return b.trace()


def variable(quick: bool) -> Trace:
    """500 live buffers of log-uniform sizes in [512 B, 4 MiB]; each step frees a random one
    and allocates a new size; 10,000 steps (quick: 3,000)."""
    rng = random.Random(83)
    b = _Builder("variable sizes")
    live, steps = 500, 3000 if quick else 10000
    sizes = log_uniform_sizes(rng, live + steps, 512, 4 * MiB)
    for s in range(live):
        b.add(s, sizes[s])
    for k in range(steps):
        s = rng.randrange(live)
        b.free(s)
        b.add(s, sizes[live + k])
    return b.trace()


#: (row name, builder, the seed's figure vs PyTorch)
SCENARIOS = (("same-size allocations", same_size, 1.43),
             ("large allocations (> 1 MiB)", large, 3.92),
             ("transformer training", training, 1.89),
             ("memory pressure", pressure, 4.83),
             ("variable sizes", variable, 0.83))


# =============================================================================================
# peers (a budget: None, or the bytes the pressure scenario holds every allocator to)
# =============================================================================================
class GpumemSeedPeer(Peer):
    """gpumem on `device`; `native`: each allocation also takes the OpenCL sub-buffer a kernel
    needs (``buf.native``); `budget`: usable memory set to it (no reserve, no CPU fallback)."""

    def __init__(self, device: str, name: str = BASE_ROW, native: bool = False,
                 budget: int | None = None):
        self.device, self.name, self.native, self.budget = device, name, native, budget

    def _config(self):
        from gpumem import MemoryConfig, MemoryManager
        if self.budget is None:
            return MemoryConfig(cpu_fallback_enabled=False)
        probe = MemoryManager(self.device)
        _, total = probe.memory_info()
        probe.close()
        return MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0, reserve_bytes=0,
                            gpu_memory_fraction=self.budget / total)

    def open(self):
        try:
            self.config = self._config()
        except Exception as exc:
            raise Skip(f"{type(exc).__name__}: {exc}") from None

    def make(self) -> Inst:
        from gpumem import MemoryManager
        mm = MemoryManager(self.device, self.config)
        malloc = mm.malloc
        if self.native:
            def alloc(n):
                buf = malloc(n)
                buf.native
                return buf
        else:
            alloc = malloc
        return Inst(alloc, mm.free, mm.close,
                    peak=lambda: mm.pool.counters()["peak_reserved_bytes"])


class PyOpenCLSeedPeer(Peer):
    """pyopencl's MemoryPool(ImmediateAllocator) on gpumem's context and queue. With a budget,
    a request that would take the pool's managed bytes past it first frees the pool's held
    blocks (``free_held``): what the pool does when the driver refuses an allocation, which
    PoCL (host memory) would not do at this size."""
    name = "pyopencl MemoryPool"

    def __init__(self, budget: int | None = None):
        self.budget = budget

    def open(self):
        try:
            import pyopencl  # noqa: F401
            from gpumem import MemoryManager
            self.mm = MemoryManager("opencl:0")
        except Exception as exc:
            raise Skip(f"{type(exc).__name__}: {exc}") from None
        self.queue = self.mm.device.queue(0)

    def make(self) -> Inst:
        import pyopencl.tools as cl_tools
        pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(self.queue))
        release = cl_tools.PooledBuffer.release
        if self.budget is None:
            alloc = pool.allocate
        else:
            budget, allocate, free_held = self.budget, pool.allocate, pool.free_held

            def alloc(n):
                if pool.managed_bytes + n > budget:
                    free_held()
                return allocate(n)
        return Inst(alloc, release, pool.stop_holding, poll=lambda: pool.managed_bytes)

    def shutdown(self):
        self.mm.close()


class OpenCLNoPoolPeer(Peer):
    """A ``cl.Buffer`` created per allocation and released per free (clCreateBuffer /
    clReleaseMemObject): the baseline without any pool."""
    name = "no pool (cl.Buffer each)"

    def open(self):
        try:
            import pyopencl as cl
            from gpumem import MemoryManager
            self.mm = MemoryManager("opencl:0")
        except Exception as exc:
            raise Skip(f"{type(exc).__name__}: {exc}") from None
        self.cl = cl
        self.ctx = self.mm.device.context

    def make(self) -> Inst:
        Buffer, ctx, flags = self.cl.Buffer, self.ctx, self.cl.mem_flags.READ_WRITE

        def alloc(n):
            return Buffer(ctx, flags, n)
        return Inst(alloc, self.cl.MemoryObject.release, lambda: None)

    def shutdown(self):
        self.mm.close()


def opencl_peers(budget: int | None) -> list[Peer]:
    return [GpumemSeedPeer("opencl:0", native=True, budget=budget),
            GpumemSeedPeer("opencl:0", name="gpumem, address only (malloc)", budget=budget),
            PyOpenCLSeedPeer(budget), OpenCLNoPoolPeer()]


def cuda_peers(budget: int | None) -> list[Peer]:
    return [GpumemSeedPeer("cuda:0", budget=budget), TorchPeer(budget), CupyPeer(budget),
            RmmPeer(budget), CudaRawPeer()]


# =============================================================================================
# running
# =============================================================================================
def _open(candidates: list[Peer], bench: str) -> list[Peer]:
    peers = []
    for p in candidates:
        try:
            p.open()
            peers.append(p)
        except Skip as exc:
            skipped(bench, p.name, str(exc))
    return peers


def run_scenario(label: str, trace: Trace, candidates: list[Peer], passes: int) -> None:
    """Replay `trace` through every peer: one warm pass, then `passes` timed passes, peers
    interleaved; records ns per event and the paired ratio to the gpumem row."""
    peers = _open(candidates, label)
    insts, samples = {}, {}
    try:
        for p in peers:
            try:
                inst = p.make()
                replay(trace, inst.alloc, inst.free)          # warm, untimed
                insts[p.name], samples[p.name] = inst, []
            except Exception as exc:
                skipped(label, p.name, f"{type(exc).__name__}: {exc}")
        gc_on = gc.isenabled()
        gc.disable()
        try:
            for r in range(passes):
                names = list(insts) if r % 2 == 0 else list(insts)[::-1]
                for name in names:
                    if name not in samples:
                        continue
                    inst = insts[name]
                    t0 = time.perf_counter_ns()
                    try:
                        replay(trace, inst.alloc, inst.free)
                    except Exception as exc:
                        skipped(label, name, f"{type(exc).__name__}: {exc}")
                        del samples[name]
                        continue
                    samples[name].append((time.perf_counter_ns() - t0) / trace.n_events)
        finally:
            if gc_on:
                gc.enable()
        base = samples.get(BASE_ROW)
        for name, s in samples.items():
            paired = None
            if base is not None and len(base) == len(s):
                paired = statistics.median(a / b for a, b in zip(s, base))
            peak = insts[name].peak() if insts[name].peak is not None else None
            record(f"seed: {label}", name, s, paired_ratio=paired,
                   note=f"{trace.n_events} events per pass"
                        + (f"; peak reserved {peak / MiB:.0f} MiB" if peak else ""))
    finally:
        for inst in insts.values():
            try:
                inst.close()
            except Exception:
                pass
        for p in peers:
            p.shutdown()


def run(timer, backend: str) -> list[str]:
    """Every scenario on `backend` ("opencl" or "cuda"); the seed table's lines."""
    passes = 7 if timer.quick else 21
    peers_for = opencl_peers if backend == "opencl" else cuda_peers
    training_peak = TRAINING_PEAK
    if backend == "cuda":
        training_peak = _cuda_training_peak()
    for label, build, _ in SCENARIOS:
        if build is training:
            trace = training(timer.quick, training_peak)
        else:
            trace = build(timer.quick)
        budget = PRESSURE_BUDGET if build is pressure else None
        print(f"  {label}: {trace.n_events} events per pass, peak live "
              f"{trace.peak_live / MiB:.0f} MiB" + (f" (sizes x{trace.scale:g})"
                                                    if trace.scale != 1.0 else ""))
        run_scenario(label, trace, peers_for(budget), passes)
    NOTES.append(f"seed table: {passes} timed passes per peer after one warm pass; ratios are "
                 f"paired (peer / {BASE_ROW}, same pass round), above 1: gpumem faster")
    return table_lines()


def _cuda_training_peak() -> int:
    """The whole trace when a quarter of the GPU's free memory holds it, else scaled to that."""
    try:
        from gpumem import MemoryManager
        probe = MemoryManager("cuda:0")
        free, _ = probe.memory_info()
        probe.close()
        return max(TRAINING_PEAK, free // 4)
    except Exception:
        return TRAINING_PEAK


def table_lines() -> list[str]:
    """The seed table as markdown rows: scenario, gpumem ns/event, each peer's paired ratio."""
    rows = [r for r in RESULTS if r.get("bench", "").startswith("seed: ") and "median" in r]
    peers = []
    for r in rows:
        if r["peer"] != BASE_ROW and r["peer"] not in peers:
            peers.append(r["peer"])
    head = ["scenario", f"{BASE_ROW} ns/event"] + [f"{p} (ratio)" for p in peers] + \
        ["seed vs PyTorch"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label, _, seed in SCENARIOS:
        mine = {r["peer"]: r for r in rows if r["bench"] == f"seed: {label}"}
        base = mine.get(BASE_ROW)
        cells = []
        for p in peers:
            r = mine.get(p)
            if r is None:
                cells.append("skipped")
            elif r.get("paired_ratio") is None:
                cells.append(f"{r['median']:.0f} ns")
            else:
                cells.append(f"{r['median']:.0f} ns ({r['paired_ratio']:.2f}x)")
        mine_ns = "-" if base is None else f"{base['median']:.0f}"
        lines.append("| " + " | ".join([label, mine_ns] + cells + [f"{seed}x"]) + " |")
    return lines
