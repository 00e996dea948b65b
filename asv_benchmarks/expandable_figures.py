"""Expandable segments off vs on, side by side in one run: every trace shipped in gpumem/data/traces (or
GPUMEM_TRACES) replayed with :func:`gpumem.observe.replay` on a fresh sim:80GiB, for the default,
constrained and inference presets. Prints a Markdown table: peak physical bytes (the pool's peak
reserved bytes, which with expandable segments are exactly the mapped pages) over peak live
requested bytes, events/s (median of ``--repeat`` replays) and driver calls.

    python asv_benchmarks/expandable_figures.py [--repeat 3] [--configs default,constrained]
    python asv_benchmarks/expandable_figures.py --hit-pair   # malloc+free cache hits, off vs on
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from gpumem.observe.replay import replay, replay_config
from gpumem.observe.trace import read_trace

HERE = Path(__file__).resolve().parent


def trace_paths() -> list[Path]:
    root = Path(os.environ.get("GPUMEM_TRACES", HERE.parent / "gpumem" / "data" / "traces"))
    return sorted(root.glob("*.csv.gz"))


def hit_pairs(reps: int = 200_000) -> None:
    """Median ns of a malloc + free cache hit, off vs on, on two sim managers in this process."""
    import time

    import gpumem_sim
    from gpumem import MemoryConfig, MemoryManager

    managers = {on: MemoryManager(gpumem_sim.SimDevice("16GiB"), MemoryConfig(
        expandable_segments=on, cpu_fallback_enabled=False, min_free_bytes=0))
        for on in (False, True)}
    for n in (4096, 4 << 20, 64 << 20):
        ns = {}
        for on, mm in managers.items():
            mm.malloc(n).free()                      # warm: the block is cached
            runs = []
            for _ in range(7):
                t = time.perf_counter_ns()
                for _ in range(reps):
                    mm.malloc(n).free()
                runs.append((time.perf_counter_ns() - t) / reps)
            ns[on] = statistics.median(runs)
        print(f"hit pair {n:>9} B: off {ns[False]:.0f} ns, on {ns[True]:.0f} ns, "
              f"on/off {ns[True] / ns[False]:.2f}")
    for mm in managers.values():
        mm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--configs", default="default,constrained,inference")
    ap.add_argument("--hit-pair", action="store_true", help="time cache hits instead")
    args = ap.parse_args(argv)
    if args.hit_pair:
        hit_pairs()
        return 0
    paths = trace_paths()
    if not paths:
        print("no traces found (set GPUMEM_TRACES)", file=sys.stderr)
        return 1
    print("| trace | config | ratio off | ratio on | events/s off | events/s on | on/off "
          "| driver calls off | on | OOMs off/on |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        data = read_trace(path)
        for preset in args.configs.split(","):
            row = {}
            for on in (False, True):
                cfg = replay_config(preset).replace(expandable_segments=on)
                runs = [replay(data, "sim:80GiB", cfg) for _ in range(args.repeat)]
                row[on] = (runs[0], statistics.median(r.events_per_second for r in runs))
            (off, eps_off), (on_, eps_on) = row[False], row[True]
            print(f"| {data.name.split('.')[0]} | {preset} | {off.reserved_live_ratio:.3f} | "
                  f"{on_.reserved_live_ratio:.3f} | {eps_off / 1e6:.2f} M | {eps_on / 1e6:.2f} M "
                  f"| {eps_on / eps_off:.2f} | {off.driver_calls:,} | {on_.driver_calls:,} | "
                  f"{off.num_ooms}/{on_.num_ooms} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
