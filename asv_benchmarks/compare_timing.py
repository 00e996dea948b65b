"""compare.py's timing and results table: the Timer (medians over repeats, wall or thread CPU
clock), the rows every benchmark records, and their printing. Imported by compare.py and
compare_peers.py; ``RESULTS``/``NOTES`` are module-level lists the run appends to (never rebound)."""
from __future__ import annotations

import gc
import statistics
import time

from benchmarks import GiB, KiB, MiB

RESULTS: list[dict] = []
NOTES: list[str] = []

class Skip(Exception):
    """A peer or a benchmark that cannot run here; the message says why."""


# =============================================================================================
# timing
# =============================================================================================
class Timer:
    def __init__(self, quick: bool, clock: str = "wall"):
        self.quick = quick
        # "cpu": this thread's CPU time, steadier than the wall clock on a loaded shared machine
        # (it leaves out the time spent waiting for a core; single-threaded benchmarks only)
        self.now = time.thread_time_ns if clock == "cpu" else time.perf_counter_ns
        self.clock = clock
        self.min_time = 0.05 if quick else 0.2
        self.repeats = 5 if quick else 15
        self.replays = 3 if quick else 7

    def calibrate(self, run) -> int:
        """Calls per repeat so that one repeat lasts >= min_time (like timeit.autorange)."""
        k = 1
        while True:
            t0 = self.now()
            run(k)
            dt = self.now() - t0
            if dt >= self.min_time * 1e9 or k >= 1 << 30:
                return k
            k = max(k * 2, int(k * self.min_time * 1e9 / max(dt, 1) * 1.2))

    def interleaved(self, runs: dict) -> dict:
        """{name: run}; run(k) performs k ops. Repeats alternate between the runs (A B C A B C
        ...) so that a noisy neighbour slows every peer alike; ns per op for each repeat."""
        gc_on = gc.isenabled()
        gc.disable()
        try:
            ks = {name: self.calibrate(run) for name, run in runs.items()}
            out: dict = {name: [] for name in runs}
            for _ in range(self.repeats):
                for name, run in runs.items():
                    k = ks[name]
                    t0 = self.now()
                    run(k)
                    out[name].append((self.now() - t0) / k)
            return out
        finally:
            if gc_on:
                gc.enable()

    def paired(self, runs: dict, ops: dict, base: str) -> dict:
        """Many short rounds, peers back to back in alternating order, for figures whose gap is
        smaller than the machine's drift. {name: run}, {name: ops per round}; returns {name:
        (ns per op for each round, median over rounds of this round's ns / base's ns)}."""
        rounds = 61 if self.quick else 201
        gc_on = gc.isenabled()
        gc.disable()
        try:
            out: dict = {name: [] for name in runs}
            names = list(runs)
            for r in range(rounds):
                for name in (names if r % 2 else names[::-1]):
                    t0 = time.perf_counter_ns()
                    runs[name](ops[name])
                    out[name].append((time.perf_counter_ns() - t0) / ops[name])
        finally:
            if gc_on:
                gc.enable()
        return {name: (samples, statistics.median(a / b for a, b in zip(samples, out[base])))
                for name, samples in out.items()}

    def ns_per_op(self, run) -> list[float]:
        return self.interleaved({"x": run})["x"]


def record(bench: str, peer: str, samples, unit: str = "ns", **extra) -> dict:
    samples = list(samples)
    row = {"bench": bench, "peer": peer, "unit": unit,
           "median": statistics.median(samples), "min": min(samples), "max": max(samples),
           "repeats": len(samples)}
    row.update(extra)
    RESULTS.append(row)
    return row


def skipped(bench: str, peer: str, reason: str) -> None:
    RESULTS.append({"bench": bench, "peer": peer, "skipped": reason})


def fmt_value(v: float, unit: str) -> str:
    if unit == "ns":
        if v >= 1e6:
            return f"{v / 1e6:.2f} ms"
        if v >= 1e4:
            return f"{v / 1e3:.1f} us"
        return f"{v:.1f} ns"
    if unit == "bytes":
        return f"{v / 2**20:.1f} MiB"
    if unit == "ratio":
        return f"{v:.3f}"
    return f"{v:.4g} {unit}"


def print_table(rows: list[dict]) -> None:
    """Rows grouped by bench; ratio = peer / gpumem for each bench that has a gpumem row."""
    benches: dict[str, list[dict]] = {}
    for r in rows:
        benches.setdefault(r["bench"], []).append(r)
    w = max([len(b) for b in benches] + [10])
    print(f"\n{'benchmark':<{w}}  {'peer':<26} {'median':>12} {'spread(min..max)':>22}  "
          f"{'peer/gpumem':>11}")
    print("-" * (w + 78))
    for bench, rs in benches.items():
        base = next((r["median"] for r in rs if r["peer"] == "gpumem" and "median" in r), None)
        first = True
        for r in rs:
            name = bench if first else ""
            first = False
            if "skipped" in r:
                print(f"{name:<{w}}  {r['peer']:<26} {'skipped':>12}   {r['skipped']}")
                continue
            unit = r["unit"]
            spread = f"{fmt_value(r['min'], unit)}..{fmt_value(r['max'], unit)}"
            ratio = ""
            if base and unit == "ns" and r["peer"] != "gpumem":
                ratio = f"{r['median'] / base:.2f}x"
            elif r["peer"] == "gpumem" and unit == "ns" and len(rs) > 1:
                ratio = "1.00x"
            extra = f"  {r['note']}" if r.get("note") else ""
            print(f"{name:<{w}}  {r['peer']:<26} {fmt_value(r['median'], unit):>12} "
                  f"{spread:>22}  {ratio:>11}{extra}")



def fmt_size(n: int) -> str:
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"
