"""Issue #40's figures for sleep and wake, on sim with the driver cost model
(gpumem_sim/driver_costs.py, the H200 table):

    python asv_benchmarks/sleep_wake.py cost [--traces a,b] [--cycles 3]
    python asv_benchmarks/sleep_wake.py hitpair [--main /work/main] [--repeats 21]

``cost``: each shipped PyTorch trace is replayed with every allocation in one tag up to its peak
of live bytes; there the tag sleeps and wakes (``--cycles`` times, with and without backup).
Reported per GiB slept: the modeled driver time of sleep + wake, for gpumem (a cache in front of
expandable segments, its default policy) and for torch_memory_saver's design replayed on the
same device model (one reservation, one physical handle and one mapping per allocation, no
cache: a sleep unmaps and releases every live allocation's handle, a wake creates and maps each
again). Also the modeled driver time of the replay itself (allocations and frees up to the
peak), where the cache is what differs. Backup copies cost the same bytes in both designs and
are not in the driver model: their wall time on sim is shown apart.

``hitpair``: the untagged 4 KiB hit pair (Python-level ``malloc`` + ``free`` from the cache),
timed in one run for (a) a manager that never used a region and (b) one whose region was used
(its tag pools exist, no region open), interleaved A/B by this thread's CPU time; with
``--main`` also the same pair in the main checkout's build (its own interpreter and venv),
interleaved process by process with this branch's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if any((REPO / "gpumem" / "_core").glob("pool*.so")):
    sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
TAG = "t"


def _peak_index(data) -> int:
    """The index of the event after which the live bytes peak."""
    live = best = 0
    at = 0
    sizes = {}
    for i, (op, ident, size) in enumerate(zip(data.ops.tolist(), data.ids.tolist(),
                                             data.sizes.tolist())):
        if op == 0:
            sizes[ident] = size
            live += size
        else:
            live -= sizes.pop(ident, 0)
        if live > best:
            best, at = live, i
    return at


#: backups are copied (host-backed sim) only for traces whose live bytes at the peak stay
#: below this: the copies and the device's backing are host memory of the machine running it
BACKUP_TRACE_LIMIT = 1 * GiB


def _device(back_memory: bool = False):
    import gpumem_sim
    return gpumem_sim.SimDevice("1TiB", back_memory=back_memory)


def gpumem_cycle(data, upto: int, cycles: int, backup: bool) -> dict:
    """Replay ``data[:upto+1]`` in one tag through a MemoryManager, then sleep and wake."""
    from gpumem import MemoryConfig, MemoryManager
    dev = _device(back_memory=backup)
    mm = MemoryManager(dev, MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                                         cpu_fallback_enabled=False))
    live = {}
    t0 = dev.modeled_driver_seconds
    with mm.region(TAG):
        for op, ident, size in zip(data.ops[:upto + 1].tolist(), data.ids[:upto + 1].tolist(),
                                   data.sizes[:upto + 1].tolist()):
            if op == 0:
                live[ident] = mm.malloc(size)
            else:
                buf = live.pop(ident, None)
                if buf is not None:
                    buf.free()
    replay_s = dev.modeled_driver_seconds - t0
    slept = 0
    t1 = dev.modeled_driver_seconds
    w0 = time.perf_counter()
    for _ in range(cycles):
        slept += mm.sleep(TAG, backup=backup)
        mm.wake()
    wall = time.perf_counter() - w0
    cycle_s = dev.modeled_driver_seconds - t1
    live_bytes = sum(b.nbytes for b in live.values())
    for b in live.values():
        b.free()
    mm.close()
    return {"replay_ms": replay_s * 1e3, "slept": slept / cycles, "live": live_bytes,
            "ms_per_gib": cycle_s * 1e3 / (slept / GiB) if slept else 0.0,
            "wall_s_per_gib": wall / (slept / GiB) if slept else 0.0}


def tms_cycle(data, upto: int, cycles: int) -> dict:
    """torch_memory_saver's design on the same device model: per allocation a reservation, a
    physical handle and a mapping (one set-access each); no cache."""
    dev = _device()
    page = dev.vm_granularity()
    live = {}
    t0 = dev.modeled_driver_seconds

    def make(size: int) -> tuple[int, int, int]:
        n = max(page, -(-size // page) * page)
        addr = dev.vm_reserve(n)
        h = dev.vm_create(n)
        dev.vm_map_many(addr, [(h, n)])
        return addr, h, n

    for op, ident, size in zip(data.ops[:upto + 1].tolist(), data.ids[:upto + 1].tolist(),
                               data.sizes[:upto + 1].tolist()):
        if op == 0:
            live[ident] = make(size)
        elif ident in live:
            addr, h, n = live.pop(ident)
            dev.vm_unmap(addr, n)
            dev.vm_release(h)
            dev.vm_free(addr, n)
    replay_s = dev.modeled_driver_seconds - t0
    slept = sum(n for _, _, n in live.values())
    t1 = dev.modeled_driver_seconds
    for _ in range(cycles):
        dev.synchronize()
        for ident, (addr, h, n) in live.items():            # pause
            dev.vm_unmap(addr, n)
            dev.vm_release(h)
        for ident, (addr, _, n) in list(live.items()):      # resume
            h = dev.vm_create(n)
            dev.vm_map_many(addr, [(h, n)])
            live[ident] = (addr, h, n)
    cycle_s = dev.modeled_driver_seconds - t1
    for addr, h, n in live.values():
        dev.vm_unmap(addr, n)
        dev.vm_release(h)
        dev.vm_free(addr, n)
    return {"replay_ms": replay_s * 1e3, "slept": slept,
            "ms_per_gib": cycle_s * 1e3 / (cycles * slept / GiB) if slept else 0.0}


def cost(traces: list[str], cycles: int) -> list[dict]:
    from gpumem.observe.trace import read_trace
    folder = Path(os.environ.get("GPUMEM_TRACES", REPO / "gpumem" / "data" / "traces"))
    rows = []
    for name in traces:
        path = folder / f"{name}.csv.gz"
        if not path.exists():
            print(f"{name}: trace not found in {folder}")
            continue
        data = read_trace(path)
        upto = _peak_index(data)
        g = gpumem_cycle(data, upto, cycles, backup=False)
        gb = (gpumem_cycle(data, upto, 1, backup=True) if g["live"] <= BACKUP_TRACE_LIMIT
              else None)
        t = tms_cycle(data, upto, cycles)
        rows.append({"trace": name, "gpumem": g, "gpumem_backup": gb, "tms": t})
        with_backup = (f"{gb['ms_per_gib']:.2f} ms (+ {gb['wall_s_per_gib']:.2f} s/GiB wall of "
                       f"host copies on sim)" if gb else "not run (live bytes > "
                       f"{BACKUP_TRACE_LIMIT / GiB:.0f} GiB)")
        print(f"{name}: live at peak {g['live'] / GiB:.2f} GiB; sleep+wake modeled driver time "
              f"per GiB: gpumem {g['ms_per_gib']:.2f} ms (slept {g['slept'] / GiB:.2f} GiB), "
              f"with backup {with_backup}, torch_memory_saver design {t['ms_per_gib']:.2f} ms "
              f"(slept {t['slept'] / GiB:.2f} GiB); replay to the peak: gpumem "
              f"{g['replay_ms']:.1f} ms, torch_memory_saver design {t['replay_ms']:.1f} ms")
    return rows


_PAIR = """
import sys, time
sys.path.insert(0, {repo!r})
from gpumem import MemoryConfig, MemoryManager
mm = MemoryManager("sim:4GiB", MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                                            cpu_fallback_enabled=False))
malloc = mm.malloc
for _ in range(20000):
    malloc(4096).free()
best = []
for _ in range(5):
    t0 = time.thread_time_ns()
    for _ in range(20000):
        malloc(4096).free()
    best.append((time.thread_time_ns() - t0) / 20000)
print(min(best))
"""


def _pair_in(python: str, repo: Path) -> float:
    out = subprocess.run([python, "-c", _PAIR.format(repo=str(repo))], capture_output=True,
                         text=True, cwd=str(repo), timeout=300)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return float(out.stdout.strip().splitlines()[-1])


def hitpair(repeats: int, main: str | None) -> None:
    from gpumem import MemoryConfig, MemoryManager
    cfg = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False)
    plain = MemoryManager("sim:4GiB", cfg)
    tagged = MemoryManager("sim:4GiB", cfg)
    with tagged.region("weights"):
        keep = tagged.malloc(MiB)                # its tag pool exists; no region open now
    pairs = 20_000

    def timed(mm: MemoryManager) -> float:
        malloc = mm.malloc
        t0 = time.thread_time_ns()
        for _ in range(pairs):
            malloc(4096).free()
        return (time.thread_time_ns() - t0) / pairs

    for mm in (plain, tagged):
        timed(mm)
    a, b, r = [], [], []
    for i in range(repeats):
        if i % 2:
            x = timed(plain); y = timed(tagged)
        else:
            y = timed(tagged); x = timed(plain)
        a.append(x); b.append(y); r.append(y / x)
    q = statistics.quantiles(r, n=4)
    print(f"untagged hit pair (4 KiB, Python level, {repeats} interleaved repeats of {pairs}): "
          f"no region ever {statistics.median(a):.0f} ns, after a region "
          f"{statistics.median(b):.0f} ns, paired ratio median {statistics.median(r):.3f}x "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f})")
    keep.free()
    plain.close()
    tagged.close()
    if main:
        main_repo = Path(main)
        main_py = str(main_repo / ".venv" / "bin" / "python")
        here_py = sys.executable
        m, h, ratios = [], [], []
        for i in range(max(3, repeats // 3)):
            if i % 2:
                x = _pair_in(main_py, main_repo); y = _pair_in(here_py, REPO)
            else:
                y = _pair_in(here_py, REPO); x = _pair_in(main_py, main_repo)
            m.append(x); h.append(y); ratios.append(y / x)
        print(f"hit pair, main ({main}) against this branch, {len(ratios)} interleaved process "
              f"pairs (best of 5 x 20000 each): main {statistics.median(m):.0f} ns, branch "
              f"{statistics.median(h):.0f} ns, paired ratio median "
              f"{statistics.median(ratios):.3f}x (range {min(ratios):.3f}-{max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--traces", default="resnet50_train,gpt2_train,gpt2_generate,bert_varlen_infer")
    c.add_argument("--cycles", type=int, default=3)
    h = sub.add_parser("hitpair")
    h.add_argument("--repeats", type=int, default=21)
    h.add_argument("--main", default=None, help="a main checkout with a built .venv")
    args = parser.parse_args()
    if args.what == "cost":
        cost(args.traces.split(","), args.cycles)
    else:
        hitpair(args.repeats, args.main)


if __name__ == "__main__":
    main()
