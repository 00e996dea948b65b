"""Issue #32's two figures for a memory budget shared across processes, on a shared sim card:

    python asv_benchmarks/shared_budget.py latency [--spinners 2] [--rounds 40]
    python asv_benchmarks/shared_budget.py hitpair [--repeats 61]

``latency``: ``--spinners`` processes each cache most of their share of one ``sim:2GiB`` card
(in 16 MiB segments, so that each request releases a little of it) and then spin in a pure-Python loop (the GIL held but for the interpreter's switch interval,
``sys.getswitchinterval()``); this process then grows 8 MiB at a time past the budget, so each
growth asks the others to hand cached memory back. Reported: the seconds from writing each
round of requests to the moment the growth could go on (``SharedBudget.reply_seconds``),
median and worst (targets: 10 ms median, 100 ms worst).

``hitpair``: the Python-level 4 KiB hit pair (``malloc`` + ``free`` from the cache) of a manager
that joined a group against one that did not, timed A/B interleaved (the order alternates every
repeat) by this thread's CPU time; the median of the paired ratios (target <= 1.02x).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "placement"))

MiB = 1 << 20
CARD = "sim:2GiB"


def latency(spinners: int, rounds: int) -> None:
    import shared_workers
    from gpumem import MemoryManager

    folder = tempfile.mkdtemp(prefix="gmsb", dir="/tmp")
    os.environ["GPUMEM_SHARED_DIR"] = folder
    ctx = multiprocessing.get_context("spawn")
    share = (2048 - 64) * MiB // spinners // (16 * MiB) * (16 * MiB)
    events = [(ctx.Event(), ctx.Event()) for _ in range(spinners)]
    procs = [ctx.Process(target=shared_workers.hold_and_spin,
                         args=(CARD, "bench", share, True, ready, stop, folder, 1.0,
                               16 * MiB))
             for ready, stop in events]
    for p in procs:
        p.start()
    try:
        for ready, _ in events:
            if not ready.wait(60):
                raise SystemExit("a spinner did not start within 60 s")
        time.sleep(0.5)                           # every spinner deep in its loop
        mm = MemoryManager(CARD, shared_workers.shared_config("bench"))
        held = []
        shared = mm._growth.shared
        from gpumem.errors import OutOfMemoryError
        while len(shared.reply_seconds) < rounds:
            try:
                held.append(mm.malloc(8 * MiB))
            except OutOfMemoryError:
                break                             # every spinner's cache handed over
        times = sorted(shared.reply_seconds)
        print(f"release requests answered ({spinners} processes spinning in pure Python, "
              f"switch interval {sys.getswitchinterval() * 1e3:.0f} ms, {len(times)} rounds): "
              f"median {statistics.median(times) * 1e3:.2f} ms, worst {times[-1] * 1e3:.2f} ms, "
              f"p90 {times[int(len(times) * 0.9)] * 1e3:.2f} ms")
        for buf in held:
            buf.free()
        mm.close()
    finally:
        for _, stop in events:
            stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)


def hitpair(repeats: int) -> None:
    import shared_workers
    from gpumem import MemoryConfig, MemoryManager

    folder = tempfile.mkdtemp(prefix="gmsb", dir="/tmp")
    os.environ["GPUMEM_SHARED_DIR"] = folder
    joined = MemoryManager(CARD, shared_workers.shared_config("hit"))
    plain = MemoryManager(CARD, MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                                             cpu_fallback_enabled=False,
                                             track_allocations=False))
    pairs = 20_000

    def timed(mm: MemoryManager) -> float:
        malloc = mm.malloc
        t0 = time.thread_time_ns()
        for _ in range(pairs):
            malloc(4096).free()
        return (time.thread_time_ns() - t0) / pairs

    for mm in (joined, plain):
        timed(mm)                                 # the segment, then hits only
    a, b, r = [], [], []
    for i in range(repeats):
        if i % 2:
            x = timed(plain); y = timed(joined)
        else:
            y = timed(joined); x = timed(plain)
        a.append(x); b.append(y); r.append(y / x)
    q = statistics.quantiles(r, n=4)
    print(f"hit pair (4 KiB malloc+free, Python level, {repeats} interleaved repeats of "
          f"{pairs}): without a group {statistics.median(a):.0f} ns, with a group joined "
          f"{statistics.median(b):.0f} ns, paired ratio median {statistics.median(r):.3f}x "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f})")
    joined.close()
    plain.close()
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--spinners", type=int, default=2)
    lat.add_argument("--rounds", type=int, default=40)
    hit = sub.add_parser("hitpair")
    hit.add_argument("--repeats", type=int, default=61)
    args = parser.parse_args()
    if args.what == "latency":
        latency(args.spinners, args.rounds)
    else:
        hitpair(args.repeats)


if __name__ == "__main__":
    main()
