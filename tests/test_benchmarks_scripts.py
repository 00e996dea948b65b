"""asv_benchmarks/segments_gpu.py (issue 31): the table of gpumem's segment settings beside
PyTorch's allocator. Level: real, in its ``--device sim:<size>`` mode (gpumem's pool on a
simulated device, PyTorch's rows on gpumem.TorchAllocatorModel in child processes); the GPU
mode itself runs in ci/gpu.sh.
"""
from __future__ import annotations

import importlib
import os
import json
import re
import subprocess
import sys

import pytest

import gpumem
from gpumem.observe.replay import replay
from gpumem.observe.trace import read_trace, write_trace
from gpumem.planning.torch_replay import replay_torch_model
from invariants import DATA, require_checkout

CAPACITY = "sim:80GiB"


@pytest.fixture(scope="module")
def script():
    root = require_checkout("asv_benchmarks/segments_gpu.py")
    sys.path.insert(0, str(root / "asv_benchmarks"))
    try:
        yield importlib.import_module("segments_gpu")
    finally:
        sys.path.remove(str(root / "asv_benchmarks"))


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    """The first 800 rows of resnet50_train (live buffers freed at the end): ~1,200 events."""
    path = tmp_path_factory.mktemp("segments") / "small.csv.gz"
    write_trace(path, read_trace(DATA / "traces" / "resnet50_train.csv.gz").head(800))
    return path


@pytest.fixture(scope="module")
def sim_run(script, small_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("segments_out") / "segments.json"
    proc = subprocess.run([sys.executable, script.__file__, "--device", CAPACITY, "--repeat",
                           "2", "--no-shipped", "--no-synthetic", "--traces", str(small_trace),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, json.loads(out.read_text())


def test_sim_mode_prints_one_row_per_trace_with_every_column(script, sim_run):
    """The printed table has the issue's columns and, for the one trace given, a cell
    "wall ms, peak reserved / peak live" in each; the ratio table follows it."""
    stdout, _ = sim_run
    lines = stdout.splitlines()
    assert lines[0] == ("| trace | auto | tight | fast | plain | PyTorch | PyTorch expandable |")
    row = next(line for line in lines if line.startswith("| small |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert len(cells) == 6
    assert all(re.fullmatch(r"\d+(\.\d)? ms, \d\.\d{3}", c) for c in cells), cells
    ratio_row = [line for line in lines if line.startswith("| small |")][1]
    assert len(ratio_row.strip("|").split("|")) == 5
    assert "| trace | wall auto/plain | wall auto/PyTorch | reserved auto/plain | " \
           "reserved auto/PyTorch |" in lines


def test_sim_mode_json_holds_each_setting_measured_as_named(script, sim_run, small_trace):
    """Each column of the JSON is the replay it names: gpumem's cells carry the peak reserved
    of gpumem.replay with that setting, PyTorch's those of the model with that
    PYTORCH_CUDA_ALLOC_CONF (so the child got its configuration), each with the modeled driver
    time of that same replay; every cell counts the trace's peak live bytes and holds
    ``--repeat`` samples, and the ratios are the cells'."""
    _, doc = sim_run
    assert {"date", "device", "level", "repeat", "columns", "settings_made_by", "rows",
            "table"} <= set(doc)
    assert doc["device"] == CAPACITY and doc["repeat"] == 2
    assert doc["columns"] == list(script.COLUMNS)
    [row] = doc["rows"]
    data = read_trace(small_trace)
    assert row["trace"] == "small" and row["events"] == len(data)
    assert list(row["cells"]) == list(script.COLUMNS)
    for name, cell in row["cells"].items():
        assert cell["peak_live_bytes"] == data.peak_live_bytes, name
        assert len(cell["wall_ms_samples"]) == 2 and cell["wall_ms"] > 0, name
        assert cell["num_ooms"] == 0 and cell["peak_reserved_bytes"] >= data.peak_live_bytes
    for setting in script.SETTINGS:
        cfg, _ = script.segments_config(setting)
        want = replay(data, CAPACITY, cfg)
        assert row["cells"][setting]["peak_reserved_bytes"] == want.peak_reserved_bytes, setting
        assert row["cells"][setting]["modeled_driver_ms"] == pytest.approx(
            want.modeled_driver_seconds * 1e3), setting
    for column, conf in script.TORCH_CONFS.items():
        want = replay_torch_model(data, capacity=80 << 30, conf=conf)
        assert row["cells"][column]["peak_reserved_bytes"] == want.peak_reserved_bytes, column
        assert row["cells"][column]["modeled_driver_ms"] == pytest.approx(
            want.modeled_driver_seconds * 1e3), column
    # the two PyTorch rows differ on this trace: the conf did reach the model
    assert row["cells"]["PyTorch"]["peak_reserved_bytes"] != \
        row["cells"]["PyTorch expandable"]["peak_reserved_bytes"]
    cells = row["cells"]
    assert row["ratios"]["wall auto/plain"] == pytest.approx(
        cells["auto"]["wall_ms"] / cells["plain"]["wall_ms"])
    assert row["ratios"]["reserved auto/PyTorch"] == pytest.approx(
        cells["auto"]["peak_reserved_bytes"] / cells["PyTorch"]["peak_reserved_bytes"])


def test_each_setting_is_made_by_its_name_or_the_fields_it_stands_for(script):
    """segments="plain"/"fast"/"tight"/"auto" through MemoryConfig.segments where it exists,
    else the fields each stands for (plain segments, one handle per growth, one-page handles,
    the default)."""
    default = gpumem.MemoryConfig.default()
    for name in script.SETTINGS:
        cfg, how = script.segments_config(name)
        assert cfg.cpu_fallback_enabled is False and cfg.min_free_bytes == 0   # a replay's
        if how == "MemoryConfig.segments":
            assert cfg.segments == name
        else:
            assert (cfg.expandable_segments, cfg.expandable_handle_size) == {
                "auto": (default.expandable_segments, default.expandable_handle_size),
                "tight": (True, 0), "fast": (True, "growth"), "plain": (False, 0)}[name]


def test_a_cuda_device_without_gpu_or_torch_exits_2_with_the_reason(script):
    """Asked for cuda:0 where no GPU (or no torch) is usable, the script says why and exits 2
    before replaying anything, instead of failing mid-table."""
    if script.why_no_gpu() is None and script.probe_torch("cuda:0") is None:
        pytest.skip("a usable GPU and torch are here: ci/gpu.sh runs the script for real")
    proc = subprocess.run([sys.executable, script.__file__, "--device", "cuda:0",
                           "--no-synthetic"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "cannot run on cuda:0:" in proc.stderr and proc.stdout == ""


#: a stand-in for torch in the script's GPU child: torch.cuda's caching-allocator entry points
#: over gpumem.TorchAllocatorModel (80 GiB, PYTORCH_CUDA_ALLOC_CONF read at import as torch
#: reads it when it initialises CUDA); it checks the device and stream it is handed
STAND_IN_TORCH = '''
import os
import types

from gpumem.errors import OutOfMemoryError as _ModelOom
from gpumem.planning.torch_model import TorchAllocatorModel

__version__ = "stand-in"
_model = TorchAllocatorModel(80 << 30, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
_STREAM = 7


class OutOfMemoryError(RuntimeError):
    pass


def _alloc(size, device, stream):
    assert device == 0 and stream == _STREAM, (device, stream)
    try:
        return _model.malloc(size)
    except _ModelOom as exc:
        raise OutOfMemoryError(str(exc))


def _reset_peak(device):
    assert _model.reserved_bytes == 0, "the peak is reset before the cache is emptied"
    _model.peak_reserved_bytes = 0


cuda = types.SimpleNamespace(
    set_device=lambda device: None, synchronize=lambda device: None,
    current_stream=lambda device: types.SimpleNamespace(cuda_stream=_STREAM),
    caching_allocator_alloc=_alloc, caching_allocator_delete=_model.free,
    empty_cache=_model.empty_cache, reset_peak_memory_stats=_reset_peak,
    max_memory_reserved=lambda device: _model.peak_reserved_bytes,
    OutOfMemoryError=OutOfMemoryError)
'''


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_gpu_child_replays_every_event_through_torch_and_reads_its_peak(
        script, small_trace, tmp_path, conf):
    """The child that replays a trace on torch's real allocator (run here on a stand-in torch
    built on the allocator model): each allocation and free reaches caching_allocator_alloc /
    _delete on the current stream, each repeat empties the cache before it resets the peak, each
    run's max_memory_reserved is the model's own replay's peak, and the child refuses to run
    under a PYTORCH_CUDA_ALLOC_CONF other than the one it was asked for."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(STAND_IN_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)

    def child(env_conf: str | None) -> dict:
        e = dict(env, **({"PYTORCH_CUDA_ALLOC_CONF": env_conf} if env_conf else {}))
        proc = subprocess.run([sys.executable, script.__file__, "--child", str(small_trace),
                               "cuda:0", conf, "3", "0"], capture_output=True, text=True,
                              timeout=600, env=e)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    got = child(conf)
    assert got["torch"] == "stand-in", got
    data = read_trace(small_trace)
    want = replay_torch_model(data, capacity=80 << 30, conf=conf).peak_reserved_bytes
    assert [r["peak_reserved_bytes"] for r in got["runs"]] == [want] * 3
    assert all(r["peak_live_bytes"] == data.peak_live_bytes and r["num_ooms"] == 0
               and r["wall_s"] > 0 for r in got["runs"])
    wrong = child("expandable_segments:False" if conf else "expandable_segments:True")
    assert "PYTORCH_CUDA_ALLOC_CONF" in wrong["failed"]
