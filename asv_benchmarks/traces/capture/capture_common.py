"""Shared capture code: run a workload under torch.profiler with profile_memory=True and write
a trace in the format of gpumem/data/traces (gzip CSV t_ns,op,id,size + one-line .json).

Allocation records (ptr, bytes, total_allocated) are read from the profiler's result tree
(kineto_results.experimental_event_tree(), _ExtraFields_Allocation): the c10 CPU allocator's
allocations (positive size) and frees (negative size). They are sorted by timestamp (ties keep
tree order), paired by address, and ids are assigned in allocation order. Frees of buffers
allocated before the profile are dropped (unmatched_frees_dropped); allocations still live at
the end are dropped too (allocs_never_freed), so that live bytes end at 0.
Phases come from record_function("phase:<name>") ranges around each part of the workload.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import gzip
import json
import os
import platform
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

OUT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the traces folder
NUM_THREADS = 1


def setup(seed: int = 0) -> None:
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(seed)
    import random
    random.seed(seed)


@contextlib.contextmanager
def phase(name: str):
    with record_function("phase:" + name):
        yield


def materialize(*modules: torch.nn.Module) -> list:
    """Re-allocate every parameter and buffer inside the profile (stands in for model.to(device)).
    Returns the old tensors: keep them alive until the profile ends so their frees stay out."""
    old = []
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                old.append(p.data)
                p.data = p.data.clone()
            for b in m.buffers():
                old.append(b.data)
                b.data = b.data.clone()
    return old


def _walk(roots):
    """Yield (event, parent_op_name) in tree order (iterative DFS)."""
    stack = [(r, "<python>") for r in reversed(roots)]
    while stack:
        ev, parent = stack.pop()
        yield ev, parent
        name = ev.name
        for c in reversed(ev.children):
            stack.append((c, name))


def capture(name: str, workload, *, description: str, config: dict, seed: int = 0) -> dict:
    """workload(): runs the whole thing (use phase(...) blocks, free everything before return)."""
    setup(seed)
    t0 = time.time()
    prep = workload.prepare() if hasattr(workload, "prepare") else None
    t_setup = time.time() - t0
    gc.collect()
    t1 = time.time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False,
                 with_stack=False) as prof:
        workload.run(prep)
        del prep
        gc.collect()
    t_run = time.time() - t1
    t2 = time.time()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocs = []   # (t, seq, ptr, size, total_allocated, device, parent)
    phases_raw = []
    seq = 0
    for ev, parent in _walk(tree):
        ef = ev.extra_fields
        tn = type(ef).__name__
        if tn == "_ExtraFields_Allocation":
            allocs.append((ev.start_time_ns, seq, ef.ptr, ef.alloc_size, ef.total_allocated,
                           str(ef.device), parent))
            seq += 1
        elif tn == "_ExtraFields_TorchOp" and ev.name.startswith("phase:"):
            phases_raw.append((ev.name[6:], ev.start_time_ns, ev.end_time_ns))
    del tree
    allocs.sort(key=lambda r: (r[0], r[1]))
    non_cpu = sum(1 for a in allocs if a[5] != "cpu")
    allocs = [a for a in allocs if a[5] == "cpu"]

    # c10 total_allocated cross-check: each step changes it by exactly the event's size
    total_mismatch = 0
    first_mismatch = None
    for k in range(1, len(allocs)):
        if allocs[k][4] - allocs[k - 1][4] != allocs[k][3]:
            total_mismatch += 1
            if first_mismatch is None:
                first_mismatch = k
    dup_ts = sum(1 for k in range(1, len(allocs)) if allocs[k][0] == allocs[k - 1][0])

    # pair by address
    live_by_ptr = {}   # ptr -> index into events
    events = []        # [t, op, key, size, parent]
    unmatched_frees = 0
    unmatched_free_bytes = 0
    size_mismatch = 0
    reuse_while_live = 0
    for (t, _s, ptr, size, _tot, _dev, parent) in allocs:
        if size > 0 or (size == 0 and ptr not in live_by_ptr):
            if ptr in live_by_ptr:
                reuse_while_live += 1
            key = len(events)
            live_by_ptr[ptr] = (key, size)
            events.append([t, "a", key, size, parent])
        else:
            got = live_by_ptr.pop(ptr, None)
            if got is None:
                unmatched_frees += 1
                unmatched_free_bytes += -size
                continue
            key, asize = got
            if asize != -size:
                size_mismatch += 1
            events.append([t, "f", key, asize, parent])
    never_freed = {k for k, _ in live_by_ptr.values()}
    never_freed_bytes = sum(s for _, s in live_by_ptr.values())
    never_freed_sizes = collections.Counter(s for _, s in live_by_ptr.values()).most_common(5)
    events = [e for e in events if e[2] not in never_freed]

    # phases -> row ranges (rows whose timestamp lies in the phase's range)
    times = [e[0] for e in events]
    import bisect
    phases = []
    for pname, ts, te in sorted(phases_raw, key=lambda p: p[1]):
        fr = bisect.bisect_left(times, ts)
        er = bisect.bisect_right(times, te)
        phases.append({"name": pname, "first_row": fr, "end_row": er})
    # make the ranges contiguous and cover every row (gaps between phases go to the next one)
    for k, p in enumerate(phases):
        p["first_row"] = 0 if k == 0 else phases[k - 1]["end_row"]
    if phases:
        phases[-1]["end_row"] = len(events)

    # renumber ids in allocation order, times from the first event
    tstart = events[0][0] if events else 0
    remap = {}
    rows = []
    op_allocs = collections.Counter()
    op_bytes = collections.Counter()
    for t, op, key, size, parent in events:
        if op == "a":
            remap[key] = len(remap)
            op_allocs[parent] += 1
            op_bytes[parent] += size
        rows.append((t - tstart, op, remap[key], size))
    for p in phases:
        p["t_start_ns"] = rows[p["first_row"]][0] if p["first_row"] < len(rows) else None
        p["t_end_ns"] = rows[p["end_row"] - 1][0] if p["end_row"] > p["first_row"] else None

    path = os.path.join(OUT_DIR, name + ".csv.gz")
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                 filename="") as gz:
        buf = ["t_ns,op,id,size\n"]
        buf.extend(f"{t},{op},{i},{s}\n" for t, op, i, s in rows)
        gz.write("".join(buf).encode())

    live = 0
    peak = 0
    sizes = []
    for t, op, i, s in rows:
        if op == "a":
            live += s
            sizes.append(s)
            peak = max(peak, live)
        else:
            live -= s
    sizes.sort()

    def pct(q):
        return sizes[min(len(sizes) - 1, int(q * len(sizes)))] if sizes else 0

    n_allocs = sum(1 for r in rows if r[1] == "a")
    meta = {
        "trace": name + ".csv.gz", "workload": name, "split": "new", "description": description,
        "config": config, "seed": seed,
        "torch_version": torch.__version__, "python": platform.python_version(),
        "device": "cpu", "torch_num_threads": torch.get_num_threads(),
        "mkldnn_enabled": torch.backends.mkldnn.is_available(),
        "capture": ("torch.profiler.profile(activities=[CPU], profile_memory=True); allocation "
                    "records (ptr, bytes, total_allocated) read from the profiler result tree "
                    "(kineto_results.experimental_event_tree, _ExtraFields_Allocation); c10 "
                    "DefaultCPUAllocator storage allocations/frees; sorted by timestamp; paired "
                    "by address; ids in allocation order; params/buffers re-allocated inside the "
                    "profile ('materialize' phase); 'teardown' frees everything; frees of "
                    "buffers allocated before the profile and allocations never freed are "
                    "dropped; script " + os.path.basename(sys.argv[0])),
        "csv_format": "t_ns,op,id,size ; op a=alloc f=free ; t_ns from the first event (CPU "
                      "wall clock with profiler overhead) ; size = requested bytes (not "
                      "rounded), repeated on frees",
        "n_events": len(rows), "n_allocs": n_allocs, "n_frees": len(rows) - n_allocs,
        "peak_live_bytes": peak, "total_bytes_allocated": sum(sizes),
        "distinct_sizes": len(set(sizes)),
        "allocs_le_8_bytes": sum(1 for s in sizes if s <= 8),
        "size_percentiles": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                             "max": sizes[-1] if sizes else 0, "min": sizes[0] if sizes else 0},
        "unmatched_frees_dropped": unmatched_frees,
        "unmatched_free_bytes_dropped": unmatched_free_bytes,
        "allocs_never_freed_dropped": len(never_freed),
        "allocs_never_freed_bytes_dropped": never_freed_bytes,
        "allocs_never_freed_top_sizes": never_freed_sizes,
        "allocs_never_freed": 0, "bytes_live_at_end": live,
        "free_size_mismatches": size_mismatch,
        "address_reused_while_live": reuse_while_live,
        "events_where_c10_total_allocated_step_differs_from_size": total_mismatch,
        "first_total_allocated_mismatch": first_mismatch,
        "non_cpu_events": non_cpu, "duplicate_timestamps": dup_ts,
        "duration_ns": rows[-1][0] if rows else 0,
        "phases": phases,
        "top_allocating_ops": [{"op": o, "allocs": c, "bytes": op_bytes[o]}
                               for o, c in op_allocs.most_common(12)],
        "wall_seconds": {"setup": round(t_setup, 2), "profiled_run": round(t_run, 2),
                         "postprocess": round(time.time() - t2, 2)},
    }
    with open(os.path.join(OUT_DIR, name + ".json"), "w") as f:
        f.write(json.dumps(meta, separators=(",", ":")) + "\n")
    print(f"{name}: {len(rows)} events, {n_allocs} allocs, peak {peak / 2**20:.1f} MiB, "
          f"unmatched frees {unmatched_frees}, never freed {len(never_freed)} "
          f"({never_freed_bytes} B), total_allocated mismatches {total_mismatch}, "
          f"size mismatches {size_mismatch}, reuse-while-live {reuse_while_live}, "
          f"dup ts {dup_ts}, phases {len(phases)}, wall {meta['wall_seconds']}, "
          f"gz {os.path.getsize(path) / 2**20:.2f} MiB")
    return meta
