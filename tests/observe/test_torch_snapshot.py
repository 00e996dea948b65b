"""The PyTorch bridge (issue 15 items 6 and 7): PyTorch memory snapshots in, memory-viz out.

Levels: the importer and exporter are tested **real** against the snapshot layout PyTorch
documents (``torch.cuda.memory._snapshot()``: ``segments`` and ``device_traces``), built here
by hand; the round trip runs through a real manager on the simulated device. The exported
pickle is also fed to torch's own ``torch.cuda._memory_viz`` functions (``segsum``, ``trace``,
``trace_plot``, ``segment_plot``, ``memory``) where torch is installed; those tests skip
cleanly where it is not (CI does not install torch: its Linux wheels pull gigabytes of CUDA).
"""
from __future__ import annotations

import io
import pickle

import numpy as np
import pytest

import gpumem
from gpumem import InvalidInputError, MemoryConfig, MemoryManager
from gpumem.cli import main
from gpumem.observe.torch_snapshot import export_memory_viz, read_torch_snapshot, to_memory_viz
from gpumem.observe.trace import OP_ALLOC, OP_FREE, read_trace

MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("clean_registry")


def ev(action, addr, size, t, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t,
            "frames": [{"filename": "train.py", "line": 1, "name": "step"}]}


def torch_like_snapshot() -> dict:
    """A snapshot as torch writes it: device 0 idle, device 1 with a history that starts
    with the free of a block allocated before recording (the ring dropped its alloc)."""
    A, B, C = 0x7F00_0000_0000, 0x7F00_0020_0000, 0x7F00_0040_0000
    trace = [
        ev("free_requested", 0x1000, 512, 100), ev("free_completed", 0x1000, 512, 100),
        ev("segment_alloc", A, 20 * MiB, 105),
        ev("alloc", A, 4 * MiB, 110), ev("alloc", B, 2 * MiB, 120, stream=7),
        ev("free_requested", A, 4 * MiB, 130), ev("free_completed", A, 4 * MiB, 131),
        ev("alloc", A, 1 * MiB, 140), ev("alloc", C, 8 * MiB, 150),
        ev("free_requested", B, 2 * MiB, 160), ev("free_completed", B, 2 * MiB, 165, stream=7),
        {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "time_us": 170,
         "device_free": 0, "frames": []},
    ]
    return {"segments": [], "device_traces": [[], trace]}


def test_torch_snapshot_becomes_a_replayable_trace(tmp_path):
    """real: allocs pair with free_completed by address; ids are renumbered in allocation
    order; time_us becomes t_ns from 0; the stream is kept; the early free is left out and
    counted; the trace replays on a simulated device."""
    d = read_torch_snapshot(torch_like_snapshot())
    assert d.metadata["device"] == 1 and d.metadata["orphan_frees"] == 1
    assert d.metadata["live_at_end"] == 2
    assert d.metadata["skipped_actions"] == {"free_requested": 3, "segment_alloc": 1, "oom": 1}
    assert d.ops.tolist() == [OP_ALLOC, OP_ALLOC, OP_FREE, OP_ALLOC, OP_ALLOC, OP_FREE]
    assert d.ids.tolist() == [0, 1, 0, 2, 3, 1]
    assert d.sizes.tolist() == [4 * MiB, 2 * MiB, 4 * MiB, 1 * MiB, 8 * MiB, 2 * MiB]
    assert d.t_ns.tolist() == [0, 10_000, 21_000, 30_000, 40_000, 55_000]
    assert d.extra["stream"] == ["0", "7", "0", "0", "0", "7"]
    assert d.peak_live_bytes == 11 * MiB
    # the same through a pickle file and the CLI, then replayed
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(torch_like_snapshot()))
    out = tmp_path / "t.csv.gz"
    assert main(["import-torch", str(snap), "-o", str(out)]) == 0
    back = read_trace(out)
    assert back.sizes.tolist() == d.sizes.tolist() and back.ops.tolist() == d.ops.tolist()
    # 1 GiB: the default preset keeps its 512 MiB free margin in a replay (as in tune's row)
    assert main(["replay", str(out), "--device", "sim:1GiB"]) == 0
    assert main(["replay", str(out), "--device", "sim:8MiB"]) == 2      # does not fit


@pytest.mark.parametrize("data, message", [
    ([{"address": 1}], "not a PyTorch memory snapshot"),
    ({"segments": []}, "not a PyTorch memory snapshot"),
    ({"segments": [], "device_traces": [[], []]}, "no traces recorded"),
    ({"device_traces": [[ev("alloc", 16, 8, 1), ev("alloc", 16, 8, 2)]]},
     "unpaired events: alloc at 0x10"),
    ({"device_traces": [[ev("alloc", 16, 8, 1), ev("free_completed", 16, 9, 2)]]},
     "unpaired events: free of 9 bytes"),
    ({"device_traces": [[ev("alloc", 16, 8, 1)], [ev("alloc", 16, 8, 1)]]},
     r"devices \[0, 1\] have traces"),
    ({"device_traces": [[{"action": "teleport", "addr": 1, "size": 1}]]},
     "unknown action 'teleport'"),
    ({"device_traces": [[{"action": "alloc", "addr": "0x10", "size": 1}]]},
     "'addr' must be an int"),
])
def test_bad_snapshots_are_named(data, message):
    """real: each malformed input is an InvalidInputError saying what is wrong."""
    with pytest.raises(InvalidInputError, match=message):
        read_torch_snapshot(data)


def test_strict_refuses_frees_of_unrecorded_allocations_and_pickles_run_no_code(tmp_path):
    """real: strict=True makes the dropped-alloc free an error; a pickle that refers to any
    class or function (as a malicious one would) is refused before anything runs."""
    with pytest.raises(InvalidInputError, match="free_completed at 0x1000 without an alloc"):
        read_torch_snapshot(torch_like_snapshot(), strict=True)

    class Boom:
        def __reduce__(self):
            return (print, ("ran",))
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"device_traces": [[Boom()]]}))
    with pytest.raises(InvalidInputError, match="refers to builtins.print"):
        read_torch_snapshot(evil)
    with pytest.raises(InvalidInputError, match="no such snapshot file"):
        read_torch_snapshot(tmp_path / "none.pickle")
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    with pytest.raises(InvalidInputError, match="not a readable pickle"):
        read_torch_snapshot(tmp_path / "junk.pickle")


def recorded_manager(sim_capacity="1GiB"):
    """A manager on a fresh sim device with history recording on, after a small workload
    that leaves two buffers live and one freed block cached."""
    import gpumem_sim
    gpumem_sim.install(gpumem_sim.SimDevice(sim_capacity))
    mm = MemoryManager("sim:0", MemoryConfig(min_free_bytes=0))
    rec = mm.record_history()
    a = mm.malloc(3 * MiB)
    b = mm.malloc(5000)
    c = mm.malloc(12 * MiB)
    a.free()
    return mm, rec, [b, c]


def test_export_layout_matches_pytorchs_snapshot():
    """real (sim): segments tile exactly with PyTorch's block states; the history becomes
    alloc / free_requested / free_completed at the buffers' real addresses; importing the
    export gives back the recorded trace."""
    mm, rec, live = recorded_manager()
    data = to_memory_viz(mm)
    assert data == to_memory_viz(mm.snapshot(), history=rec)
    for seg in data["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["blocks"][0]["address"] == seg["address"]
        assert {b["state"] for b in seg["blocks"]} <= {"active_allocated", "inactive"}
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"]
                                            if b["state"] == "active_allocated")
    addrs = {b["address"] for s in data["segments"] for b in s["blocks"]
             if b["state"] == "active_allocated"}
    assert {buf.ptr for buf in live} <= addrs
    actions = [e["action"] for e in data["device_traces"][0]]
    assert actions == ["alloc", "alloc", "alloc", "free_requested", "free_completed"]
    back = read_torch_snapshot(data)
    mine = rec.to_trace()
    assert back.ops.tolist() == mine.ops.tolist() and back.sizes.tolist() == mine.sizes.tolist()
    for b in live:
        b.free()
    mm.close()


def test_export_writes_a_pickle_and_refuses_other_sources(tmp_path):
    """real (sim): export_memory_viz writes a pickle loadable by plain pickle (no gpumem
    class inside); bad sources are named."""
    mm, rec, live = recorded_manager()
    path = tmp_path / "viz.pickle"
    written = export_memory_viz(mm, path)
    assert pickle.loads(path.read_bytes()) == written
    buf = io.BytesIO()
    export_memory_viz(mm.snapshot(), buf)
    assert pickle.loads(buf.getvalue())["segments"] == written["segments"]
    with pytest.raises(InvalidInputError, match="gpumem snapshot"):
        export_memory_viz({"segments": []}, path)
    with pytest.raises(InvalidInputError, match="MemoryManager"):
        export_memory_viz(42, path)
    assert gpumem.export_memory_viz is export_memory_viz
    for b in live:
        b.free()
    mm.close()


def test_torchs_memory_viz_reads_the_export(tmp_path):
    """real, with torch installed (skipped otherwise): torch's own _memory_viz functions run on
    the exported pickle: segsum's accounting asserts pass and report our reserved bytes, trace()
    lists our events, and the HTML viewers embed it."""
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz as viz
    mm, rec, live = recorded_manager()
    path = tmp_path / "viz.pickle"
    export_memory_viz(mm, path)
    with open(path, "rb") as f:
        data = pickle.load(f)
    summary = viz.segsum(data)
    reserved = mm.stats().reserved_bytes
    assert f"segments: {len(data['segments'])}" in summary
    assert f"total_reserved: {viz.Bytes(reserved)}" in summary
    text = viz.trace(data)
    assert "5 entries" in text and "del " in text
    for html in (viz.trace_plot(data), viz.segment_plot(data)):
        assert "snapshot.pickle" in html
    flame = viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "active_allocated" in flame
    for b in live:
        b.free()
    mm.close()
