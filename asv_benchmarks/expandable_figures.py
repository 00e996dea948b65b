"""Expandable segments off vs on, side by side in one run: every trace in ../shared/traces (or
GPUMEM_TRACES) replayed with :func:`gpumem.replay` on a fresh sim:80GiB, for the default,
constrained and inference presets. Prints a Markdown table: peak physical bytes (the pool's peak
reserved bytes, which with expandable segments are exactly the mapped pages) over peak live
requested bytes, events/s (median of ``--repeat`` replays) and driver calls.

    python asv_benchmarks/expandable_figures.py [--repeat 3] [--configs default,constrained]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from gpumem.replay import replay, replay_config
from gpumem.trace import read_trace

HERE = Path(__file__).resolve().parent


def trace_paths() -> list[Path]:
    root = Path(os.environ.get("GPUMEM_TRACES", HERE.parent.parent / "shared" / "traces"))  # as benchmarks/__init__.py
    return sorted(root.glob("*.csv.gz"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--configs", default="default,constrained,inference")
    args = ap.parse_args(argv)
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
