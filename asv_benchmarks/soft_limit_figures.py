"""Issue 38's figures: the smallest card each allocator fits on, and what a roomy card costs.

    python asv_benchmarks/soft_limit_figures.py [--seeds 0,1,2] [--scale 0.25] [--json out.json]

1. Smallest simulated card (bytes, to 1/2048 or 2 MiB, bisection as ``gpumem tune`` does it) on which a
   trace replays with 0 OOMs and 0 CPU fallbacks, for ``MemoryConfig()`` (gpumem's default:
   its limits soft) and the model of PyTorch's caching allocator, default and
   ``expandable_segments:True``, on every shipped trace (GPUMEM_TRACES or gpumem/data/traces)
   and on synthetic traces (gpumem.observe.synth_traces, each kind at each seed).
2. Peak reserved of ``MemoryConfig()`` on ``sim:80GiB`` for the same traces (a roomy card:
   the soft limits never come near).

Untimed except for what the replays take; single process. Thresholds and traces are not tuned
on each other: the synthetic seeds are whatever ``--seeds`` says.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpumem.config import MemoryConfig
from gpumem.observe.synth_traces import KINDS, synthesize
from gpumem.observe.trace import read_trace
from gpumem.planning import tune as tune_mod
from gpumem.planning.card import Card
from gpumem.units import MiB, format_bytes

ROOT = Path(__file__).resolve().parents[1]


def shipped_traces() -> list[Path]:
    folder = Path(os.environ.get("GPUMEM_TRACES", ROOT / "gpumem" / "data" / "traces"))
    return sorted(folder.glob("*.csv.gz"))


def smallest(cand: "tune_mod.Candidate", data, floor: int) -> int | None:
    """The smallest sim card (bytes) on which ``cand`` replays ``data`` without an OOM."""
    tune_mod._init_worker(data)
    card = Card(max(floor * 2, 64 * MiB), "sim")
    fits = tune_mod._fits(tune_mod._run(cand, card.capacity_for(cand.allocator)))
    return tune_mod._smallest_card(cand, card, fits, floor)


def figures(name: str, data) -> dict:
    default = tune_mod.Candidate("gpumem", "default", ())
    assert default.user_config().user_limits == frozenset()     # MemoryConfig(): soft
    torch_default = tune_mod.Candidate("torch", conf="")
    torch_exp = tune_mod.Candidate("torch", conf="expandable_segments:True")
    floor = data.peak_live_bytes
    row = {"trace": name, "peak_live": floor}
    for key, cand in (("gpumem_default", default), ("torch_default", torch_default),
                      ("torch_expandable", torch_exp)):
        row[key] = smallest(cand, data, floor)
    tune_mod._init_worker(data)
    roomy = tune_mod._run(default, 80 << 30)
    row["peak_reserved_80GiB"] = roomy.peak_reserved_bytes
    row["ok"] = (row["gpumem_default"] is not None
                 and row["gpumem_default"] <= min(row["torch_default"] or 1 << 62,
                                                  row["torch_expandable"] or 1 << 62))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="synthetic seeds (comma-separated)")
    ap.add_argument("--scale", type=float, default=0.25, help="synthetic tensor-size scale")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--precision-bits", type=int, default=11,
                    help="bisection to 1/2**N of the card, at least 2 MiB (tune uses 7)")
    ap.add_argument("--only", metavar="NAME", help="only traces whose name contains NAME")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    tune_mod._CARD_PRECISION_BITS = args.precision_bits
    inputs = [(p.name.replace(".csv.gz", ""), lambda p=p: read_trace(str(p)))
              for p in shipped_traces()]
    if not args.no_synthetic:
        for kind in KINDS:
            for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
                inputs.append((f"synth:{kind}:seed{seed}",
                               lambda k=kind, s=seed: synthesize(k, seed=s, scale=args.scale)))
    if args.only:
        inputs = [(n, f) for n, f in inputs if args.only in n]
    rows = []
    fb = format_bytes
    print(f"{'trace':<28} {'peak live':>11} {'gpumem ()':>11} {'torch def':>11} "
          f"{'torch exp':>11} {'ok':>3}  {'80GiB peak reserved':>19}")
    for name, load in inputs:
        start = time.perf_counter()
        row = figures(name, load())
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{name:<28} {fb(row['peak_live']):>11} {fb(row['gpumem_default'] or 0):>11} "
              f"{fb(row['torch_default'] or 0):>11} {fb(row['torch_expandable'] or 0):>11} "
              f"{'yes' if row['ok'] else 'NO':>3}  {fb(row['peak_reserved_80GiB']):>19}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
