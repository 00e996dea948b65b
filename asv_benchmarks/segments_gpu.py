"""gpumem's segment settings beside PyTorch's real caching allocator, trace by trace (issue 31).

    python asv_benchmarks/segments_gpu.py [--device cuda:0] [--repeat 3] [--traces A.csv.gz ...]
        [--no-shipped] [--no-synthetic] [--out docs/data/segments_gpu_<date>.json]

Every trace (the shipped ones, gpumem/data/traces/*.csv.gz; the synthetic serving, varlen and
training ones, seed 0; any given with --traces) is replayed

- through gpumem with each ``MemoryConfig.segments`` setting (auto, tight, fast, plain), by
  ``gpumem.replay(trace, device, config)`` (wall time: ``ReplayResult.duration_s``);
- through PyTorch's caching allocator, default and ``PYTORCH_CUDA_ALLOC_CONF=
  expandable_segments:True``, each in a process of its own (torch reads the variable once, when
  it initialises CUDA): one ``torch.cuda.caching_allocator_alloc`` per allocation and one
  ``caching_allocator_delete`` per free, on the current stream (as gpumem.replay allocates on
  the default stream), the loop timed with time.perf_counter; peak reserved is
  ``torch.cuda.max_memory_reserved()``, peak live the trace's peak of requested bytes.

Each cell: "wall ms, peak reserved / peak live", the median of ``--repeat`` runs; then the
same run's ratios auto/plain and auto/PyTorch (wall time and peak reserved) per trace. The table
is printed and written with every sample as JSON to ``--out``.

``--device sim:<size>`` runs gpumem's rows on a simulated device of that size and PyTorch's rows
on gpumem.planning.torch_replay.replay_torch_model (the model of its allocator), still one
process each, so the script runs without a GPU; its times are the sim's and the model's, not a
card's (the JSON adds each cell's modeled driver time: ``modeled_driver_ms``). A cuda device
without torch or a usable CUDA driver exits 2 with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))                    # this checkout's gpumem
sys.path.insert(0, str(HERE))

from driver_costs_gpu import _traces            # noqa: E402  (shipped + synthetic seed 0)
from frameworks_gpu import why_no_gpu           # noqa: E402

#: gpumem's settings (MemoryConfig.segments), in the table's order
SETTINGS = ("auto", "tight", "fast", "plain")
#: what each setting means in the fields that predate MemoryConfig.segments; used only where
#: this checkout's MemoryConfig has no ``segments`` field
FALLBACK = {"auto": {}, "tight": {"expandable_handle_size": 0},
            "fast": {"expandable_handle_size": "growth"},
            "plain": {"expandable_segments": False}}
#: PyTorch's rows: column -> PYTORCH_CUDA_ALLOC_CONF
TORCH_CONFS = {"PyTorch": "", "PyTorch expandable": "expandable_segments:True"}
COLUMNS = (*SETTINGS, *TORCH_CONFS)
EXIT_NO_GPU = 2


def segments_config(name: str) -> tuple[Any, str]:
    """The replay configuration for setting ``name`` and how it was made: ``segments=name``
    where MemoryConfig has that field, else the FALLBACK fields."""
    from gpumem.config import MemoryConfig
    from gpumem.observe.replay import replay_config
    # no free-memory margin: these figures measure the pool, not what the card keeps free
    base = replay_config("default").replace(min_free_bytes=0)
    if "segments" in {f.name for f in dataclasses.fields(MemoryConfig)}:
        return base.replace(segments=name), "MemoryConfig.segments"
    return base.replace(**FALLBACK[name]), "fallback fields (no MemoryConfig.segments here)"


# --- PyTorch's rows, in a child process each ----------------------------------------------------
def _torch_runs(data: Any, device: str, conf: str, repeat: int) -> dict:
    """``repeat`` replays through torch's real caching allocator on ``device`` (cuda:N)."""
    import torch
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") != conf:
        raise RuntimeError(f"PYTORCH_CUDA_ALLOC_CONF is "
                           f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r}, expected {conf!r}")
    index = int(device.split(":", 1)[1])
    torch.cuda.set_device(index)
    stream = torch.cuda.current_stream(index).cuda_stream
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    ops, ids, sizes = data.ops.tolist(), data.ids.tolist(), data.sizes.tolist()
    n = len(ops)
    runs = []
    for _ in range(repeat):
        torch.cuda.empty_cache()                # each run starts from nothing reserved
        torch.cuda.reset_peak_memory_stats(index)
        handles: dict[int, int] = {}
        pop = handles.pop
        ooms = 0
        t0 = time.perf_counter()
        for k in range(n):
            if ops[k] == 0:
                try:
                    handles[ids[k]] = alloc(sizes[k], index, stream)
                except torch.cuda.OutOfMemoryError:
                    ooms += 1
            else:
                ptr = pop(ids[k], None)
                if ptr:
                    delete(ptr)
        wall = time.perf_counter() - t0
        for ptr in handles.values():            # left live by the trace
            if ptr:
                delete(ptr)
        torch.cuda.synchronize(index)
        runs.append({"wall_s": wall, "peak_reserved_bytes": torch.cuda.max_memory_reserved(index),
                     "peak_live_bytes": data.peak_live_bytes, "num_ooms": ooms})
    return {"runs": runs, "torch": torch.__version__}


def _model_runs(data: Any, capacity: int, conf: str, repeat: int) -> dict:
    """``repeat`` replays through gpumem's model of torch's allocator (``--device sim:...``)."""
    from gpumem.planning.torch_replay import replay_torch_model
    runs = []
    for _ in range(repeat):
        r = replay_torch_model(data, capacity=capacity, conf=conf)
        runs.append({"wall_s": r.duration_s, "peak_reserved_bytes": r.peak_reserved_bytes,
                     "peak_live_bytes": r.peak_live_bytes, "num_ooms": r.num_ooms,
                     "modeled_driver_s": r.modeled_driver_seconds or 0.0})
    return {"runs": runs, "torch": "gpumem.TorchAllocatorModel"}


def child(trace_file: str, device: str, conf: str, repeat: int, capacity: int) -> dict:
    from gpumem.observe.trace import read_trace
    data = read_trace(trace_file)
    if device.startswith("sim:"):
        return _model_runs(data, capacity, conf, repeat)
    return _torch_runs(data, device, conf, repeat)


def probe_torch(device: str) -> str | None:
    """None where torch is importable and sees ``device``, else why not (in a child, so this
    process never initialises torch's CUDA)."""
    code = ("import json, torch; print(json.dumps([torch.__version__, "
            "torch.cuda.is_available(), torch.cuda.device_count()]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    if proc.returncode != 0:
        return f"torch is not usable here: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    version, available, count = json.loads(proc.stdout.strip().splitlines()[-1])
    index = int(device.split(":", 1)[1])
    if not available or index >= count:
        return f"torch {version} sees no {device} (cuda available: {available}, devices: {count})"
    return None


def spawn(trace_file: Path, device: str, conf: str, repeat: int, capacity: int) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    proc = subprocess.run([sys.executable, __file__, "--child", str(trace_file), device, conf,
                           str(repeat), str(capacity)], capture_output=True, text=True,
                          timeout=1800, cwd=REPO, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"failed": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}


# --- the parent --------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """One cell from its runs: medians, and every sample. On sim, also the driver time the
    cost model prices the run's calls at (gpumem_sim.driver_costs), which the wall time of a
    simulated replay leaves out."""
    walls = [r["wall_s"] for r in runs]
    reserved = int(statistics.median(r["peak_reserved_bytes"] for r in runs))
    live = max(r["peak_live_bytes"] for r in runs)
    cell = {"wall_ms": statistics.median(walls) * 1e3, "peak_reserved_bytes": reserved,
            "peak_live_bytes": live, "reserved_live_ratio": reserved / live if live else 0.0,
            "num_ooms": max(r["num_ooms"] for r in runs),
            "wall_ms_samples": [w * 1e3 for w in walls],
            "peak_reserved_samples": [r["peak_reserved_bytes"] for r in runs]}
    if all("modeled_driver_s" in r for r in runs):
        cell["modeled_driver_ms"] = statistics.median(r["modeled_driver_s"] for r in runs) * 1e3
    return cell


def gpumem_cell(data: Any, device: str, setting: str, repeat: int) -> dict:
    import gpumem
    cfg, _ = segments_config(setting)
    runs = []
    for _ in range(repeat):
        r = gpumem.replay(data, device, cfg)
        runs.append({"wall_s": r.duration_s, "peak_reserved_bytes": r.peak_reserved_bytes,
                     "peak_live_bytes": r.peak_live_bytes, "num_ooms": r.num_ooms})
        if device.startswith("sim:"):
            runs[-1]["modeled_driver_s"] = r.modeled_driver_seconds
    return summarize(runs)


def _ratio(a: dict, b: dict, key: str) -> float | None:
    if "failed" in a or "failed" in b or not b[key]:
        return None
    return a[key] / b[key]


def ratios(cells: dict) -> dict:
    auto, plain, torch = cells["auto"], cells["plain"], cells["PyTorch"]
    return {"wall auto/plain": _ratio(auto, plain, "wall_ms"),
            "wall auto/PyTorch": _ratio(auto, torch, "wall_ms"),
            "reserved auto/plain": _ratio(auto, plain, "peak_reserved_bytes"),
            "reserved auto/PyTorch": _ratio(auto, torch, "peak_reserved_bytes")}


def fmt_cell(c: dict) -> str:
    if "failed" in c:
        return "failed"
    ms = c["wall_ms"]
    text = f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"
    text += f", {c['reserved_live_ratio']:.3f}"
    return text + (f" ({c['num_ooms']} OOMs)" if c["num_ooms"] else "")


def tables(rows: list[dict]) -> str:
    lines = ["| trace | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [f"| {r['trace']} | " + " | ".join(fmt_cell(r["cells"][c]) for c in COLUMNS) + " |"
              for r in rows]
    keys = list(rows[0]["ratios"]) if rows else []
    lines += ["", "| trace | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {r['trace']} | " + " | ".join("-" if r["ratios"][k] is None
                                                else f"{r['ratios'][k]:.3f}" for k in keys) + " |"
              for r in rows]
    return "\n".join(lines)


def workloads(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from gpumem.observe.trace import read_trace
    chosen = [(name, t) for name, t in _traces()
              if (name.startswith("synth ") and args.synthetic)
              or (not name.startswith("synth ") and args.shipped)]
    chosen += [(Path(p).name.split(".")[0], Path(p)) for p in args.traces]
    return [(name, t if hasattr(t, "ops") else read_trace(t)) for name, t in chosen]


def check_device(device: str) -> tuple[str | None, str, int]:
    """(why the device cannot run this, or None; its name; its capacity in bytes)."""
    from gpumem.observe.replay import open_replay_device
    if device.startswith("cuda:"):
        why = why_no_gpu() or probe_torch(device)
        if why:
            return why, "", 0
    dev = open_replay_device(device)
    props = dev.properties()
    return None, props.name, props.total_memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or sim:<size> (no GPU)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell (the median is shown)")
    ap.add_argument("--traces", nargs="*", default=[], metavar="PATH", help="more traces")
    ap.add_argument("--no-shipped", dest="shipped", action="store_false",
                    help="leave out gpumem/data/traces/*.csv.gz")
    ap.add_argument("--no-synthetic", dest="synthetic", action="store_false",
                    help="leave out the synthetic serving, varlen and training traces")
    ap.add_argument("--out", type=Path, help="JSON file (default "
                    "docs/data/segments_gpu_<date>.json)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        trace_file, device, conf, repeat, capacity = args.child
        try:
            out = child(trace_file, device, conf, int(repeat), int(capacity))
        except Exception as exc:
            out = {"failed": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
        return 0
    kind, _, rest = args.device.partition(":")
    if not ((kind == "cuda" and rest.isdigit()) or (kind == "sim" and rest)):
        ap.error(f"--device must be cuda:N or sim:<size>, got {args.device!r}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    missing = [p for p in args.traces if not Path(p).is_file()]
    if missing:
        ap.error(f"--traces: no such file(s): {', '.join(missing)}")
    why, device_name, capacity = check_device(args.device)
    if why:
        print(f"segments_gpu.py: cannot run on {args.device}: {why}", file=sys.stderr)
        return EXIT_NO_GPU
    traces = workloads(args)
    if not traces:
        ap.error("no traces: give --traces or leave out --no-shipped / --no-synthetic")
    _, config_source = segments_config("auto")
    from gpumem.observe.trace import write_trace
    rows = []
    with tempfile.TemporaryDirectory(prefix="segments_gpu_") as tmp:
        for name, data in traces:
            trace_file = Path(tmp) / "trace.csv.gz"     # what the torch children replay
            # one stream for every row, as gpumem.replay allocates (the model would honour a
            # stream column; torch's child allocates on its current stream)
            write_trace(trace_file, data, extra_columns=[c for c in data.extra if c != "stream"])
            cells = {s: gpumem_cell(data, args.device, s, args.repeat) for s in SETTINGS}
            for column, conf in TORCH_CONFS.items():
                got = spawn(trace_file, args.device, conf, args.repeat, capacity)
                cells[column] = got if "failed" in got else {**summarize(got["runs"]),
                                                              "torch": got["torch"]}
            row = {"trace": name, "events": len(data), "cells": cells, "ratios": ratios(cells)}
            rows.append(row)
            print(f"{name}: " + "; ".join(f"{c} {fmt_cell(cells[c])}" for c in COLUMNS),
                  file=sys.stderr, flush=True)
    table = tables(rows)
    print(table)
    level = "GPU" if args.device.startswith("cuda:") else \
        "sim (gpumem on a simulated device; PyTorch rows: gpumem.TorchAllocatorModel)"
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    out = args.out or REPO / "docs" / "data" / f"segments_gpu_{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": today, "device": args.device, "device_name": device_name, "level": level,
        "capacity_bytes": capacity, "repeat": args.repeat, "columns": list(COLUMNS),
        "settings_made_by": config_source, "torch_confs": TORCH_CONFS, "rows": rows,
        "table": table}, indent=1))
    print(f"\nwritten: {out}")
    failed = [f"{r['trace']}/{c}" for r in rows for c in COLUMNS if "failed" in r["cells"][c]]
    if failed:
        print(f"failed cells: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
