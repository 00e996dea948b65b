"""Plots: PNGs are written; without matplotlib the error says which extra to install."""
from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpumem_sim
from gpumem.observe import plot
from gpumem.config import MemoryConfig
from gpumem.errors import GpuMemoryError, InvalidInputError
from gpumem.manager.memory_manager import MemoryManager
from gpumem.observe.replay import replay
from gpumem.observe.trace import read_trace
from invariants import DATA

REPO = Path(__file__).resolve().parents[2]
DEMO = DATA / "resnet50_train_step1.csv.gz"
PNG = b"\x89PNG\r\n\x1a\n"

needs_mpl = pytest.mark.skipif(
    __import__("importlib").util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (pip install gpumem-pool[plot])")


def _png_ok(path: Path) -> bool:
    data = Path(path).read_bytes()
    return data[:8] == PNG and len(data) > 5000


def _snapshot():
    mm = MemoryManager(gpumem_sim.SimDevice("1GiB"),
                       MemoryConfig(track_allocations=True, min_free_bytes=0))
    bufs = [mm.malloc(s << 20, tag=t) for s, t in ((64, "weights"), (3, "act"), (5, "act"),
                                                   (2, "kv"))]
    bufs += [mm.malloc(300, tag="small"), mm.malloc(7000)]
    bufs.pop(1).free()
    snap = mm.snapshot()
    for b in bufs:
        b.free()
    mm.close()
    return snap


@needs_mpl
def test_timeline_from_replay_and_from_trace(tmp_path):
    data = read_trace(DEMO).head(1500)
    res = replay(data, record_series=True)
    out = plot.plot_timeline(res, tmp_path / "t.png")
    assert out == str(tmp_path / "t.png") and _png_ok(tmp_path / "t.png")
    plot.plot_timeline(data, tmp_path / "t2.png", x="time", title="custom")
    assert _png_ok(tmp_path / "t2.png")
    with pytest.raises(InvalidInputError, match="record_series"):
        plot.plot_timeline(replay(data), tmp_path / "t3.png")
    with pytest.raises(InvalidInputError):
        plot.plot_timeline(res, tmp_path / "t4.png", x="bytes")


@needs_mpl
def test_segments(tmp_path):
    snap = _snapshot()
    plot.plot_segments(snap, tmp_path / "s.png")
    plot.plot_segments(snap, tmp_path / "n.png", normalize=True, max_segments=2)
    assert _png_ok(tmp_path / "s.png") and _png_ok(tmp_path / "n.png")
    with pytest.raises(InvalidInputError):
        plot.plot_segments({"device": "x"}, tmp_path / "bad.png")


@needs_mpl
def test_segments_of_a_replay_peak(tmp_path):
    res = replay(read_trace(DEMO), snapshot_at="peak")
    plot.plot_segments(res.snapshot, tmp_path / "peak.png")
    assert _png_ok(tmp_path / "peak.png")


@needs_mpl
def test_unwritable_path(tmp_path):
    with pytest.raises(InvalidInputError, match="cannot write"):
        plot.plot_segments(_snapshot(), tmp_path / "no" / "such" / "dir.png")


def test_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(plot.PlotDependencyError) as ei:
        plot.plot_segments(_snapshot(), tmp_path / "x.png")
    assert "pip install gpumem-pool[plot]" in str(ei.value)
    assert isinstance(ei.value, ImportError) and isinstance(ei.value, GpuMemoryError)
    with pytest.raises(ImportError, match=r"gpumem-pool\[plot\]"):
        plot.plot_timeline(DEMO, tmp_path / "y.png")
    assert not (tmp_path / "x.png").exists()


def test_module_imports_without_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None; import gpumem.observe.plot, gpumem.cli; "
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
