"""A roomy card, this checkout against another (issue 38: soft limits must cost nothing there).

    python asv_benchmarks/roomy_card_ab.py --other /work/main [--rounds 5]

Runs the same measurement in this checkout's interpreter and in ``OTHER/.venv/bin/python``
(with ``OTHER`` as the working directory, so it imports that checkout's gpumem), alternating
rounds so that both see the same machine load, and prints medians:

- the Python-level hit pair (``malloc`` + ``free`` of 4 KiB and 1 MiB, cache warm) of a
  ``MemoryConfig()`` manager on ``sim:80GiB``, ns per pair (timeit-style: the median over
  repeats of the time of k pairs / k, garbage collector off);
- peak reserved bytes of each shipped trace replayed on ``sim:80GiB`` with ``MemoryConfig()``
  (deterministic: one round suffices, checked equal across rounds).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("GPUMEM_TRACES", ROOT / "gpumem" / "data" / "traces"))


def measure() -> dict:
    from gpumem import MemoryConfig, MemoryManager
    out: dict = {"hit_ns": {}, "peak_reserved": {}}
    mm = MemoryManager("sim:80GiB", MemoryConfig())
    for n in (4 << 10, 1 << 20):
        mm.malloc(n).free()                     # warm: the next pairs are hits
        k = 20000
        samples = []
        gc.disable()
        try:
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(k):
                    mm.malloc(n).free()
                samples.append((time.perf_counter() - t) / k * 1e9)
        finally:
            gc.enable()
        out["hit_ns"][str(n)] = statistics.median(samples)
    mm.close()
    from gpumem.observe.replay import replay
    for path in sorted(TRACES.glob("*.csv.gz")):
        r = replay(str(path), "sim:80GiB", MemoryConfig())
        out["peak_reserved"][path.name] = r.peak_reserved_bytes
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", help="the other checkout (with a built .venv)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return 0
    if not args.other:
        ap.error("--other is required")
    other = Path(args.other).resolve()
    runs = {"this": [], "other": []}
    for _ in range(args.rounds):
        for name, python, cwd in (("other", other / ".venv" / "bin" / "python", other),
                                  ("this", Path(sys.executable), ROOT)):
            res = subprocess.run([str(python), str(Path(__file__).resolve()), "--measure"],
                                 cwd=str(cwd), capture_output=True, text=True, check=True)
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    for n in ("4096", "1048576"):
        a = statistics.median(r["hit_ns"][n] for r in runs["this"])
        b = statistics.median(r["hit_ns"][n] for r in runs["other"])
        print(f"hit pair {int(n) >> 10} KiB: this {a:.0f} ns, other {b:.0f} ns "
              f"(this/other {a / b:.3f}; medians of {args.rounds} rounds)")
    for trace in runs["this"][0]["peak_reserved"]:
        a = {r["peak_reserved"][trace] for r in runs["this"]}
        b = {r["peak_reserved"][trace] for r in runs["other"]}
        print(f"peak reserved on sim:80GiB, {trace}: this {sorted(a)}, other {sorted(b)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
