"""From PyTorch (issue 41, point 11): a PYTORCH_CUDA_ALLOC_CONF value becomes a MemoryConfig
(keys without an equivalent named), export_memory_viz after recorder.stop() writes the recorded
events, and a sample PyTorch snapshot ships so `gpumem import-torch` runs without torch.

Level: real (MemoryConfig, the history recorder and the pool on gpumem_sim, the CLI).
"""
from __future__ import annotations

import io
import warnings

import pytest

import gpumem
from gpumem import MemoryConfig
from gpumem.errors import GpumemWarning, InvalidInputError
from gpumem.units import MiB


def test_from_torch_conf_maps_each_key_with_an_equivalent():
    """real: expandable_segments, max_split_size_mb and max_non_split_rounding_mb become
    their MemoryConfig fields; backend:native sets nothing and warns nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = MemoryConfig.from_torch_conf(
            "expandable_segments:True, max_split_size_mb:128,max_non_split_rounding_mb:40,"
            "backend:native")
    assert cfg == MemoryConfig(expandable_segments=True, max_split_size=128 * MiB,
                               oversize_slack=40 * MiB)
    assert MemoryConfig.from_torch_conf("expandable_segments:False").segment_policy == "plain"
    base = MemoryConfig.for_inference()
    assert MemoryConfig.from_torch_conf("", base) == base


def test_from_torch_conf_names_the_keys_without_an_equivalent():
    """real: garbage_collection_threshold and roundup_power2_divisions are named, with why,
    in one warning (and returned by torch_conf_changes); the rest is still applied."""
    from gpumem.planning.from_torch import torch_conf_changes
    conf = "garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,>:4],max_split_size_mb:64"
    with pytest.warns(GpumemWarning, match="garbage_collection_threshold .*roundup_power2_divisions"):
        cfg = MemoryConfig.from_torch_conf(conf)
    assert cfg.max_split_size == 64 * MiB
    changes, unmapped = torch_conf_changes(conf)
    assert changes == {"max_split_size": 64 * MiB}
    assert list(unmapped) == ["garbage_collection_threshold", "roundup_power2_divisions"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryConfig.from_torch_conf(conf, warn=False)


def test_from_torch_conf_refuses_what_pytorch_refuses():
    """real: an unknown key or a bad value is an InvalidInputError naming it."""
    with pytest.raises(InvalidInputError, match="unknown key 'max_split'"):
        MemoryConfig.from_torch_conf("max_split:128")
    with pytest.raises(InvalidInputError, match="max_split_size_mb must be >= 20"):
        MemoryConfig.from_torch_conf("max_split_size_mb:8")


def test_export_memory_viz_after_stop_writes_the_recorded_events():
    """real: recorder.stop() then export_memory_viz(manager) writes the events recorded (it
    wrote none: the stopped recorder was forgotten)."""
    with gpumem.MemoryManager("sim:1GiB", MemoryConfig(min_free_bytes=0)) as mm:
        rec = mm.record_history()
        bufs = [mm.malloc(MiB) for _ in range(3)]
        bufs[0].free()
        rec.stop()
        mm.malloc(MiB).free()                      # after stop: not exported
        data = gpumem.export_memory_viz(mm, io.BytesIO())
        actions = [e["action"] for e in data["device_traces"][0]]
        assert actions == ["alloc"] * 3 + ["free_requested", "free_completed"]
        for b in bufs[1:]:
            b.free()


def test_the_shipped_torch_sample_imports_without_torch(tmp_path, capsys):
    """real: `gpumem import-torch demo` reads the shipped snapshot (torch's layout, made by
    ci/make_torch_sample.py) into the trace it was made from: same sizes, order and times."""
    from gpumem.cli import main
    from gpumem.cli.common import DEMO_TRACE, TORCH_SAMPLE
    from gpumem.observe.trace import read_trace
    assert TORCH_SAMPLE.is_file()
    out = tmp_path / "t.csv.gz"
    assert main(["import-torch", "demo", "-o", str(out)]) == 0
    got, want = read_trace(out), read_trace(DEMO_TRACE)
    assert got.sizes.tolist() == want.sizes.tolist() and got.ops.tolist() == want.ops.tolist()
    assert ((got.t_ns - got.t_ns[0]) // 1000).tolist() == \
        ((want.t_ns - want.t_ns[0]) // 1000).tolist()
    assert got.peak_live_bytes == want.peak_live_bytes


def test_the_shipped_torch_sample_is_what_its_script_makes(tmp_path):
    """real: ci/make_torch_sample.py rebuilds the shipped file byte for byte (the sample is
    generated, not edited by hand)."""
    import runpy

    from gpumem.cli.common import TORCH_SAMPLE
    from invariants import require_checkout
    root = require_checkout("ci/make_torch_sample.py")
    build = runpy.run_path(str(root / "ci" / "make_torch_sample.py"))["build"]
    assert build() == TORCH_SAMPLE.read_bytes()
