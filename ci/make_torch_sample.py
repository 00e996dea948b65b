"""Writes gpumem/data/torch_snapshot_sample.pickle: a PyTorch memory snapshot (the layout of
``torch.cuda.memory._dump_snapshot``) to try ``gpumem import-torch`` and ``gpumem tune`` without
torch or a GPU.

How it is made (torch's CPU build records no CUDA snapshot): the first training step of the
shipped resnet50 trace (gpumem/data/resnet50_train_step1.csv.gz, recorded from PyTorch) is
replayed through gpumem's pool on a simulated device while a HistoryRecorder runs, and
:func:`gpumem.export_memory_viz` writes the snapshot: segments and blocks of the pool at the
end, one ``alloc`` per allocation and ``free_requested`` + ``free_completed`` per free, with the
pool's addresses (shifted to a fixed base). The events' ``time_us`` are then set from the trace's own timestamps (the
replay's clock says only how fast the replay ran), so the file is the same on every run.

    python ci/make_torch_sample.py [OUT]
"""
from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "gpumem" / "data" / "resnet50_train_step1.csv.gz"
OUT = ROOT / "gpumem" / "data" / "torch_snapshot_sample.pickle"
#: where the sample's lowest address lies (a typical CUDA device address)
ADDRESS_BASE = 0x7F2A_0000_0000


def build() -> bytes:
    """The sample's bytes."""
    import gpumem_sim
    from gpumem import MemoryConfig, MemoryManager, export_memory_viz
    from gpumem.observe.trace import OP_ALLOC, read_trace
    data = read_trace(SOURCE)
    cfg = MemoryConfig(min_free_bytes=0, cpu_fallback_enabled=False, segments="plain")
    with gpumem_sim.using(gpumem_sim.SimDevice("24GiB", name="sample")):
        with MemoryManager("sim:0", cfg) as mm:
            rec = mm.record_history(max_entries=len(data) + 16)
            live = {}
            for op, bid, size in zip(data.ops.tolist(), data.ids.tolist(), data.sizes.tolist()):
                if op == OP_ALLOC:
                    live[bid] = mm.malloc(size)
                else:
                    live.pop(bid).free()
            rec.stop()
            snap = export_memory_viz(mm, io.BytesIO())
            for buf in live.values():
                buf.free()
    # the simulated device's addresses depend on how many devices the process made before:
    # shift them all by one constant to a fixed, CUDA-like base
    events = snap["device_traces"][0]
    low = min([seg["address"] for seg in snap["segments"]] + [e["addr"] for e in events])
    shift = ADDRESS_BASE - low
    for seg in snap["segments"]:
        seg["address"] += shift
        for block in seg["blocks"]:
            block["address"] += shift
    for ev in events:
        ev["addr"] += shift
    times = iter(data.t_ns.tolist())
    t_us = 0
    for ev in snap["device_traces"][0]:
        if ev["action"] != "free_completed":       # one per trace event; completed = requested
            t_us = next(times) // 1000
        ev["time_us"] = t_us
    snap["allocator_settings"] = {"source": "gpumem ci/make_torch_sample.py",
                                  "trace": SOURCE.name}
    return pickle.dumps(snap, protocol=4)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.write_bytes(build())
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
