"""The figures of issue 31 for the segment policies (docs/segments.md), on the simulated device
with the driver cost table measured on an H200 (level real; the torch rows are
gpumem.TorchAllocatorModel):

- a roomy card (sim:80GiB, replay preset "default"): per trace, peak reserved / peak live and
  modeled driver time of each ``--segments`` setting, the time over plain's, events/s over
  plain's (median of ``--repeat`` interleaved replays), and the torch model's ratio with its
  defaults and with expandable_segments:True;
- with ``--smallest-card``: the smallest card each setting (and the torch model with
  expandable segments) fits without an out-of-memory, every byte usable
  (gpu_memory_fraction=1, min_free_bytes=0, reserve_bytes=0, no CPU fallback; the model gets
  the whole capacity), by bisection to ``--precision`` of the peak live bytes, and the ratio
  there; each over tight's.

Traces: the shipped ones (gpumem/data/traces), synthetic kinds for ``--seeds``, and every
``*.csv.gz`` under each ``--traces`` folder (traces of your own workloads).

    python asv_benchmarks/segment_policy_figures.py [--seeds 0,1,2,3] [--traces DIR]
    python asv_benchmarks/segment_policy_figures.py --smallest-card --seeds 0,1
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from gpumem import MemoryConfig
from gpumem.observe.replay import replay, replay_config
from gpumem.observe.synth_traces import synthesize
from gpumem.observe.trace import read_trace
from gpumem.planning.torch_replay import replay_torch_model

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
ROOMY = "sim:80GiB"


def workloads(seeds: list[int], kinds: list[str], folders: list[str]) -> list[tuple[str, Any]]:
    """(label, trace): the shipped traces, each synthetic kind for each seed, then the traces
    of each folder."""
    shipped = sorted((HERE.parent / "gpumem" / "data" / "traces").glob("*.csv.gz"))
    out = [(p.name.split(".")[0], read_trace(p)) for p in shipped]
    out += [(f"synth {k} seed {s}", synthesize(k, seed=s)) for k in kinds for s in seeds]
    for folder in folders:
        out += [(p.name.split(".")[0], read_trace(p)) for p in sorted(Path(folder).glob("*.csv.gz"))]
    return out


def roomy_table(rows: list[tuple[str, Any]], settings: list[str], repeat: int) -> None:
    print(f"| trace | torch default | torch expandable | "
          + " | ".join(f"{s}: ratio, modeled ms (x plain), events/s x plain" for s in settings)
          + " |")
    print("|---|---:|---:|" + "---:|" * len(settings))
    base = replay_config("default")
    for label, data in rows:
        res: dict[str, list] = {s: [] for s in ["plain"] + settings}
        for _ in range(repeat):                  # interleaved: the machine's drift hits all
            for s in res:
                res[s].append(replay(data, ROOMY, base.replace(segments=s)))
        plain_eps = [r.events_per_second for r in res["plain"]]
        t = replay_torch_model(data, capacity=80 << 30)
        te = replay_torch_model(data, capacity=80 << 30, conf="expandable_segments:True")
        cells = []
        for s in settings:
            r = res[s][0]
            eps = statistics.median(x.events_per_second / p for x, p in zip(res[s], plain_eps))
            ms, plain_ms = r.modeled_driver_seconds * 1e3, res["plain"][0].modeled_driver_seconds * 1e3
            cells.append(f"{r.reserved_live_ratio:.3f}, {ms:,.1f} ({ms / plain_ms:.2f}), {eps:.2f}")
        print(f"| {label} | {t.reserved_live_ratio:.3f} | {te.reserved_live_ratio:.3f} | "
              + " | ".join(cells) + " |", flush=True)


def smallest(fits: Callable[[int], Any], live: int, precision: float) -> tuple[int, Any]:
    """(bytes, result there) of the smallest capacity ``fits`` replays without an OOM."""
    lo, hi = live, int(live * 1.6)
    while fits(hi).num_ooms:
        lo, hi = hi, int(hi * 1.5)
    step = max(MiB, int(live * precision))
    while hi - lo > step:
        mid = (lo + hi) // 2 // MiB * MiB
        if mid <= lo:
            break
        if fits(mid).num_ooms:
            lo = mid
        else:
            hi = mid
    return hi, fits(hi)


def card_table(rows: list[tuple[str, Any]], settings: list[str], precision: float) -> None:
    order = list(dict.fromkeys(["tight"] + settings))
    print("| trace | peak live MiB | " + " | ".join(
        f"{s}: MiB (x tight), ratio" for s in order) + " | torch expandable: MiB (x tight), ratio |")
    print("|---|---:|" + "---:|" * (len(order) + 1))

    def exact(seg: str) -> MemoryConfig:
        return MemoryConfig(gpu_memory_fraction=1.0, min_free_bytes=0, reserve_bytes=0,
                            cpu_fallback_enabled=False, track_allocations=False, segments=seg)

    for label, data in rows:
        live = int(data.peak_live_bytes)
        found = {s: smallest(lambda c, s=s: replay(data, f"sim:{c}B", exact(s)), live, precision)
                 for s in order}
        found["torch"] = smallest(lambda c: replay_torch_model(
            data, capacity=c, conf="expandable_segments:True"), live, precision)
        tight = found["tight"][0]
        print(f"| {label} | {live / MiB:,.0f} | " + " | ".join(
            f"{c / MiB:,.0f} ({c / tight:.3f}), {r.peak_reserved_bytes / r.peak_live_bytes:.3f}"
            for c, r in found.values()) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", default="auto,tight,fast",
                    help="the settings beside plain (comma-separated)")
    ap.add_argument("--seeds", default="0", help="synthetic seeds ('' for none)")
    ap.add_argument("--synthetic", default="serving,varlen,training")
    ap.add_argument("--traces", action="append", default=[], metavar="DIR",
                    help="a folder of further *.csv.gz traces (repeatable)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smallest-card", action="store_true",
                    help="the smallest-card table instead of the roomy card's")
    ap.add_argument("--precision", type=float, default=1 / 400,
                    help="bisection step as a share of peak live bytes")
    args = ap.parse_args(argv)
    settings = [s for s in args.segments.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    rows = workloads(seeds, [k for k in args.synthetic.split(",") if k], args.traces)
    if args.smallest_card:
        card_table(rows, settings, args.precision)
    else:
        roomy_table(rows, settings, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
