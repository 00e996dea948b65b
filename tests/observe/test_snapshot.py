"""Snapshots: structure, tags from the tracker, JSON round trip, closed managers, bad files."""
from __future__ import annotations

import json

import pytest

from gpumem.errors import ClosedManagerError, InvalidInputError
from gpumem.manager.memory_manager import MemoryManager
from gpumem.observe.snapshot import (format_snapshot, load_snapshot, save_snapshot, summarize,
                             take_snapshot)

from invariants import sim_manager

MiB = 1 << 20


def _mm(track=True) -> MemoryManager:
    return sim_manager("2GiB", install=False, base=dict(min_free_bytes=0),
                       track_allocations=track)[1]


def _workload(mm):
    keep = [mm.malloc(3 * MiB, tag="act"), mm.malloc(40 * MiB, tag="weights"),
            mm.malloc(700, tag=("tuple", 1)), mm.malloc(5 * MiB)]
    hole = mm.malloc(2 * MiB, tag="hole")
    tail = mm.malloc(4 * MiB, tag="tail")
    hole.free()
    return keep + [tail]


def test_structure_and_tiling():
    mm = _mm()
    live = _workload(mm)
    snap = mm.snapshot()
    json.dumps(snap)                                    # JSON-ready as is
    st = mm.stats()
    assert snap["device"] == mm.device_string and snap["format"] == "gpumem-snapshot"
    assert snap["stats"]["in_use_bytes"] == st.in_use_bytes
    assert snap["config"]["min_free_bytes"] == 0 and snap["tracking"] is True
    assert snap["total_memory"] == 2 << 30
    assert sum(s["size"] for s in snap["segments"]) == st.reserved_bytes
    for seg in snap["segments"]:
        off = 0
        for b in seg["blocks"]:
            assert b["offset"] == off
            off += b["size"]
            if b["state"] == "free":
                assert b["id"] is None and b["tag"] is None and b["requested"] == 0
        assert off == seg["size"]
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "allocated"]
    assert sorted(b["id"] for b in blocks) == sorted(b.id for b in live)
    tags = {b["id"]: b["tag"] for b in blocks}
    assert tags[live[0].id] == "act" and tags[live[3].id] is None
    assert tags[live[2].id] == "('tuple', 1)"          # non-JSON tags become str
    assert sum(b["requested"] for b in blocks) == st.requested_bytes
    s = summarize(snap)
    assert s["in_use_bytes"] == st.in_use_bytes
    assert s["cached_bytes"] == st.cached_bytes
    assert s["largest_free_block"] == st.largest_free_block
    assert s["bytes_by_tag"]["weights"] == 40 * MiB
    for b in live:
        b.free()
    mm.close()


def test_no_tags_without_tracking():
    mm = _mm(track=False)
    buf = mm.malloc(MiB, tag="x")
    snap = take_snapshot(mm)
    assert snap["tracking"] is False
    assert all(b["tag"] is None for s in snap["segments"] for b in s["blocks"])
    buf.free()
    mm.close()


def test_json_round_trip(tmp_path):
    mm = _mm()
    live = _workload(mm)
    snap = mm.snapshot()
    save_snapshot(snap, tmp_path / "s.json")
    assert load_snapshot(tmp_path / "s.json") == snap
    assert load_snapshot(str(tmp_path / "s.json")) == snap
    for b in live:
        b.free()
    mm.close()


def test_closed_manager():
    mm = _mm()
    mm.close()
    with pytest.raises(ClosedManagerError):
        mm.snapshot()
    with pytest.raises(ClosedManagerError, match="closed"):
        take_snapshot(mm)


@pytest.mark.parametrize("content, words", [
    ("{not json", "invalid JSON at line 1"),
    ("[1, 2]", "expected a JSON object"),
    ('{"device": "sim:0"}', "missing key(s)"),
    ('{"format": "other", "device": 1, "time": 0, "stats": {}, "config": {}, "segments": []}',
     "format is 'other'"),
    ('{"device": "x", "time": 0, "stats": {}, "config": {}, "segments": [{"size": 10}]}',
     "segment #0 lacks"),
    ('{"device": "x", "time": 0, "stats": {}, "config": {}, "segments": [{"base": 0, '
     '"size": 10, "pool": "large", "stream": 0, "blocks": [{"offset": 0, "size": 20, '
     '"requested": 1, "state": "allocated"}]}]}', "past the segment's size"),
    ('{"device": "x", "time": 0, "stats": {}, "config": {}, "segments": [{"base": 0, '
     '"size": 10, "pool": "large", "stream": 0, "blocks": [{"offset": 0, "size": 10, '
     '"requested": 1, "state": "weird"}]}]}', "state 'weird'"),
    ('{"version": 99, "device": "x", "time": 0, "stats": {}, "config": {}, "segments": []}',
     "version 99"),
])
def test_load_bad_files(tmp_path, content, words):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(InvalidInputError) as ei:
        load_snapshot(p)
    assert "bad.json" in str(ei.value) and words in str(ei.value)


def test_load_missing_file(tmp_path):
    with pytest.raises(InvalidInputError, match="no such snapshot file"):
        load_snapshot(tmp_path / "none.json")


def test_save_validates(tmp_path):
    with pytest.raises(InvalidInputError):
        save_snapshot({"device": "x"}, tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def test_format_snapshot_text():
    mm = _mm()
    live = _workload(mm)
    text = format_snapshot(mm.snapshot(), max_segments=2, max_blocks=2)
    assert text.startswith(f"snapshot of {mm.device_string}")
    assert "by tag: weights 40.00 MiB" in text
    assert "more segment(s)" in text
    for b in live:
        b.free()
    mm.close()
