"""The gpumem command line: every command, and errors as one line with a non-zero status."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpumem.cli import DEMO_TRACE, main
from invariants import DATA

REPO = Path(__file__).resolve().parents[2]
#: the four real PyTorch traces shipped with gpumem (gpumem/data/traces; see their README.md)
SHARED = DATA / "traces"
needs_mpl = pytest.mark.skipif(
    __import__("importlib").util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("gpumem: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_no_command_prints_help(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "COMMAND" in err


def test_unknown_command(capsys):
    code, out, err = run(capsys, "frobnicate")
    assert code == 2
    assert "invalid choice" in _one_error_line(err)


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert code == 0 and out.startswith("gpumem ")


def test_info(capsys, sim_device):
    sim_device("4GiB")                         # simulated devices are listed once installed
    code, out, err = run(capsys, "info")
    assert code == 0
    assert "sim:0" in out and "usable" in out
    assert "cuda" in out                       # listed, available or with its reason
    code, out, err = run(capsys, "info", "--json")
    rows = json.loads(out)
    sim = [r for r in rows if r["device"] == "sim:0"][0]
    assert sim["available"] and sim["usable_memory"] <= sim["total_memory"]
    assert sim["pressure"] in ("LOW", "MEDIUM", "HIGH", "CRITICAL")


def test_estimate(capsys):
    code, out, err = run(capsys, "estimate", "--model", "mistral-7b", "--seq-len", "4096")
    assert code == 0 and "7,241,732,096" in out and "kv cache" in out
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--dtype", "fp32", "--json",
                         "--seq-len", "1024")
    assert code == 0 and json.loads(out)["parameters"] == 124_439_808
    code, out, err = run(capsys, "estimate", "--list")
    assert code == 0 and "llama-3-8b" in out
    code, out, err = run(capsys, "estimate", "--hidden-size", "768", "--intermediate-size",
                         "3072", "--layers", "12", "--vocab-size", "50257", "--heads", "12",
                         "--tie-embeddings", "--no-gated-mlp", "--bias", "--norm", "layer",
                         "--max-position-embeddings", "1024", "--seq-len", "128")
    assert code == 0 and "124,439,808" in out
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--device", "sim:1GiB",
                         "--seq-len", "512")
    assert code == 0 and "fits" in out


def test_estimate_errors(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt-9")
    assert code == 1 and "unknown model preset" in _one_error_line(err)
    code, out, err = run(capsys, "estimate", "--hidden-size", "768")
    assert code == 2 and "--intermediate-size" in _one_error_line(err)
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--dtype", "int4")
    assert code == 1 and "sub-byte" in _one_error_line(err)
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "abc")
    assert code == 2 and "invalid int value" in _one_error_line(err)


def test_replay_demo_and_outputs(capsys, tmp_path):
    code, out, err = run(capsys, "replay", "demo", "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    assert "reserved/live" in out and "hit rate" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["num_ooms"] == 0 and d["reserved_live_ratio"] >= 1.0
    # the statistics vocabulary's names (docs/statistics.md), not the old allocs/frees
    assert d["num_allocs"] > 0 and d["num_frees"] > 0
    assert d["num_allocs"] + d["num_frees"] == d["events"]
    assert "allocs" not in d and "frees" not in d


def test_replay_expandable_segments_default_and_off(capsys, tmp_path):
    """Level real (sim): `gpumem replay` uses the default config, expandable segments on where
    the device has virtual memory (sim: the pages are mapped, no driver segment for a large
    request); --no-expandable-segments replays with plain segments, and --expandable-segments
    gives the default's figures. The three differ only in the segments' kind."""
    d = {}
    for flag in ("", "--expandable-segments", "--no-expandable-segments"):
        out = tmp_path / f"r{len(d)}.json"
        code, _, err = run(capsys, "replay", "demo", "--device", "sim:80GiB", "--json", str(out),
                           *([flag] if flag else []))
        assert code == 0, err
        d[flag] = json.loads(out.read_text())
    assert d[""] == {**d["--expandable-segments"], "duration_s": d[""]["duration_s"],
                     "events_per_second": d[""]["events_per_second"]}
    assert d[""]["segments_created"] < d["--no-expandable-segments"]["segments_created"]


def test_replay_expandable_handle_size(capsys, tmp_path):
    """Level real (sim): --expandable-handle-size 20MiB replays with 20 MiB physical handles
    (fewer driver calls than one page each, on the same trace), and 'growth' with one handle
    per growth (fewer still); a size that does not parse is a usage error naming the flag
    (exit 2, one line)."""
    d = {}
    for flag in (["--expandable-handle-size", "0"], ["--expandable-handle-size", "20MiB"],
                 ["--expandable-handle-size", "growth"]):
        out = tmp_path / f"r{len(d)}.json"
        code, _, err = run(capsys, "replay", "demo", "--device", "sim:80GiB", "--json", str(out),
                           *flag)
        assert code == 0, err
        d[len(d)] = json.loads(out.read_text())
    assert d[2]["driver_calls"] < d[1]["driver_calls"] < d[0]["driver_calls"]
    code, _, err = run(capsys, "replay", "demo", "--expandable-handle-size", "lots")
    assert code == 2 and "--expandable-handle-size" in _one_error_line(err)


def test_replay_too_small_device_exits_2(capsys):
    code, out, err = run(capsys, "replay", str(DEMO_TRACE), "--device", "sim:256MiB")
    assert code == 2
    assert "OUT OF MEMORY" in out
    line = _one_error_line(err)
    assert "did not fit" in line and "sim:256MiB" in line
    assert err.count("out of memory on") <= 1             # repeated warnings folded


def test_replay_errors(capsys, tmp_path):
    code, out, err = run(capsys, "replay", str(tmp_path / "missing.csv"))
    assert code == 2 and "no such trace file" in _one_error_line(err)
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(gzip.compress(b"t_ns,op,id,size\n0,a,0,8\n1,f,3,8\n"))
    code, out, err = run(capsys, "replay", str(bad))
    assert code == 2 and "bad.csv.gz:3: free of unknown id 3" in _one_error_line(err)
    code, out, err = run(capsys, "replay", "demo", "--device", "warp:0")
    assert code == 1 and "warp:0" in _one_error_line(err)
    code, out, err = run(capsys, "replay", "demo", "--phase", "step7")
    assert code == 1 and "no phase 'step7'" in _one_error_line(err)
    code, out, err = run(capsys, "replay")
    assert code == 2 and "required" in _one_error_line(err)


def test_replay_phase_and_list(capsys):
    trace = str(SHARED / "resnet50_train.csv.gz")
    code, out, err = run(capsys, "replay", trace, "--list-phases")
    assert code == 0 and "step1" in out and "teardown" in out
    code, out, err = run(capsys, "replay", trace, "--phase", "step1", "--config", "inference")
    assert code == 0 and "[step1]" in out


def test_verbose_shows_debug(capsys):
    code, out, err = run(capsys, "-v", "replay", "demo")
    assert code == 0 and "gpumem: debug: new" in err
    code, out, err = run(capsys, "replay", "demo")
    assert "debug" not in err


@needs_mpl
def test_replay_and_plot_pngs(capsys, tmp_path):
    code, out, err = run(capsys, "replay", "demo", "--plot", str(tmp_path / "a.png"),
                         "--segments", str(tmp_path / "b.png"))
    assert code == 0, err
    code, out, err = run(capsys, "plot", "demo", str(tmp_path / "c.png"), "--x", "time",
                         "--segments", str(tmp_path / "d.png"))
    assert code == 0, err
    for name in "abcd":
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


@needs_mpl
def test_snapshot_command(capsys, tmp_path):
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    code, out, err = run(capsys, "snapshot", "--json", str(js), "--plot", str(png))
    assert code == 0, err
    assert "snapshot of sim:0" in out and "weights" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    code, out2, err = run(capsys, "snapshot", "--load", str(js), "--normalize", "--plot",
                          str(png))
    assert code == 0 and out2.splitlines()[0] == out.splitlines()[0]


def test_snapshot_errors(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    code, out, err = run(capsys, "snapshot", "--load", str(bad))
    assert code == 1 and "invalid JSON" in _one_error_line(err)
    code, out, err = run(capsys, "snapshot", "--load", str(tmp_path / "none.json"))
    assert code == 1 and "no such snapshot file" in _one_error_line(err)
    code, out, err = run(capsys, "snapshot", "--json", "-")
    assert code == 0 and '"segments"' in out


def test_demo(capsys, tmp_path):
    code, out, err = run(capsys, "demo")
    assert code == 0, err
    for words in ("1 miss, +1 segment", "1 hit", "OutOfMemoryError", "CPU fallback",
                  "reserved/live", "hit rate", "fragmentation", "segments", "still live"):
        assert words in out, words
    assert "out of memory" not in err                  # the on-purpose OOM is not logged


@needs_mpl
def test_demo_plot(capsys, tmp_path):
    code, out, err = run(capsys, "demo", "--plot", str(tmp_path / "demo.png"))
    assert code == 0, err
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "demo_segments.png").read_bytes()[:4] == b"\x89PNG"


def test_python_m_gpumem_errors_are_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "gpumem", "replay", str(tmp_path / "x.csv")],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2                            # a trace that cannot be read
    assert r.stderr.strip().startswith("gpumem: error:") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "gpumem", "info"], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0 and "sim:0" in r.stdout


# --- issue 15 item 10 ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ("replay", "demo", "--json", "-"),
    ("snapshot", "--json", "-"),
])
def test_json_dash_writes_only_json_to_stdout(capsys, argv):
    """real: with --json - stdout is one JSON document ending in a newline; the human report
    goes to stderr."""
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert out.endswith("}\n")
    json.loads(out)                  # nothing but JSON
    assert err.strip()               # the report is still shown


def test_estimate_defaults_and_training(capsys):
    """real: `gpumem estimate --model gpt2` works with no --seq-len (the model's maximum,
    1024); --training adds gradients and optimizer state; the MoE preset is listed."""
    code, out, err = run(capsys, "estimate", "--model", "gpt2")
    assert code == 0, err
    assert "1024 tokens (the model's maximum)" in out
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--json")
    assert code == 0 and out.endswith("\n") and json.loads(out)["seq_len"] == 1024
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--training", "--json",
                         "--seq-len", "256")
    d = json.loads(out)
    assert code == 0 and d["mode"] == "training" and d["optimizer"] == "adam"
    assert d["model_bytes"] + d["gradient_bytes"] + d["optimizer_bytes"] == 16 * 124_439_808
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--training",
                         "--optimizer", "sgd", "--seq-len", "256")
    assert code == 0 and "gradients" in out and "training with sgd" in out
    code, out, err = run(capsys, "estimate", "--list")
    assert code == 0 and "mixtral-8x7b" in out and "2/8" in out
    code, out, err = run(capsys, "estimate", "--hidden-size", "64", "--intermediate-size",
                         "256", "--layers", "2", "--vocab-size", "100", "--heads", "8")
    assert code == 2 and "--seq-len" in _one_error_line(err)


def test_demo_output_is_clean_and_aligned(capsys):
    """real (sim): a successful demo emits no warning (neither a Python warning nor a log
    line on stderr), prints each step's label before its outcome (the 1 GiB OOM comes after
    its label) with the outcome columns aligned, and names the replay device once."""
    import warnings
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        code, out, err = run(capsys, "demo")
    assert code == 0, err
    assert err == "" and [str(w.message) for w in rec] == []
    steps = [ln for ln in out.splitlines() if ln.startswith("  malloc") or ln.startswith("  free ")]
    assert len(steps) >= 9
    outcome_at = {next(i for i in range(52, len(ln)) if ln[i] != " ") for ln in steps}
    assert len(outcome_at) == 1, steps
    oom = out.index("malloc 1 GiB (more than the device)")
    assert oom < out.index("out of memory on sim:0")
    assert "sim(80.00 GiB) (80.00 GiB)" not in out
