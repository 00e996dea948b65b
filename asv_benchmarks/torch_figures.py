"""gpumem beside the model of PyTorch's caching allocator, on every shipped trace (gpumem/data
and gpumem/data/traces, or GPUMEM_TRACES) and the synthetic ones (seed 0): peak reserved bytes
of gpumem's default config (expandable segments off, and on) and of gpumem.TorchAllocatorModel
(PyTorch's defaults, and expandable_segments:True), all on 80 GiB, as a Markdown table; with
driver calls and their modeled time (gpumem_sim.driver_costs).

    python asv_benchmarks/torch_figures.py [--synthetic serving,varlen,training]

Level: real (gpumem's pool on a simulated device; torch's policy as a model, no GPU).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpumem.observe.replay import replay, replay_config
from gpumem.observe.trace import read_trace
from gpumem.planning.torch_replay import replay_torch_model

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def workloads(synthetic: str) -> list[tuple[str, object]]:
    data = HERE.parent / "gpumem" / "data"
    roots = [Path(os.environ["GPUMEM_TRACES"])] if os.environ.get("GPUMEM_TRACES") else \
        [data / "traces", data]
    out: list[tuple[str, object]] = [(p.name.split(".")[0], read_trace(p))
                                     for root in roots for p in sorted(root.glob("*.csv.gz"))]
    if synthetic:
        from gpumem.observe.synth_traces import synthesize
        out += [(f"synth {k} (seed 0)", synthesize(k, seed=0)) for k in synthetic.split(",")]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="serving,varlen,training",
                    help="synthetic kinds to add ('' for none)")
    args = ap.parse_args(argv)
    print("| trace | peak live MiB | gpumem default | gpumem expandable | torch default | "
          "torch expandable | gpumem default <= torch default / expandable | driver calls "
          "gpumem / torch / torch exp. | modeled driver ms gpumem / torch / torch exp. |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for label, data in workloads(args.synthetic):
        g = replay(data, "sim:80GiB", replay_config("default"))
        ge = replay(data, "sim:80GiB", replay_config("default").replace(expandable_segments=True))
        t = replay_torch_model(data, capacity=80 << 30)
        te = replay_torch_model(data, capacity=80 << 30, conf="expandable_segments:True")

        def mib(r) -> str:
            return f"{r.peak_reserved_bytes / MiB:,.0f} ({r.reserved_live_ratio:.3f})"

        ok = ["yes" if g.peak_reserved_bytes <= x.peak_reserved_bytes else "**no**"
              for x in (t, te)]
        ms = [f"{(r.modeled_driver_seconds or 0) * 1e3:,.0f}" for r in (g, t, te)]
        print(f"| {label} | {g.peak_live_bytes / MiB:,.0f} | {mib(g)} | {mib(ge)} | {mib(t)} | "
              f"{mib(te)} | {ok[0]} / {ok[1]} | {g.driver_calls:,} / {t.driver_calls:,} / "
              f"{te.driver_calls:,} | {' / '.join(ms)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
