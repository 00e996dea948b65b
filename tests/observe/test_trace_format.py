"""The trace format: reading the shared traces, validation errors naming file and line,
writing, phases and slicing."""
from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumem.errors import InvalidInputError, TraceFormatError
from gpumem.observe.trace import (OP_ALLOC, OP_FREE, Phase, TraceData, load_phases, read_trace,
                          write_trace)
from invariants import DATA

#: the four real PyTorch traces shipped with gpumem (gpumem/data/traces; see their README.md)
SHARED = DATA / "traces"
DEMO = DATA / "resnet50_train_step1.csv.gz"


def _write(tmp_path: Path, text: str, name: str = "t.csv", gz: bool = False) -> Path:
    p = tmp_path / name
    if gz:
        p.write_bytes(gzip.compress(text.encode()))
    else:
        p.write_text(text)
    return p


GOOD = "t_ns,op,id,size\n0,a,0,100\n5,a,1,50\n9,f,0,100\n12,f,1,50\n"


# --- reading ------------------------------------------------------------------------------------------
def test_read_plain_and_gzip(tmp_path):
    for gz in (False, True):
        d = read_trace(_write(tmp_path, GOOD, "t.csv.gz" if gz else "t.csv", gz=gz))
        assert len(d) == 4 and d.n_allocs == 2 and d.n_frees == 2
        assert d.ops.tolist() == [OP_ALLOC, OP_ALLOC, OP_FREE, OP_FREE]
        assert d.sizes.tolist() == [100, 50, 100, 50]
        assert d.peak_live_bytes == 150 and d.peak_index == 1
        assert d.live_bytes().tolist() == [100, 150, 50, 0]
        assert list(d)[0] == (0, "a", 0, 100)


def test_read_file_objects(tmp_path):
    assert len(read_trace(io.StringIO(GOOD))) == 4
    assert len(read_trace(io.BytesIO(gzip.compress(GOOD.encode())))) == 4
    with open(_write(tmp_path, GOOD), "rb") as f:
        assert len(read_trace(f)) == 4


def test_extra_columns_kept(tmp_path):
    text = "t_ns,op,id,size,stream,tag\n0,a,0,8,0,w\n1,f,0,8,0,\n"
    d = read_trace(_write(tmp_path, text))
    assert d.extra == {"stream": ["0", "0"], "tag": ["w", ""]}


def test_trace_may_end_with_live_buffers(tmp_path):
    d = read_trace(_write(tmp_path, "t_ns,op,id,size\n0,a,0,8\n1,a,1,8\n2,f,1,8\n"))
    assert d.n_allocs == 2 and d.n_frees == 1


@pytest.mark.parametrize("text, line, words", [
    ("time,op,id,size\n0,a,0,8\n", 1, "bad header"),
    ("t_ns,op,id\n0,a,0\n", 1, "bad header"),
    ("t_ns,op,id,size\n0,a,0,8\n1,x,0,8\n", 3, "unknown op 'x'"),
    ("t_ns,op,id,size\n0,a,0,8\n1,f,7,8\n", 3, "free of unknown id 7"),
    ("t_ns,op,id,size\n0,a,0,8\n1,f,0,8\n2,f,0,8\n", 4, "free of unknown id 0"),
    ("t_ns,op,id,size\n0,a,0,8\n1,a,0,8\n", 3, "already live"),
    ("t_ns,op,id,size\n0,a,0,-8\n", 2, "non-negative"),
    ("t_ns,op,id,size\n0,a,0,1.5\n", 2, "size must be"),
    ("t_ns,op,id,size\n0,a,0,8\n1,f,0,9\n", 3, "allocated with size 8"),
    ("t_ns,op,id,size\nx,a,0,8\n", 2, "t_ns must be an integer"),
    ("t_ns,op,id,size\n0,a,zero,8\n", 2, "id must be an integer"),
    ("t_ns,op,id,size\n0,a,-1,8\n", 2, "id must be >= 0"),
    ("t_ns,op,id,size\n0,a,0,8\n0,a\n", 3, "expected 4 columns"),
    ("t_ns,op,id,size\n0,a,0,8,extra\n", 2, "columns but the header has 4"),
    ("", 1, "empty file"),
    # extra columns write_trace could not write back (found by tests/fuzz/trace_csv.py)
    ("t_ns,op,id,size,stream,t_ns\n0,a,0,8,0,1\n", 1, "none of t_ns,op,id,size"),
    ('t_ns,op,id,size,"a,b"\n0,a,0,8,0\n', 1, "without ','"),
    ("t_ns,op,id,size,tag,tag\n", 1, "must be unique"),
])
def test_malformed_names_file_and_line(tmp_path, text, line, words):
    p = _write(tmp_path, text, "bad.csv")
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p)
    msg = str(ei.value)
    assert f"bad.csv:{line}:" in msg, msg
    assert words in msg, msg
    assert isinstance(ei.value, InvalidInputError)


def test_truncated_gzip_names_line(tmp_path):
    rows = "".join(f"{i},a,{i},{64 + i}\n" for i in range(5000))
    blob = gzip.compress(("t_ns,op,id,size\n" + rows).encode())
    p = tmp_path / "cut.csv.gz"
    p.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p)
    msg = str(ei.value)
    assert "cut.csv.gz:" in msg and "truncated gzip" in msg
    line = int(msg.split("cut.csv.gz:")[1].split(":")[0])
    assert 2 < line < 5002


def test_corrupt_gzip(tmp_path):
    blob = bytearray(gzip.compress((GOOD * 1).encode()))
    blob[12:20] = b"\xff" * 8
    p = tmp_path / "corrupt.csv.gz"
    p.write_bytes(bytes(blob))
    with pytest.raises(TraceFormatError, match="corrupt.csv.gz:"):
        read_trace(p)


def test_missing_file_and_bad_argument(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace file"):
        read_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceFormatError, match="directory"):
        read_trace(tmp_path)
    with pytest.raises(InvalidInputError):
        read_trace(42)  # type: ignore[arg-type]


def test_not_utf8(tmp_path):
    p = tmp_path / "bin.csv"
    p.write_bytes(b"t_ns,op,id,size\n0,a,0,8\n\xff\xfe\x00garbage\n")
    with pytest.raises(TraceFormatError, match="bin.csv:"):
        read_trace(p)


# --- writing ----------------------------------------------------------------------------------------------
def test_write_read_roundtrip_with_extras(tmp_path):
    rows = [(0, "a", 0, 100, 0, "sim:0", "weights"), (3, "a", 1, 7, 5, "cpu", None),
            (9, "f", 1, 7, 5, "cpu", None), (10, "f", 0, 100, 0, "sim:0", 'a,"b"')]
    for name in ("w.csv", "w.csv.gz"):
        n = write_trace(tmp_path / name, rows, extra_columns=("stream", "device", "tag"))
        assert n == 4
        d = read_trace(tmp_path / name)
        assert d.ids.tolist() == [0, 1, 1, 0]
        assert d.extra["tag"] == ["weights", "", "", 'a,"b"']
        assert d.extra["device"] == ["sim:0", "cpu", "cpu", "sim:0"]
        # TraceData round trip keeps the extra columns
        write_trace(tmp_path / ("again_" + name), d)
        d2 = read_trace(tmp_path / ("again_" + name))
        assert d2.extra == d.extra and d2.sizes.tolist() == d.sizes.tolist()
    assert (tmp_path / "w.csv.gz").read_bytes()[:2] == b"\x1f\x8b"


def test_write_is_deterministic(tmp_path):
    rows = [(0, "a", 0, 8), (1, "f", 0, 8)]
    write_trace(tmp_path / "a.csv.gz", rows)
    write_trace(tmp_path / "b.csv.gz", rows)
    assert (tmp_path / "a.csv.gz").read_bytes() == (tmp_path / "b.csv.gz").read_bytes()


@pytest.mark.parametrize("name", ["", "t_ns", "size", "a,b", " tag", 7])
def test_write_refuses_extra_names_the_reader_would_not_read_back(tmp_path, name):
    """Level: real. An extra column name read_trace refuses, or would read back changed (it
    strips blanks), is refused when writing, before the file is touched."""
    p = tmp_path / "x.csv"
    with pytest.raises(InvalidInputError, match="bad extra column name"):
        write_trace(p, [(0, "a", 0, 8, "x")], extra_columns=[name])
    assert not p.exists()


def test_write_rejects_bad_rows(tmp_path):
    with pytest.raises(InvalidInputError, match="op must be"):
        write_trace(tmp_path / "x.csv", [(0, "z", 0, 8)])
    with pytest.raises(InvalidInputError, match="expected 4 to 4 fields"):
        write_trace(tmp_path / "x.csv", [(0, "a", 0)])


events = st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 40)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(events)
def test_roundtrip_random_valid_streams(evs):
    live: list[tuple[int, int]] = []
    rows = []
    nxt = 0
    for t, (free_one, size) in enumerate(evs):
        if free_one and live:
            i, s = live.pop(size % len(live))
            rows.append((t, "f", i, s))
        else:
            rows.append((t, "a", nxt, size))
            live.append((nxt, size))
            nxt += 1
    buf = io.StringIO()
    write_trace(buf, rows)
    d = read_trace(io.StringIO(buf.getvalue()))
    assert [tuple(e) for e in d] == rows


# --- phases, slices --------------------------------------------------------------------------------------
def _phased(tmp_path: Path) -> Path:
    # step0: 0..4 (weights w=0 live throughout), step1: 4..8
    text = ("t_ns,op,id,size\n"
            "0,a,0,1000\n1,a,1,10\n2,a,2,20\n3,f,1,10\n"     # rows 0-3
            "4,a,3,30\n5,f,2,20\n6,a,4,40\n7,f,3,30\n")     # rows 4-7 (id 4 left live)
    p = _write(tmp_path, text, "ph.csv.gz", gz=True)
    (tmp_path / "ph.json").write_text(json.dumps({"phases": [
        {"name": "step0", "first_row": 0, "end_row": 4},
        {"name": "step1", "first_row": 4, "end_row": 8}]}))
    return p


def test_load_phases_and_select(tmp_path):
    p = _phased(tmp_path)
    assert load_phases(p) == [Phase("step0", 0, 4), Phase("step1", 4, 8)]
    assert load_phases(tmp_path / "ph.json") == load_phases(p)
    d = read_trace(p)
    assert d.phase_names() == ["step0", "step1"]
    s = d.select("step1")
    # live at the start: ids 0 and 2, allocated first; id 4 freed at the end
    assert [tuple(e) for e in s] == [(4, "a", 0, 1000), (4, "a", 2, 20), (4, "a", 3, 30),
                                    (5, "f", 2, 20), (6, "a", 4, 40), (7, "f", 3, 30),
                                    (7, "f", 0, 1000), (7, "f", 4, 40)]
    assert s.n_allocs == s.n_frees
    bare = d.select("step1", include_live=False, free_at_end=False)
    assert [e.id for e in bare] == [3, 4, 3]          # the free of id 2 is dropped
    r = s.renumbered()
    assert r.ids.tolist() == [0, 1, 2, 1, 3, 2, 0, 3] and r.t_ns[0] == 0
    buf = io.StringIO()
    write_trace(buf, s)
    assert len(read_trace(io.StringIO(buf.getvalue()))) == len(s)


def test_unknown_phase_lists_known(tmp_path):
    d = read_trace(_phased(tmp_path))
    with pytest.raises(InvalidInputError, match="phases: step0, step1"):
        d.select("step9")
    with pytest.raises(InvalidInputError, match="outside"):
        d.select((3, 99))


def test_no_sidecar_no_phases(tmp_path):
    p = _write(tmp_path, GOOD)
    assert load_phases(p) == []
    with pytest.raises(InvalidInputError, match="no .json sidecar"):
        read_trace(p).select("step0")


def test_bad_sidecar(tmp_path):
    p = _write(tmp_path, GOOD, "s.csv")
    (tmp_path / "s.json").write_text('{"phases": [{"name": "x"}]}')
    with pytest.raises(TraceFormatError, match="first_row"):
        read_trace(p)


def test_head(tmp_path):
    d = read_trace(_write(tmp_path, GOOD))
    h = d.head(2)
    assert h.n_allocs == 2 and h.n_frees == 2


# --- real traces -----------------------------------------------------------------------------------------
def test_packaged_demo_trace():
    d = read_trace(DEMO)
    assert DEMO.stat().st_size < 1 << 20
    assert d.n_allocs == d.n_frees > 1000
    assert d.ids[d.ops == OP_ALLOC].tolist() == list(range(d.n_allocs))   # 0..N-1
    assert d.live_bytes()[-1] == 0


@pytest.mark.parametrize("name", ["resnet50_train", "bert_varlen_infer", "gpt2_train",
                                  "gpt2_generate"])
def test_shared_traces_match_their_metadata(name):
    d = read_trace(SHARED / f"{name}.csv.gz")
    meta = json.loads((SHARED / f"{name}.json").read_text())
    assert len(d) == meta["n_events"]
    assert d.n_allocs == meta["n_allocs"]
    assert d.peak_live_bytes == meta["peak_live_bytes"]
    assert d.total_bytes_allocated == meta["total_bytes_allocated"]
    assert d.phase_names() == [p["name"] for p in meta["phases"]]
    assert isinstance(d, TraceData) and d.metadata["workload"] == name
    assert np.all(d.sizes >= 0)
