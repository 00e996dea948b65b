"""Issue #21's three hot-path ratios, each timed A/B interleaved in one process (the order
alternates every repeat), by this thread's CPU time, with the median of the paired ratios:

    python asv_benchmarks/hotpath_ratios.py cpair  [--repeats 61]   # C pair, history on / off
    python asv_benchmarks/hotpath_ratios.py multi  [--repeats 301]  # placement pair / malloc pair
    python asv_benchmarks/hotpath_ratios.py opencl [--repeats 61]   # pyopencl allocator breakdown

``compare.py`` reports the same pairs among many others with fewer repeats; this script is the
one to run when a single ratio is near its target on a loaded machine (targets: C history
<= 1.10x, multi-device <= 1.05x, pyopencl arrays >= 1.0x of pyopencl's pool).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks import load_cbench, sim_manager  # noqa: E402

_clock = time.thread_time_ns


def _interleaved(fa: Callable[[], float], fb: Callable[[], float], repeats: int):
    """Medians of a and b and of the paired ratios b/a, with their quartiles."""
    a, b, r = [], [], []
    for i in range(repeats):
        if i % 2:
            x = fa(); y = fb()
        else:
            y = fb(); x = fa()
        a.append(x); b.append(y); r.append(y / x)
    q = statistics.quantiles(r, n=4)
    return statistics.median(a), statistics.median(b), statistics.median(r), q[0], q[2]


def cpair(repeats: int) -> None:
    """The C-level 4 KiB hit pair (the .pxd API, nogil loop) with the always-on history against
    the same pool with ``set_history(0)``."""
    cb = load_cbench()
    n, pairs = 4096, 200_000
    on, off = cb.BlockPool(), cb.BlockPool()
    off.pool.set_history(0)
    for bp in (on, off):
        bp.ensure_hits([n])
        bp.hit_pair_ns([n], 10_000)
    a, b, r, lo, hi = _interleaved(lambda: off.hit_pair_ns([n], pairs, True),
                                   lambda: on.hit_pair_ns([n], pairs, True), repeats)
    print(f"C pair 4 KiB: history on {b:.2f} ns, off {a:.2f} ns; on/off: ratio of medians "
          f"{b / a:.3f}, median paired ratio {r:.3f} (quartiles {lo:.3f}..{hi:.3f}); "
          f"{repeats} x {pairs} pairs (target <= 1.10)")


def multi(repeats: int) -> None:
    """``free(allocate_on_best_device(4096))`` on a one-device MultiDeviceManager against
    ``free(malloc(4096))`` on a plain manager, 1000 pairs per sample."""
    from gpumem import MultiDeviceManager
    single, mm = sim_manager(), sim_manager()
    placed = MultiDeviceManager([mm])

    def pairs(alloc: Callable[[int], Any], free: Callable[[Any], Any]) -> Callable[..., float]:
        def sample(k: int = 1000) -> float:
            t = _clock()
            for _ in range(k):
                free(alloc(4096))
            return (_clock() - t) / k
        return sample

    one = pairs(single.malloc, single.free)
    many = pairs(placed.allocate_on_best_device, placed.free)

    for _ in range(50):
        one(); many()
    a, b, r, lo, hi = _interleaved(one, many, repeats)
    print(f"multi-device pair {b:.1f} ns, one manager's pair {a:.1f} ns; ratio of medians "
          f"{b / a:.3f}, median paired ratio {r:.3f} (quartiles {lo:.3f}..{hi:.3f}); "
          f"{repeats} x 1000 pairs (target <= 1.05)")
    placed.close(); mm.close(); single.close()


def opencl(repeats: int) -> None:
    """Where a pyopencl Array's allocation goes: gpumem's allocator call (+ the drop that
    returns the block) against pyopencl's pool, and the parts of gpumem's call measured
    alone; then ``cla.empty`` through each (the array create+drop ratio)."""
    import numpy as np
    import pyopencl as cl
    import pyopencl.array as cla
    import pyopencl.tools as clt

    from gpumem.integrations import pyopencl as gm_cl
    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx)
    mm = gm_cl.open_manager(ctx, queue)
    galloc = gm_cl.allocator(mm)
    palloc = clt.MemoryPool(clt.ImmediateAllocator(queue)).allocate
    base = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 1 << 20)
    sub = base.get_sub_region(0, 4096)
    handle, from_int_ptr = sub.int_ptr, cl.Buffer.from_int_ptr

    def loop(body: Callable[[], object], k: int) -> Callable[[], float]:
        def run() -> float:
            t = _clock()
            for _ in range(k):
                body()
            return (_clock() - t) / k
        return run

    def with_attr():
        m = from_int_ptr(handle, True)
        m.x = 1

    parts = {
        "gpumem allocator(4096) + drop": loop(lambda: galloc(4096), 1000),
        "pyopencl pool.allocate(4096) + drop": loop(lambda: palloc(4096), 1000),
        "  gpumem part: mm.malloc(4096) + drop": loop(lambda: mm.malloc(4096), 1000),
        "  gpumem part: cl.Buffer.from_int_ptr(h, True) + drop": loop(
            lambda: from_int_ptr(handle, True), 1000),
        "  gpumem part: the same + one attribute (the block it carries)": loop(with_attr, 1000),
        "cla.empty(1024 float32) + drop, gpumem": loop(
            lambda: cla.empty(queue, 1024, np.float32, allocator=galloc), 200),
        "cla.empty(1024 float32) + drop, pyopencl pool": loop(
            lambda: cla.empty(queue, 1024, np.float32, allocator=palloc), 200),
    }
    names = list(parts)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for f in parts.values():
        f()
    for i in range(repeats):
        for k in (names if i % 2 else reversed(names)):
            samples[k].append(parts[k]())
    for k in names:
        print(f"{k:64s} {statistics.median(samples[k]):9.1f} ns")
    g, p = samples[names[5]], samples[names[6]]
    print(f"cla.empty create+drop: pyopencl pool / gpumem, median paired ratio "
          f"{statistics.median([b / a for a, b in zip(g, p)]):.3f} (target >= 1.0); "
          f"{repeats} repeats")
    del sub, base
    mm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["cpair", "multi", "opencl"])
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    default = {"cpair": 61, "multi": 301, "opencl": 61}[args.which]
    {"cpair": cpair, "multi": multi, "opencl": opencl}[args.which](args.repeats or default)


if __name__ == "__main__":
    main()
