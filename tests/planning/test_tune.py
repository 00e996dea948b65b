"""Replaying traces through the PyTorch allocator model, and ``gpumem tune`` (issue 20 items 2
and 3).

Levels: real. replay_torch_model drives the pure-Python model; tune replays gpumem's real pool
on private simulated devices and the model, in this process and in worker processes; the CLI
runs in-process through ``gpumem.cli.main``.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import gpumem
from gpumem import MemoryConfig
from gpumem.cli import DEMO_TRACE, main
from gpumem.errors import InvalidInputError, TraceFormatError
from gpumem.observe.replay import replay, replay_config
from gpumem.observe.trace import OP_ALLOC, OP_FREE, TraceData, read_trace
from gpumem.planning.torch_model import TorchAllocatorModel
from gpumem.planning.torch_replay import replay_torch_model
from gpumem.planning.tune import Candidate, device_capacity, gpumem_grid, tune

MiB, GiB = 1 << 20, 1 << 30
TRACES = sorted((Path(gpumem.__file__).parent / "data" / "traces").glob("*.csv.gz"))


def trace_of(events, streams=None) -> TraceData:
    """A TraceData from (op, id, size) rows."""
    ops = np.array([OP_ALLOC if o == "a" else OP_FREE for o, _, _ in events], dtype=np.int8)
    extra = {} if streams is None else {"stream": [str(s) for s in streams]}
    return TraceData(t_ns=np.arange(len(events), dtype=np.int64), ops=ops,
                     ids=np.array([i for _, i, _ in events], dtype=np.int64),
                     sizes=np.array([s for _, _, s in events], dtype=np.int64),
                     name="synthetic", extra=extra)


SMALL = trace_of([("a", 0, 30 * MiB), ("a", 1, 2 * MiB), ("f", 0, 30 * MiB),
                  ("a", 2, 40 * MiB), ("f", 1, 2 * MiB), ("f", 2, 40 * MiB)])


# --- replay_torch_model --------------------------------------------------------------------------
def test_replay_reports_what_the_model_did():
    """The replay's figures are the model's own (driven by hand here), and the series holds
    live and reserved bytes after each event."""
    res = replay_torch_model(SMALL, capacity="1GiB", record_series=True)
    m = TorchAllocatorModel(GiB)
    a, b = m.malloc(30 * MiB), m.malloc(2 * MiB)
    m.free(a)
    c = m.malloc(40 * MiB)
    m.free(b)
    m.free(c)
    assert res.peak_reserved_bytes == m.peak_reserved_bytes == 90 * MiB     # 30 + 20 + 40
    assert res.peak_live_bytes == 42 * MiB and res.num_ooms == 0
    assert res.driver_calls == m.driver_calls == 3
    assert res.series["reserved"].tolist() == [30 * MiB, 50 * MiB, 50 * MiB, 90 * MiB,
                                               90 * MiB, 90 * MiB]
    assert res.series["live"].tolist()[-1] == 0
    assert res.as_dict()["allocator"] == "torch" and "OUT OF MEMORY" not in str(res)


def test_replay_counts_ooms_and_skips_their_frees():
    """On 64 MiB the 40 MiB request fits only after the cached 30 MiB segment is released
    (a retry); on 56 MiB it fails even then (20 + 40 > 56): counted, its free skipped."""
    res = replay_torch_model(SMALL, capacity=64 * MiB)
    assert res.num_ooms == 0 and res.num_alloc_retries == 1 and res.peak_reserved_bytes == 60 * MiB
    res = replay_torch_model(SMALL, capacity=56 * MiB)
    assert res.num_ooms == 1 and res.failed_bytes == 40 * MiB and res.skipped_frees == 1
    assert "OUT OF MEMORY" in str(res)


def test_replay_keeps_streams_apart():
    """A trace with a stream column (an imported PyTorch snapshot) uses a pool per stream:
    a block freed on one stream is not reused by the other."""
    ev = [("a", 0, 4 * MiB), ("f", 0, 4 * MiB), ("a", 1, 4 * MiB), ("f", 1, 4 * MiB)]
    assert replay_torch_model(trace_of(ev), capacity=GiB).peak_reserved_bytes == 20 * MiB
    res = replay_torch_model(trace_of(ev, streams=[7, 7, 9, 9]), capacity=GiB)
    assert res.peak_reserved_bytes == 40 * MiB


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.split(".")[0])
def test_gpumem_reserves_no_more_than_torch_on_shipped_traces(path):
    """The claim in the README table: on every shipped trace gpumem's peak reserved bytes
    (today's default config, and with expandable segments) are at most the PyTorch model's,
    with torch's default and with expandable_segments:True respectively."""
    data = read_trace(path)
    for exp, conf in ((False, ""), (True, "expandable_segments:True")):
        g = replay(data, "sim:80GiB", replay_config("default").replace(expandable_segments=exp))
        t = replay_torch_model(data, capacity=80 * GiB, conf=conf)
        assert t.num_ooms == g.num_ooms == 0
        assert g.peak_reserved_bytes <= t.peak_reserved_bytes, (exp, g.peak_reserved_bytes,
                                                                t.peak_reserved_bytes)


# --- tune -------------------------------------------------------------------------------------------
def small_grid():
    return [Candidate("gpumem", "default"),
            Candidate("gpumem", "default", (("expandable_segments", True),))]


@pytest.mark.parametrize("jobs", [1, 2])
def test_tune_rows_recommendation_and_smallest_card(jobs):
    """One row per candidate, fitting rows first by peak reserved; the recommendation is the
    first of them; the smallest card found fits when replayed, and the row's config string
    rebuilds the configuration replayed (gpumem) or parses (torch)."""
    seen = []
    res = tune(DEMO_TRACE, "sim:4GiB", gpumem_configs=small_grid(),
               torch_confs=["", "expandable_segments:True"], jobs=jobs,
               progress=lambda done, total: seen.append((done, total)))
    assert len(res.rows) == 4 and seen[-1] == (4, 4)
    assert {r["allocator"] for r in res.rows} == {"gpumem", "torch"}
    fitting = [r for r in res.rows if r["fits"]]
    assert res.recommended == fitting[0]
    assert [r["peak_reserved_bytes"] for r in fitting] == \
        sorted(r["peak_reserved_bytes"] for r in fitting)
    data = read_trace(DEMO_TRACE)
    for r, cand in [(r, c) for c in small_grid() for r in res.rows if r["config"] == c.config]:
        cfg = eval(r["config"], {"MemoryConfig": MemoryConfig})
        assert cfg == cand.memory_config()
        cap = r["min_capacity_bytes"]
        assert data.peak_live_bytes < cap <= 4 * GiB
        assert replay(data, f"sim:{cap}B", cfg).num_ooms == 0
    for r in res.rows:
        if r["allocator"] == "torch":
            cap = r["min_capacity_bytes"]
            assert replay_torch_model(data, capacity=cap, conf=r["config"]).num_ooms == 0
            assert cap <= r["peak_reserved_bytes"]
    json.dumps(res.as_dict())
    assert "recommended" in res.table()


def test_tune_on_a_device_too_small_for_everything():
    """Nothing fits: no recommendation, every row says NO, and the smallest card is larger
    than the device."""
    res = tune(DEMO_TRACE, "sim:1GiB", gpumem_configs=small_grid()[:1], torch_confs=[""],
               jobs=1)
    assert res.recommended is None and not any(r["fits"] for r in res.rows)
    assert all(r["min_capacity_bytes"] > GiB for r in res.rows)
    assert "nothing fits" in res.table()


def test_tune_reads_a_pytorch_snapshot(tmp_path):
    """A PyTorch memory snapshot pickle is a workload too."""
    A, B = 0x7F00_0000_0000, 0x7F00_0200_0000
    trace = [{"action": a, "addr": addr, "size": s, "stream": 0, "time_us": t}
             for a, addr, s, t in [("alloc", A, 30 * MiB, 1), ("alloc", B, 8 * MiB, 2),
                                   ("free_completed", A, 30 * MiB, 3),
                                   ("free_completed", B, 8 * MiB, 4)]]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    res = tune(path, "sim:1GiB", gpumem_configs=[], torch_confs=[""], jobs=1)
    assert res.rows[0]["peak_live_bytes"] == 38 * MiB
    assert res.rows[0]["peak_reserved_bytes"] == 50 * MiB


def test_tune_bad_input():
    """A device without a size, an empty grid, a trace that does not parse, a bad torch
    setting: clear InvalidInputErrors before anything runs."""
    for dev in ("sim:0", "cuda:0", "sim", "", "sim:abcGiB"):
        with pytest.raises(InvalidInputError):
            device_capacity(dev)
    assert device_capacity("sim:24GiB") == 24 * GiB
    with pytest.raises(InvalidInputError, match="grid is empty"):
        tune(DEMO_TRACE, "sim:4GiB", gpumem_configs=[], torch_confs=[])
    with pytest.raises(InvalidInputError, match="foo"):
        tune(DEMO_TRACE, "sim:4GiB", gpumem_configs=[], torch_confs=["foo:1"])
    with pytest.raises(InvalidInputError, match="preset"):
        gpumem_grid(["fast"])
    with pytest.raises(InvalidInputError, match="jobs"):
        tune(DEMO_TRACE, "sim:4GiB", gpumem_configs=[], torch_confs=[""], jobs=0)


def test_default_grid_covers_presets_expandable_split_sizes_and_release_before_grow():
    """The built-in gpumem grid: every preset, expandable off/on, the preset's max_split_size
    and two others, release_before_grow on/off, and 20 MiB physical handles and one handle
    per growth with expandable segments on; no duplicates."""
    grid = gpumem_grid()
    cfgs = [c.memory_config() for c in grid]
    assert len({c.config for c in grid}) == len(grid) == 38
    assert {c.expandable_handle_size for c in cfgs} == {0, 20 * MiB, "growth"}
    assert all(c.expandable_segments for c in cfgs if c.expandable_handle_size)
    assert {c.preset for c in grid} == {"default", "inference", "constrained"}
    assert {c.expandable_segments for c in cfgs} == {False, True}
    assert {c.release_before_grow for c in cfgs} == {False, True}
    assert {c.max_split_size for c in cfgs} == {None, 64 * MiB, 256 * MiB}


# --- the command ---------------------------------------------------------------------------------------
def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tune_json_and_plot(capsys, tmp_path):
    """``gpumem tune demo --json -`` writes only JSON to stdout (the table goes to stderr);
    --plot writes a PNG of the best gpumem and torch rows."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "tune.png"
    code, out, err = run(capsys, "tune", "demo", "--device", "sim:4GiB", "--presets", "default",
                         "--torch-conf", "", "--jobs", "1", "--no-min-capacity", "--json", "-",
                         "--plot", str(png))
    assert code == 0, err
    doc = json.loads(out)
    # the default preset's 12 + one with 20 MiB handles + one handle per growth, and torch's
    # default
    assert len(doc["rows"]) == 12 + 2 + 1 and doc["capacity"] == 4 * GiB
    assert all(r["min_capacity_bytes"] is None for r in doc["rows"])
    assert "recommended" in err and png.stat().st_size > 10_000


@pytest.mark.parametrize("argv,msg", [
    (["tune", "demo", "--device", "sim:0"], "no size"),
    (["tune", "demo", "--device", "sim:4GiB", "--allocator", "gpumem", "--presets", ""],
     "grid is empty"),
    (["tune", "demo", "--device", "sim:4GiB", "--allocator", "torch", "--torch-conf", "x:1"],
     "unknown key"),
    (["tune", "NOFILE", "--device", "sim:4GiB"], "cannot read"),
])
def test_cli_tune_errors_exit_2(capsys, argv, msg):
    """Bad input is one error line and exit status 2."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and msg in err and err.count("\n") == 1


def test_cli_tune_trace_that_does_not_parse_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("t_ns,op\n1,a\n")
    code, out, err = run(capsys, "tune", str(bad), "--device", "sim:4GiB")
    assert code == 2 and "header" in err
    with pytest.raises(TraceFormatError):
        tune(bad, "sim:4GiB")
