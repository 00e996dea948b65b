"""gpumem against its peers, all in ONE process, with medians and ratios.

    python asv_benchmarks/compare.py --backend sim     [--quick] [--json out.json]
    python asv_benchmarks/compare.py --backend opencl  [--quick] [--json out.json]
    python asv_benchmarks/compare.py --backend cuda    [--quick] [--json out.json]
    python asv_benchmarks/compare.py --seed-table [--backend opencl|cuda] [--quick]

sim     C-level pool hit pair (the .pxd API, compiled _cbench), the O(1) check (1,000,000 vs 10
        cached free blocks, one run), Python-level hit pair and mixed workload on a 1 TiB
        simulated device, trace replay (time, peak reserved / peak live) of the shipped and
        synthetic traces.
opencl  gpumem MemoryManager("opencl:0") vs pyopencl.tools.MemoryPool(ImmediateAllocator(queue))
        on the same device and context: hit pair, the kernel-ready pair (malloc + buf.native +
        free vs allocate + release), pyopencl arrays created and dropped through each pool
        (gpumem.integrations.pyopencl.allocator), mixed sizes, trace replay (+ peak held).
cuda    gpumem MemoryManager("cuda:0") vs raw cuMemAlloc/cuMemFree, cuMemAllocAsync/FreeAsync
        on a stream, cuda.core DeviceMemoryResource, CuPy MemoryPool, torch's caching allocator;
        each peer is skipped with the reason when its package (or the GPU) is absent.
--seed-table  the five scenarios of the seed's table (seed_table.py, docs/benchmarks.md) on
        opencl (the default: vs pyopencl's pool and a cl.Buffer per allocation) or cuda (vs
        torch, CuPy, RMM and cuMemAlloc per allocation).

Every peak held / peak live table also shows the model of PyTorch's caching allocator
(gpumem.TorchAllocatorModel, default and expandable_segments:True): untimed, a model.

Method: timeit-style. Each figure is the median over R repeats of (time of k calls) / k ops,
k chosen so one repeat lasts >= 0.2 s (0.05 s with --quick); the garbage collector is off while
timing. Ratio = peer / gpumem (above 1: gpumem is faster). Python-level figures include the
Python loop around the calls, the same for every peer ("python loop + 2 calls" shows its cost).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))    # this checkout's gpumem, not an older installed copy

from benchmarks import (KiB, MiB, MixedWorkload, device_budget,  # noqa: E402
                        fitting_live_count, log_uniform_mean, read_trace, replay,
                        sim_device_string, trace_names)
from compare_peers import (CudaAsyncPeer, CudaCorePeer, CudaRawPeer, CupyPeer,  # noqa: E402
                           GpumemPeer, Peer, PyOpenCLPeer, TorchPeer, _make_all, open_peers,
                           torch_model_peers)
from compare_timing import (NOTES, RESULTS, Skip, Timer, fmt_size, fmt_value, print_table,  # noqa: E402
                            record, skipped)

#: the Python hit pair's floor: the same calls building a Buffer-shaped object, no pool
FLOOR_ROW = "floor: Cython, no pool"


def bench_kernel_ready(timer: Timer, n: int = 4 * KiB) -> None:
    """What an OpenCL user pays per block a kernel can take: gpumem's ``malloc`` + ``.native``
    (the cached sub-buffer) + ``free`` against pyopencl's ``MemoryPool.allocate`` (already a
    kernel argument) + ``release``; same context, each loop written inline."""
    import pyopencl.tools as cl_tools
    from gpumem import MemoryManager
    bench = f"kernel-ready pair {fmt_size(n)}"
    mm = MemoryManager("opencl:0")
    pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(mm.device.queue(0)))
    try:
        malloc, free = mm.malloc, mm.free
        allocate, release = pool.allocate, cl_tools.PooledBuffer.release

        def gpumem(k):
            for _ in range(k):
                b = malloc(n)
                b.native
                free(b)

        def gpumem_address(k):
            for _ in range(k):
                b = malloc(n)
                b.ptr
                free(b)

        def pyopencl(k):
            for _ in range(k):
                b = allocate(n)
                release(b)

        f1, f2 = abs, abs

        def floor(k):
            for _ in range(k):
                b = f1(n)
                f2(b)
        runs = {"gpumem": gpumem, "gpumem, address only (.ptr)": gpumem_address,
                "pyopencl MemoryPool": pyopencl, "python loop + 2 calls": floor}
        for run in runs.values():
            run(100)                         # warm: segments made, sub-buffer cached
        ops = dict.fromkeys(runs, 5000)
        for name, (samples, paired) in timer.paired(runs, ops, "gpumem").items():
            record(bench, name, samples, paired_ratio=paired,
                   note="reference: loop cost in every row" if "loop" in name else "")
    finally:
        pool.stop_holding()
        mm.close()


def bench_pyopencl_arrays(timer: Timer, n: int = 1024) -> None:
    """``pyopencl.array.Array(queue, (n,), float32, allocator=...)`` created and dropped, and
    ``a + b`` (a kernel launch plus a result array), with gpumem's allocator
    (``gpumem.integrations.pyopencl``), pyopencl's MemoryPool and no allocator (a fresh
    ``cl.Buffer`` per array), one queue of one context."""
    import numpy as np
    import pyopencl.array as cla
    import pyopencl.tools as cl_tools
    from gpumem import MemoryManager
    from gpumem.integrations.pyopencl import allocator
    mm = MemoryManager("opencl:0")
    queue = mm.device.queue(0)
    pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue))
    allocators = {"gpumem": allocator(mm), "pyopencl MemoryPool": pool,
                  "no allocator (cl.Buffer each)": None}
    try:
        Array, f32 = cla.Array, np.dtype(np.float32)
        create = {}
        for name, alloc in allocators.items():
            def run(k, alloc=alloc):
                for _ in range(k):
                    Array(queue, (n,), f32, allocator=alloc)
            create[name] = run
        for run in create.values():
            run(100)
        for name, (samples, paired) in timer.paired(create, dict.fromkeys(create, 200),
                                                    "gpumem").items():
            record(f"pyopencl Array create+drop {n} float32", name, samples,
                   paired_ratio=paired)
        add = {}
        x = np.arange(n, dtype=np.float32)
        for name, alloc in allocators.items():
            a = cla.to_device(queue, x, allocator=alloc)
            b = cla.to_device(queue, x, allocator=alloc)

            def run(k, a=a, b=b):
                for _ in range(k):
                    a + b
                queue.finish()
            add[name] = run
        for run in add.values():
            run(20)
        for name, (samples, paired) in timer.paired(add, dict.fromkeys(add, 100),
                                                    "gpumem").items():
            record(f"pyopencl a + b {n} float32", name, samples, paired_ratio=paired)
    finally:
        allocators.clear()
        pool.stop_holding()
        mm.close()


# =============================================================================================
# benchmarks shared by the device modes
# =============================================================================================
def bench_hit_pairs(timer: Timer, peers: list[Peer], sizes=(4 * KiB, 1 * MiB),
                    floor_manager=None) -> None:
    """alloc+free of one cached size, every peer (and the bare Python loop) interleaved.
    ``floor_manager``: _cbench.FloorManager, whose malloc/free build and drop a Buffer-shaped
    Cython object with no pool behind it (the floor under gpumem's row)."""
    for n in sizes:
        bench = f"hit pair {fmt_size(n)}"
        insts = _make_all(bench, peers)
        runs = {}
        for name, inst in insts.items():
            alloc, free = inst.alloc, inst.free
            try:
                if free is None:
                    alloc(n)

                    def run(k, alloc=alloc, n=n):
                        for _ in range(k):
                            alloc(n)
                else:
                    free(alloc(n))

                    def run(k, alloc=alloc, free=free, n=n):
                        for _ in range(k):
                            free(alloc(n))
                runs[name] = run
            except Exception as exc:
                skipped(bench, name, f"{type(exc).__name__}: {exc}")
        f1, f2 = abs, abs            # the Python-level floor: the same loop, two trivial calls

        def floor(k, n=n):
            for _ in range(k):
                f2(f1(n))
        runs["python loop + 2 calls"] = floor
        if floor_manager is not None:
            def cython_floor(k, alloc=floor_manager.malloc, free=floor_manager.free, n=n):
                for _ in range(k):
                    free(alloc(n))
            runs[FLOOR_ROW] = cython_floor
        try:
            for name, samples in timer.interleaved(runs).items():
                note = "reference: loop cost in every row" if name == "python loop + 2 calls" \
                    else "reference: no pool, same calls" if name == FLOOR_ROW else ""
                record(bench, name, samples, note=note)
        except Exception as exc:
            skipped(bench, "(some peer)", f"{type(exc).__name__}: {exc}")
        finally:
            for inst in insts.values():
                inst.close()


def bench_mixed(timer: Timer, peers: list[Peer], live: int, warmup: int = 20_000) -> None:
    """Each step frees a random live buffer and allocates a new random size (log-uniform
    1 KiB..4 MiB); all peers hold their `live` buffers at once and are timed interleaved."""
    bench = f"mixed 1KiB-4MiB, {live} live"
    insts = _make_all(bench, peers)
    runs, held = {}, {}
    try:
        for name, inst in insts.items():
            try:
                work = MixedWorkload(live=live, lo=1 * KiB, hi=4 * MiB)
                held[name] = handles = work.start(inst.alloc)
                run = work.runner(inst.alloc, inst.free, handles)
                run(warmup)
                runs[name] = run
            except Exception as exc:
                skipped(bench, name, f"{type(exc).__name__}: {exc}")
        for name, samples in timer.interleaved(runs).items():
            record(bench, name, samples, note="per step (1 free + 1 alloc)")
    except Exception as exc:
        skipped(bench, "(some peer)", f"{type(exc).__name__}: {exc}")
    finally:
        for name, inst in insts.items():
            handles = held.get(name, [])
            if inst.free is not None:
                for h in handles:
                    try:
                        inst.free(h)
                    except Exception:
                        pass
            handles.clear()
            inst.close()


def _measure_peak(peer: Peer, trace) -> tuple:
    """(peak bytes held in one cold replay or None, CPU fallbacks)."""
    inst = peer.make()
    try:
        if inst.peak is not None:
            replay(trace, inst.alloc, inst.free)
            return inst.peak(), _fallbacks(peer)
        if inst.poll is not None:
            top = [0]
            poll = inst.poll

            def after():
                v = poll()
                if v > top[0]:
                    top[0] = v
            replay(trace, inst.alloc, inst.free, after_alloc=after)
            return top[0], 0
        replay(trace, inst.alloc, inst.free)
        return None, 0
    finally:
        inst.close()


def synthetic_traces(kinds: str, seed: int = 0) -> list:
    """gpumem.observe.synth_traces workloads (shapes the pool was not tuned on) as
    benchmark Traces named 'synth KIND seed N'."""
    from benchmarks import Trace
    from gpumem.observe.synth_traces import synthesize
    out = []
    for kind in filter(None, kinds.split(",")):
        d = synthesize(kind, seed=seed)
        out.append(Trace(f"synth {kind} seed {seed}", (d.ops == 0).tolist(), d.ids.tolist(),
                         d.sizes.tolist()))
    return out


def bench_traces(timer: Timer, peers: list[Peer], budget: int | None, names=None) -> None:
    """Replay each trace (a shipped trace's name or a Trace; sizes scaled down when peak
    live * 1.3 exceeds `budget`): cold (a fresh allocator) and warm (the same allocator again)
    ns per event, peers interleaved replay by replay; peak held / peak live from a separate,
    untimed replay (models, whose ``timed`` is False, only there)."""
    for name in names or trace_names():
        trace = name if not isinstance(name, str) else read_trace(name)
        name = trace.name
        scale = 1.0
        if budget is not None and trace.peak_live * 1.3 > budget:
            scale = int(budget / 1.3 / trace.peak_live * 100) / 100
            trace = trace.scaled(scale)
        label = name + ("" if scale == 1.0 else f" (sizes x{scale:g})")
        ev = trace.n_events
        live_peers, peaks = [], {}
        for peer in peers:
            try:
                peaks[peer.name] = _measure_peak(peer, trace)
                live_peers.append(peer)
            except Exception as exc:
                skipped(f"replay {label}", peer.name, f"{type(exc).__name__}: {exc}")
        peaked = list(live_peers)
        live_peers = [p for p in live_peers if p.timed]
        cold: dict = {p.name: [] for p in live_peers}
        warm: dict = {p.name: [] for p in live_peers}
        for _ in range(timer.replays):
            for peer in list(live_peers):
                try:
                    inst = peer.make()
                except Exception as exc:
                    skipped(f"replay {label}", peer.name, f"{type(exc).__name__}: {exc}")
                    live_peers.remove(peer)
                    continue
                gc.disable()
                try:
                    t0 = time.perf_counter_ns()
                    replay(trace, inst.alloc, inst.free)
                    cold[peer.name].append((time.perf_counter_ns() - t0) / ev)
                    t0 = time.perf_counter_ns()
                    replay(trace, inst.alloc, inst.free)
                    warm[peer.name].append((time.perf_counter_ns() - t0) / ev)
                except Exception as exc:
                    skipped(f"replay {label}", peer.name, f"{type(exc).__name__}: {exc}")
                    live_peers.remove(peer)
                finally:
                    gc.enable()
                    inst.close()
        for peer in live_peers:
            peak, fallbacks = peaks[peer.name]
            note = f"{ev} events" + (f", {fallbacks} CPU fallbacks" if fallbacks else "")
            record(f"replay {label} cold", peer.name, cold[peer.name], note=note)
            record(f"replay {label} warm", peer.name, warm[peer.name])
        for peer in peaked:
            peak, _ = peaks[peer.name]
            if peak is not None:
                record(f"peak held/peak live {label}", peer.name, [peak / trace.peak_live],
                       unit="ratio", note=f"peak held {peak / 2**20:.1f} MiB, peak live "
                                          f"{trace.peak_live / 2**20:.1f} MiB")
        ref = _PYOPENCL_REF.get(name)
        if ref is not None and scale == 1.0:
            NOTES.append(f"traces README: pyopencl MemoryPool on PoCL, {name}: peak held / "
                         f"peak live {ref}")


_PYOPENCL_REF = {"gpt2_train": 1.358, "resnet50_train": 1.316, "gpt2_generate": 2.472,
                 "bert_varlen_infer": 3.232}


def _fallbacks(peer: Peer) -> int:
    mm = getattr(peer, "last", None)
    if mm is None:
        return 0
    try:
        return mm.stats().cpu_fallbacks
    except Exception:
        return 0


# =============================================================================================
# modes
# =============================================================================================
def run_sim(timer: Timer, args) -> dict:
    from benchmarks import load_cbench
    summary: dict = {}
    # --- C level ---------------------------------------------------------------------------
    try:
        cb = load_cbench()
    except NotImplementedError as exc:
        cb = None
        skipped("C-level", "gpumem", str(exc))
        print(f"C-level benchmarks skipped: {exc}")
    pairs = 200_000 if timer.quick else 1_000_000
    parts = set((args.only or "cpair,o1,threads,python").split(","))
    if cb is not None and "cpair" in parts:
        cpu = timer.clock == "cpu"
        for n in (512, 4 * KiB, 1 * MiB, 4 * MiB):
            on, off = cb.BlockPool(), cb.BlockPool()
            off.pool.set_history(0)                  # the same pool without its C history
            for bp in (on, off):
                bp.ensure_hits([n])
                bp.hit_pair_ns([n], 10_000)
            s_on, s_off = [], []
            for _ in range(timer.repeats):           # interleaved
                s_on.append(on.hit_pair_ns([n], pairs, cpu))
                s_off.append(off.hit_pair_ns([n], pairs, cpu))
            bench = f"C pair (.pxd API) {fmt_size(n)}"
            row = record(bench, "gpumem", s_on, note=f"{pairs} pairs per repeat, nogil loop")
            record(bench, "gpumem, history off", s_off)
            summary.setdefault("c_pair_ns", {})[fmt_size(n)] = row["median"]
            summary.setdefault("c_pair_history_ratio", {})[fmt_size(n)] = \
                row["median"] / statistics.median(s_off)
    if cb is not None and "o1" in parts:
        summary["o1"] = o1_check(cb, timer, pairs)
    if cb is not None and "threads" in parts:
        summary["threads"] = threads_check(cb, timer, pairs)
    if "python" not in parts:
        return summary
    # --- Python level ------------------------------------------------------------------------
    from gpumem import MemoryConfig
    dev = sim_device_string()
    # GPUMEM_EXPANDABLE_SEGMENTS=1 measures every manager below with expandable segments on
    # (the configs are explicit, so the variable is read here: issue 11's hit-path comparison)
    segments = MemoryConfig.from_env().segment_policy
    expandable = segments != "plain"

    def config(track: bool = False) -> MemoryConfig:
        return MemoryConfig(track_allocations=track, segments=segments)

    summary["expandable_segments"] = expandable
    summary["segments"] = segments
    NOTES.append(f"segments={segments!r} in every gpumem row (GPUMEM_SEGMENTS, "
                 f"GPUMEM_EXPANDABLE_SEGMENTS)")
    peers = [GpumemPeer(dev, config=config()),
             GpumemPeer(dev, name="gpumem, history off", config=config(), history=False)]
    track = GpumemPeer(dev, name="gpumem tracking on", config=config(track=True))
    try:
        track.open()
        peers.append(track)
    except Skip as exc:
        skipped("(all)", track.name, str(exc))
    peers.append(GpumemPeer(dev, name="gpumem record_history()", config=config(), record=True))
    bench_hit_pairs(timer, peers, sizes=(512, 4 * KiB, 1 * MiB, 8 * MiB),
                    floor_manager=None if cb is None else cb.FloorManager())
    bench_mixed(timer, peers, live=args.live or 10_000)
    if not args.no_traces:
        from benchmarks import SIM_CAPACITY
        bench_traces(timer, peers[:1] + torch_model_peers(SIM_CAPACITY), budget=None,
                     names=trace_names() + synthetic_traces(args.synthetic))
    NOTES.append("'gpumem' rows record the pool's always-on C history (100,000 events); "
                 "'gpumem, history off' is the same pool with pool.set_history(0)")
    return summary


def threads_check(cb, timer: Timer, pairs: int) -> dict:
    """Native threads doing nogil 4 KiB hit pairs (gm_alloc/gm_free): throughput of 1 thread,
    2 threads on one stream and on two streams, interleaved in this run; ratios 2 / 1 over the
    wall time and over the largest thread CPU time."""
    from benchmarks.bench_pool import THREAD_CASES, thread_scaling
    out = {}
    for clock in ("wall", "cpu"):
        # both clocks every time: the wall clock is the goal, the CPU time shows what the code
        # does when the threads are not waiting for a core on a loaded machine
        r = thread_scaling(cb, pairs=pairs, repeats=timer.repeats, cpu=clock == "cpu")
        one = statistics.median(r["1 thread"])
        for case in THREAD_CASES:
            record(f"threads, pairs/us ({clock} time)", case, r[case], unit="pairs/us",
                   note=f"{pairs} pairs per thread per repeat")
            if case != "1 thread":
                ratio = statistics.median(r[case]) / one
                record(f"threads, speedup over 1 ({clock} time)", case, [ratio], unit="ratio")
                out[f"{case} ({clock})"] = ratio
        out[f"1 thread ns/pair ({clock})"] = 1000.0 / one
    return out


def o1_check(cb, timer: Timer, pairs: int) -> dict:
    """Hit pairs against a pool caching ~1,000,000 free blocks and one caching ~10, measured
    interleaved in this run. Three request patterns."""
    import math
    import random
    rng = random.Random(7)
    mixed = [int(math.exp(rng.uniform(math.log(512), math.log(16 * MiB)))) for _ in range(64)]
    below = [int(math.exp(rng.uniform(math.log(512), math.log(60 * KiB)))) for _ in range(64)]
    out = {}
    t0 = time.perf_counter()
    pools = {}
    for lo in (512, 64 * KiB):
        small = cb.BlockPool()
        small.populate(40, lo=lo, target_free=10)
        big = cb.BlockPool()
        big.populate(2_400_000, lo=lo, target_free=1_000_000)
        pools[lo] = (small, big)
    build_s = time.perf_counter() - t0
    cases = [("4 KiB", 512, [4 * KiB]),
             ("64 sizes 512B-16MiB", 512, mixed),
             ("split path: 64 sizes <60KiB, blocks >=64KiB", 64 * KiB, below + [4 * KiB])]
    for label, lo, sizes in cases:
        small, big = pools[lo]
        small.ensure_hits(sizes)
        big.ensure_hits(sizes)
        # front=False: the heaps' lookup serves each pair (a front cache would hide it)
        small.hit_pair_ns(sizes, 20_000, front=False)
        big.hit_pair_ns(sizes, 20_000, front=False)
        s, b = [], []
        for _ in range(timer.repeats):
            s.append(small.hit_pair_ns(sizes, pairs, front=False))
            b.append(big.hit_pair_ns(sizes, pairs, front=False))
        record(f"O(1) {label}", f"gpumem, {small.free_blocks} free blocks", s)
        record(f"O(1) {label}", f"gpumem, {big.free_blocks} free blocks", b)
        ratio = statistics.median(b) / statistics.median(s)
        record(f"O(1) {label}", "ratio 1M / 10", [ratio], unit="ratio")
        out[label] = {"ns_10": statistics.median(s), "ns_1m": statistics.median(b),
                      "free_small": small.free_blocks, "free_big": big.free_blocks,
                      "ratio": ratio}
    NOTES.append(f"O(1) pools built in {build_s:.1f} s (2.4M blocks allocated, every other one "
                 f"freed between live neighbours until 1,000,000 are cached)")
    return out


def run_opencl(timer: Timer, args) -> dict:
    from benchmarks import opencl_available
    ok, reason = opencl_available()
    if not ok:
        print(f"OpenCL unavailable: {reason}")
        skipped("(all)", "opencl", reason)
        return {}
    from gpumem import MemoryManager
    probe = MemoryManager("opencl:0")
    props = probe.device.properties()
    usable = probe.usable_memory
    free, total = probe.memory_info()
    budget = device_budget(probe)
    probe.close()
    print(f"device opencl:0: {props.name} ({props.extra.get('platform')}), "
          f"{total / 2**30:.2f} GiB reported, gpumem usable {usable / 2**30:.2f} GiB")
    NOTES.append(f"opencl:0 = {props.name} on {props.extra.get('platform')}, "
                 f"global memory {total / 2**30:.2f} GiB")
    peers = open_peers([GpumemPeer("opencl:0"), PyOpenCLPeer("opencl:0")])
    bench_hit_pairs(timer, peers)
    bench_kernel_ready(timer)
    bench_pyopencl_arrays(timer)
    live = args.live or fitting_live_count(budget)
    if live < 10_000 and not args.live:
        NOTES.append(f"mixed: {live} live buffers instead of 10,000 (10,000 of mean "
                     f"{log_uniform_mean(KiB, 4 * MiB) / 2**10:.0f} KiB would not fit in "
                     f"{budget / 2**30:.2f} GiB)")
    bench_mixed(timer, peers, live=live, warmup=5_000)
    if not args.no_traces:
        bench_traces(timer, peers + torch_model_peers(budget), budget=budget,
                     names=trace_names() + synthetic_traces(args.synthetic))
    for p in peers:
        p.shutdown()
    return {}


def run_cuda(timer: Timer, args) -> dict:
    peers = open_peers([GpumemPeer("cuda:0"), CudaRawPeer(), CudaAsyncPeer(), CudaCorePeer(),
                        CupyPeer(), TorchPeer()])
    if not peers or peers[0].name != "gpumem":
        print("gpumem cannot open cuda:0: nothing to compare")
        return {}
    from gpumem import MemoryManager
    probe = MemoryManager("cuda:0")
    budget = device_budget(probe)
    probe.close()
    bench_hit_pairs(timer, peers)
    bench_mixed(timer, peers, live=args.live or fitting_live_count(budget))
    if not args.no_traces:
        bench_traces(timer, peers + torch_model_peers(budget), budget=budget,
                     names=trace_names() + synthetic_traces(args.synthetic))
    for p in peers:
        p.shutdown()
    return {}


def summarize(backend: str, summary: dict) -> list[str]:
    """The short final table: key figures and the targets they are checked against."""
    lines = []

    def med(bench, peer):
        for r in RESULTS:
            if r.get("bench") == bench and r.get("peer") == peer and "median" in r:
                return r["median"]
        return None

    if backend == "sim":
        c = summary.get("c_pair_ns", {})
        if c:
            v = c.get("4 KiB")
            lines.append(f"C-level hit pair 4 KiB: {v:.1f} ns (target <= 40 ns: "
                         f"{'met' if v <= 40 else 'MISSED'})")
        for label, o in summary.get("o1", {}).items():
            lines.append(f"O(1) {label}: {o['ns_1m']:.1f} ns with {o['free_big']} free blocks "
                         f"vs {o['ns_10']:.1f} ns with {o['free_small']}: ratio "
                         f"{o['ratio']:.2f} (target <= 1.5: "
                         f"{'met' if o['ratio'] <= 1.5 else 'MISSED'})")
        for n in ("4 KiB", "1 MiB"):
            v = med(f"hit pair {n}", "gpumem")
            loop = med(f"hit pair {n}", "python loop + 2 calls")
            floor = med(f"hit pair {n}", FLOOR_ROW)
            if v:
                lines.append(f"Python-level hit pair {n}: {v:.0f} ns (target <= 120 ns: "
                             f"{'met' if v <= 120 else 'MISSED'}; loop + 2 trivial calls "
                             f"alone: {loop:.0f} ns"
                             + ("" if floor is None else
                                f"; Cython malloc/free of a Buffer-shaped object, no pool: "
                                f"{floor:.0f} ns") + ")")
    else:
        for n in ("4 KiB", "1 MiB"):
            g = med(f"hit pair {n}", "gpumem")
            floor = med(f"hit pair {n}", "python loop + 2 calls")
            if g is None:
                continue
            for r in RESULTS:
                if (r.get("bench") == f"hit pair {n}" and "median" in r
                        and r["peer"] not in ("gpumem", "python loop + 2 calls")):
                    ratio = r["median"] / g
                    target = ""
                    if r["peer"] == "pyopencl MemoryPool":
                        target = f" (target >= 3x: {'met' if ratio >= 3 else 'MISSED'})"
                    net = ""
                    if floor is not None and g > floor:
                        net = (f"; net of the {floor:.0f} ns loop floor "
                               f"{(r['median'] - floor) / (g - floor):.2f}x")
                    lines.append(f"hit pair {n}: {r['peer']} {r['median']:.0f} ns / gpumem "
                                 f"{g:.0f} ns = {ratio:.2f}x{target}{net}")
    if backend == "opencl":
        lines.extend(_opencl_goal_lines())
    for r in RESULTS:
        if r.get("bench", "").startswith("mixed") and "median" in r:
            lines.append(f"{r['bench']}: {r['peer']} {r['median']:.0f} ns per step")
    for r in RESULTS:
        if r.get("bench", "").startswith("peak held/peak live"):
            lines.append(f"{r['bench'][len('peak held/peak live '):]}: {r['peer']} "
                         f"peak held / peak live {r['median']:.3f}")
    return lines


def _opencl_goal_lines() -> list[str]:
    """Issue 12 item 1: kernel-ready pair >= 1.5x faster than pyopencl's pool; pyopencl arrays
    through gpumem no slower than through pyopencl's pool. Ratios are paired: the median over
    rounds of (pyopencl / gpumem) measured back to back."""
    def row(bench, peer):
        return next((r for r in RESULTS if r.get("bench") == bench and r.get("peer") == peer
                     and "paired_ratio" in r), None)
    lines = []
    for bench, what, target in (
            ("kernel-ready pair 4 KiB", "malloc + .native + free", 1.5),
            ("pyopencl Array create+drop 1024 float32", "allocator", 1.0),
            ("pyopencl a + b 1024 float32", "allocator", 1.0)):
        g, p = row(bench, "gpumem"), row(bench, "pyopencl MemoryPool")
        if g and p:
            ratio = p["paired_ratio"]
            lines.append(f"{bench}: pyopencl MemoryPool {fmt_value(p['median'], 'ns')} / gpumem "
                         f"({what}) {fmt_value(g['median'], 'ns')}; paired ratio {ratio:.2f}x "
                         f"(target >= {target}x: {'met' if ratio >= target else 'MISSED'})")
    return lines


def _git_commit() -> str:
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=HERE, text=True, capture_output=True, timeout=10).stdout
        return (head or "?") + ("+changes" if dirty.strip() else "")
    except Exception:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sim", "opencl", "cuda"), default=None,
                    help="sim (the default), opencl or cuda; --seed-table: opencl (default) "
                         "or cuda")
    ap.add_argument("--seed-table", action="store_true",
                    help="the seed's five scenarios against the backend's peers")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    ap.add_argument("--no-traces", action="store_true", help="skip the trace replays")
    ap.add_argument("--synthetic", default="serving,varlen,training",
                    help="synthetic trace kinds replayed after the shipped traces, seed 0 "
                         "(gpumem.observe.synth_traces; '' for none)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time Python-level figures by the wall clock (default) or by this "
                         "thread's CPU time (steadier on a loaded machine)")
    ap.add_argument("--only", metavar="PARTS",
                    help="sim: comma list among cpair,o1,threads,python (default: all)")
    ap.add_argument("--live", type=int, metavar="N",
                    help="live buffers in the mixed benchmark (default: 10,000, or as many as "
                         "fit in half of what gpumem may take from the device)")
    ap.add_argument("--json", metavar="PATH", help="also save every figure as JSON")
    args = ap.parse_args(argv)

    if args.backend is None:
        args.backend = "opencl" if args.seed_table else "sim"
    if args.seed_table and args.backend == "sim":
        ap.error("--seed-table runs against a device's peers: --backend opencl or cuda")
    timer = Timer(args.quick, args.clock)
    started = datetime.datetime.now()
    commit = _git_commit()
    print(f"gpumem compare: backend {args.backend}, {'quick' if args.quick else 'full'}"
          f"{', seed table' if args.seed_table else ''}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; repo at {commit}; {started:%Y-%m-%d %H:%M}")
    if args.seed_table:
        import seed_table
        summary = {"seed_table": seed_table.run(timer, args.backend)}
    else:
        mode = {"sim": run_sim, "opencl": run_opencl, "cuda": run_cuda}[args.backend]
        summary = mode(timer, args)
    print_table([r for r in RESULTS if r.get("bench") != "(all)"])
    skipped_peers = [r for r in RESULTS if r.get("bench") == "(all)"]
    for r in skipped_peers:
        print(f"skipped peer {r['peer']}: {r['skipped']}")
    for n in NOTES:
        print(f"note: {n}")
    print("\nsummary")
    lines = summary["seed_table"] if args.seed_table else summarize(args.backend, summary)
    for line in lines:
        print(f"  {line}")
    print(f"(took {(datetime.datetime.now() - started).total_seconds():.0f} s)")
    if args.json:
        doc = {"command": " ".join([Path(sys.executable).name] + sys.argv),
               "date": started.isoformat(timespec="seconds"),
               "backend": args.backend, "quick": args.quick, "commit": commit,
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "processor": platform.processor(),
                           "python": platform.python_version()},
               "results": RESULTS, "notes": NOTES, "summary": lines, "raw_summary": summary}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
