"""``MemoryManager.memory_summary()`` / ``gpumem.observe.summary`` and ``gpumem summary`` in the CLI.

Level: **real** (the real Cython pool and MemoryManager on gpumem_sim devices; the CLI run
in-process through ``gpumem.cli.main``).
"""
from __future__ import annotations

import json

import pytest

from gpumem import MemoryConfig, MemoryManager
from gpumem.cli import main
from gpumem.cli.inspect import _demo_workload
from gpumem.errors import ClosedManagerError, InvalidInputError
from gpumem.observe.summary import summary_data
from gpumem.units import MiB, format_bytes

EXACT = dict(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False)


@pytest.fixture
def tracked(sim_device):
    sim_device("1GiB")
    mm = MemoryManager("sim:0", MemoryConfig(**EXACT, track_allocations=True))
    live = _demo_workload(mm)           # weights 128 MiB, kv-cache 12 MiB, activations...
    yield mm
    for b in live:
        b.free()
    mm.close()


def test_summary_figures_agree_with_stats_and_segments(tracked):
    d = summary_data(tracked)
    st = tracked.stats()
    assert d["reserved_bytes"] == st.reserved_bytes
    assert d["in_use_bytes"] == st.in_use_bytes and d["cached_bytes"] == st.cached_bytes
    assert d["peak_in_use_bytes"] == st.peak_in_use_bytes >= st.in_use_bytes
    assert (d["pool_hits"], d["pool_misses"], d["largest_free_block"]) == (
        st.pool_hits, st.pool_misses, st.largest_free_block)
    rows = d["segments_by_class"]
    assert sum(r["num_segments"] for r in rows) == st.num_segments
    assert sum(r["reserved_bytes"] for r in rows) == st.reserved_bytes
    assert sum(r["in_use_bytes"] for r in rows) == st.in_use_bytes
    assert {r["pool"] for r in rows} == {"small", "large"}
    assert [t["tag"] for t in d["top_tags"]][:3] == ["weights", "kv-cache", "activations"]
    assert d["top_tags"][0] == {"tag": "weights", "buffers": 2, "bytes": 128 * MiB}
    assert d["pressure"] == tracked.pressure().name
    json.dumps(d)                                       # JSON-ready


def test_segment_rows_leave_out_the_holes_of_expandable_segments(sim_device):
    """An expandable segment with unmapped pages (freed and given back by empty_cache) holds
    no memory there: its row counts only mapped pages, so the rows add up to the totals."""
    sim_device("1GiB")
    with MemoryManager("sim:0", MemoryConfig(**EXACT, segments="tight")) as mm:
        bufs = [mm.malloc(3 * MiB) for _ in range(10)]
        for b in bufs[::2]:
            b.free()
        mm.empty_cache()                                # unmaps the whole free pages
        segs = mm.pool.segments()
        assert any(b["state"] == "unmapped" for s in segs for b in s["blocks"])
        st, rows = mm.stats(), summary_data(mm)["segments_by_class"]
        assert sum(r["reserved_bytes"] for r in rows) == st.reserved_bytes
        assert sum(r["in_use_bytes"] for r in rows) == st.in_use_bytes
        assert sum(r["cached_bytes"] for r in rows) == st.cached_bytes
        for b in bufs[1::2]:
            b.free()


def test_summary_table_reads_at_a_glance(tracked):
    text = tracked.memory_summary(top_tags=2)
    st = tracked.stats()
    for label, value in (("reserved", st.reserved_bytes), ("in use", st.in_use_bytes),
                         ("cached", st.cached_bytes), ("largest free block",
                                                       st.largest_free_block)):
        line = next(x for x in text.splitlines() if x.startswith(label))
        assert format_bytes(value) in line, (label, line)
    assert "sim:0" in text and "pressure LOW" in text and "hit rate" in text
    assert "small" in text and "large" in text and "(1 MiB, 2 MiB]" in text
    tag_lines = text.split("top tags by bytes")[1].splitlines()[1:3]
    assert "weights" in tag_lines[0] and "kv-cache" in tag_lines[1]
    assert "activations" not in text                    # top_tags=2


def test_summary_without_tracking_and_with_fallback(sim_device):
    sim_device("64MiB")
    cfg = MemoryConfig(**{**EXACT, "cpu_fallback_enabled": True, "gpu_memory_fraction": 0.5})
    with MemoryManager("sim:0", cfg) as mm:
        fb = mm.malloc(48 * MiB)                        # over usable memory: host memory
        text = mm.memory_summary()
        assert "tracking is off" in text
        line = next(x for x in text.splitlines() if x.startswith("CPU fallbacks"))
        assert " 1 " in line and "48.00 MiB live" in line
        assert "(no segments)" in text
        fb.free()


def test_summary_bad_input(tracked):
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidInputError, match="top_tags"):
            tracked.memory_summary(top_tags=bad)
    other = MemoryManager("sim:0", MemoryConfig(**EXACT))
    other.close()
    with pytest.raises(ClosedManagerError):
        other.memory_summary()


def test_cli_summary(capsys):
    assert main(["summary"]) == 0
    out = capsys.readouterr().out
    assert "gpumem memory summary: sim:1GiB" in out and "weights" in out
    assert main(["summary", "--device", "cpu", "--json", "-", "--top-tags", "1"]) == 0
    data = json.loads(capsys.readouterr().out)          # only JSON on stdout
    assert data["device"] == "cpu" and len(data["top_tags"]) == 1
    assert main(["summary", "--device", "sim:7"]) == 1
    assert "sim:7" in capsys.readouterr().err
    assert main(["summary", "--top-tags", "-1"]) == 2
