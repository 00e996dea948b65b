"""Expandable segments off vs on, side by side in one run: every trace shipped in gpumem/data/traces (or
GPUMEM_TRACES), then synthetic traces (``--synthetic serving,varlen,training``, ``--seeds 0,1``;
gpumem.observe.synth_traces), replayed with :func:`gpumem.observe.replay` on a fresh sim:80GiB,
for the default, constrained and inference presets. Prints a Markdown table: peak physical bytes
(the pool's peak reserved bytes, which with expandable segments are exactly the mapped pages)
over peak live requested bytes, driver calls, modeled driver time (gpumem_sim.driver_costs: what
those calls would cost on a CUDA GPU) and events/s (median of ``--repeat`` replays, off and on
interleaved; on/off is the median of the per-repeat ratios). Beside them, the same ratio for the
model of PyTorch's caching allocator (gpumem.TorchAllocatorModel on 80 GiB) with its default
settings and with expandable_segments:True.

    python asv_benchmarks/expandable_figures.py [--repeat 3] [--configs default,constrained]
    python asv_benchmarks/expandable_figures.py --hit-pair   # malloc+free cache hits, off vs on
    python asv_benchmarks/expandable_figures.py --stitch-ratio 3   # another STITCH_RATIO
    python asv_benchmarks/expandable_figures.py --handle-sizes 2MiB,4MiB,8MiB,20MiB,growth
        # the default preset with each expandable_handle_size against plain segments
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


def workloads(synthetic: str, seeds: str) -> list[tuple[str, object]]:
    """(label, trace) for every shipped trace, then every synthetic kind for every seed
    (gpumem.observe.synth_traces: shapes the pool was not tuned on)."""
    from gpumem.observe.synth_traces import synthesize
    out: list[tuple[str, object]] = [(p.name.split(".")[0], read_trace(p)) for p in trace_paths()]
    for kind in filter(None, synthetic.split(",")):
        for seed in (int(x) for x in seeds.split(",") if x):
            out.append((f"synth {kind} seed {seed}", synthesize(kind, seed=seed)))
    return out


def handle_size_table(rows: list[tuple[str, object]], sizes: list[str], repeat: int) -> int:
    """Per trace: plain segments, then expandable segments with each handle size (default
    preset otherwise): peak physical / peak live, driver calls and modeled driver time (and
    each over plain), events/s over plain (median of ``repeat`` interleaved pairs)."""
    from gpumem.config import parse_handle_size
    nbytes = [parse_handle_size(s, what="--handle-sizes") for s in sizes]
    print("| trace | plain: ratio, calls, modeled ms | " + " | ".join(
        f"handles {s}: ratio, calls (x plain), modeled ms (x plain), events/s x plain"
        for s in sizes) + " |")
    print("|---|---:|" + "---:|" * len(sizes))
    base = replay_config("default")
    for label, data in rows:
        plain = replay(data, "sim:80GiB", base.replace(expandable_segments=False))
        cells = [f"{plain.reserved_live_ratio:.3f}, {plain.driver_calls:,}, "
                 f"{plain.modeled_driver_seconds * 1e3:,.1f}"]
        for n in nbytes:
            cfg = base.replace(expandable_segments=True, expandable_handle_size=n)
            speed, res = [], None
            for _ in range(repeat):
                off = replay(data, "sim:80GiB", base.replace(expandable_segments=False))
                res = replay(data, "sim:80GiB", cfg)
                speed.append(res.events_per_second / off.events_per_second)
            assert res is not None
            cells.append(
                f"{res.reserved_live_ratio:.3f}, {res.driver_calls:,} "
                f"({res.driver_calls / plain.driver_calls:.1f}), "
                f"{res.modeled_driver_seconds * 1e3:,.1f} "
                f"({res.modeled_driver_seconds / plain.modeled_driver_seconds:.2f}), "
                f"{statistics.median(speed):.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--configs", default="default,constrained,inference")
    ap.add_argument("--synthetic", default="serving,varlen,training",
                    help="synthetic kinds to add ('' for none)")
    ap.add_argument("--seeds", default="0,1", help="seeds of each synthetic kind")
    ap.add_argument("--hit-pair", action="store_true", help="time cache hits instead")
    ap.add_argument("--stitch-ratio", type=float, default=None,
                    help="replace gpumem.manager.expandable.STITCH_RATIO (derived from the "
                         "driver cost table) to see how the figures move with it")
    ap.add_argument("--handle-sizes", default=None,
                    help="comma-separated MemoryConfig.expandable_handle_size values (sizes, "
                         "or 'growth'): print "
                         "ratio, driver calls and modeled driver time for each instead")
    args = ap.parse_args(argv)
    if args.stitch_ratio is not None:
        if not args.stitch_ratio >= 0:
            ap.error(f"--stitch-ratio must be a number >= 0, got {args.stitch_ratio}")
        import gpumem.manager.expandable as expandable
        expandable.STITCH_RATIO = args.stitch_ratio
    if args.hit_pair:
        hit_pairs()
        return 0
    rows = workloads(args.synthetic, args.seeds)
    if not rows:
        print("no traces found (set GPUMEM_TRACES)", file=sys.stderr)
        return 1
    if args.handle_sizes:
        return handle_size_table(rows, args.handle_sizes.split(","), args.repeat)
    print("| trace | config | ratio off | ratio on | torch model | torch expandable | driver "
          "calls off | on | modeled driver ms off | on | on/off | events/s off | on | on/off | "
          "OOMs off/on |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    from gpumem.planning.torch_replay import replay_torch_model
    for label, data in rows:
        torch_ratio = {conf: replay_torch_model(data, capacity=80 << 30, conf=conf)
                       .reserved_live_ratio for conf in ("", "expandable_segments:True")}
        for preset in args.configs.split(","):
            first: dict[bool, object] = {}
            eps: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeat):         # interleaved: off, on, off, on...
                for on in (False, True):
                    cfg = replay_config(preset).replace(expandable_segments=on)
                    res = replay(data, "sim:80GiB", cfg)
                    first.setdefault(on, res)
                    eps[on].append(res.events_per_second)
            off, on_ = first[False], first[True]
            speed = statistics.median(b / a for a, b in zip(eps[False], eps[True]))
            m_off, m_on = off.modeled_driver_seconds, on_.modeled_driver_seconds
            print(f"| {label} | {preset} | {off.reserved_live_ratio:.3f} | "
                  f"{on_.reserved_live_ratio:.3f} | {torch_ratio['']:.3f} | "
                  f"{torch_ratio['expandable_segments:True']:.3f} | "
                  f"{off.driver_calls:,} | {on_.driver_calls:,} "
                  f"| {m_off * 1e3:,.1f} | {m_on * 1e3:,.1f} | {m_on / m_off:.2f} | "
                  f"{statistics.median(eps[False]) / 1e6:.2f} M | "
                  f"{statistics.median(eps[True]) / 1e6:.2f} M | {speed:.2f} | "
                  f"{off.num_ooms}/{on_.num_ooms} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
