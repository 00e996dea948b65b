"""One statistics vocabulary (gpumem.stats, docs/statistics.md): every output names a figure
the same way and agrees with the others on its value; each old name still reads the same value
for one release, with a DeprecationWarning naming the new one; the docs table lists every name.

Level: real (the Cython pool on a simulated device, a replay through it, the torch allocator's
counters read in process without torch; Dask rows built from stand-in worker answers, the
cluster itself is tests/integrations/test_dask.py).
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest

from gpumem import MemoryStats
from gpumem.manager.measure import MeasuredStats
from gpumem.observe.replay import ReplayResult, replay
from gpumem.observe.snapshot import summarize, take_snapshot
from gpumem.observe.summary import summary_data
from gpumem.planning.torch_replay import TorchReplayResult
from gpumem.observe.trace import write_trace
from gpumem.stats import VOCABULARY, StatsDict, deprecated_names
from invariants import require_checkout

MiB = 1 << 20
DOCS = Path("docs") / "statistics.md"


@pytest.fixture
def used(make_manager):
    """A manager after 1 miss, 3 hits, 3 frees and one live 1 MiB buffer (1 MiB cached) in one
    2 MiB segment (plain segments, whatever GPUMEM_TEST_EXPANDABLE_SEGMENTS says)."""
    mm = make_manager(expandable_segments=False)
    mm.malloc(MiB).free()
    mm.malloc(MiB).free()
    live = mm.malloc(MiB)
    mm.malloc(MiB).free()
    yield mm
    live.free()


@pytest.fixture
def measured(used):
    with used.measure() as m:
        used.malloc(MiB).free()
    return m.stats


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> ReplayResult:
    path = tmp_path_factory.mktemp("trace") / "t.csv"
    write_trace(path, [(0, "a", 0, MiB), (1, "f", 0, MiB), (2, "a", 1, MiB), (3, "f", 1, MiB)])
    return replay(str(path), "sim:1GiB")


@pytest.fixture(scope="module")
def torch_replayed(tmp_path_factory):
    from gpumem.planning.torch_replay import replay_torch_model
    path = tmp_path_factory.mktemp("trace") / "t.csv"
    write_trace(path, [(0, "a", 0, MiB), (1, "a", 1, MiB), (2, "f", 0, MiB)])
    return replay_torch_model(str(path), capacity="1GiB")


def _torch_counters():
    from gpumem.integrations import torch as gm_torch
    return gm_torch.counters()


# --- the new names, the same values everywhere -------------------------------------------------
def test_every_output_speaks_the_vocabulary_and_agrees(used):
    """MemoryStats, pool.counters(), MemoryStats.as_dict(), summary_data() and a snapshot's
    totals give the nine figures under the same names and the same values."""
    st = used.stats()
    c = used.pool.counters(consistent=True)
    d = st.as_dict()
    summary = summary_data(used)
    fields = {f.name for f in dataclasses.fields(MemoryStats)}
    assert set(VOCABULARY) <= fields and set(VOCABULARY) <= set(c)
    for name in VOCABULARY:
        assert getattr(st, name) == c[name] == d[name] == summary[name], name
    assert (st.reserved_bytes, st.in_use_bytes, st.cached_bytes) == (2 * MiB, MiB, MiB)
    assert (st.num_allocs, st.num_frees, st.pool_hits, st.pool_misses) == (4, 3, 3, 1)
    totals = summarize(take_snapshot(used))
    assert (totals["reserved_bytes"], totals["in_use_bytes"], totals["cached_bytes"],
            totals["num_segments"]) == (st.reserved_bytes, st.in_use_bytes, st.cached_bytes,
                                        st.num_segments)
    json.dumps(summary)


def test_stats_text_says_which_peak(make_manager):
    """str(mm.stats()) names each peak it prints: "peak in use" and "peak reserved", each with
    its own figure (here 1 MiB in use at most, in a 2 MiB segment), and no bare "peak"."""
    from gpumem.units import format_bytes
    mm = make_manager(expandable_segments=False)
    mm.malloc(MiB).free()
    st = mm.stats()
    text = str(st)
    assert st.peak_in_use_bytes != st.peak_reserved_bytes
    assert f"peak in use {format_bytes(st.peak_in_use_bytes)}" in text
    assert f"peak reserved {format_bytes(st.peak_reserved_bytes)}" in text
    assert re.findall(r"peak (?!in use|reserved)", text) == []


def test_measured_replayed_and_torch_counters_use_the_names(measured, replayed):
    """MeasuredStats, ReplayResult and the torch allocator's counters() carry the vocabulary's
    counts (no old spelling among their fields or keys)."""
    assert (measured.num_allocs, measured.num_frees, measured.pool_hits,
            measured.pool_misses, measured.num_ooms) == (1, 1, 1, 0, 0)
    assert (replayed.pool_hits, replayed.pool_misses) == (1, 1)
    assert (replayed.num_allocs, replayed.num_frees) == (2, 2)
    assert {"num_allocs", "num_frees", "num_ooms"} <= set(_torch_counters())
    for cls in (MemoryStats, MeasuredStats, ReplayResult, TorchReplayResult):
        names = {f.name for f in dataclasses.fields(cls)}
        assert not names & set(deprecated_names(cls)), cls


# --- old names: a warning naming the new one, the same value -----------------------------------
ATTRIBUTES = [
    ("stats", "total_allocated_bytes", "reserved_bytes"),
    ("stats", "pooled_bytes", "cached_bytes"),
    ("stats", "peak_bytes", "peak_in_use_bytes"),
    ("measured", "allocations", "num_allocs"),
    ("measured", "frees", "num_frees"),
    ("measured", "hits", "pool_hits"),
    ("measured", "misses", "pool_misses"),
    ("measured", "ooms", "num_ooms"),
    ("replayed", "hits", "pool_hits"),
    ("replayed", "misses", "pool_misses"),
    ("replayed", "allocs", "num_allocs"),
    ("replayed", "frees", "num_frees"),
    ("torch_replayed", "allocs", "num_allocs"),
    ("torch_replayed", "frees", "num_frees"),
]


@pytest.mark.parametrize("what,old,new", ATTRIBUTES)
def test_old_attribute_warns_and_reads_the_new_one(what, old, new, used, measured, replayed,
                                                   torch_replayed):
    """obj.old reads obj.new's value, with a DeprecationWarning naming both."""
    obj = {"stats": used.stats(), "measured": measured, "replayed": replayed,
           "torch_replayed": torch_replayed}[what]
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is a deprecated name.*use '{new}'"):
        value = getattr(obj, old)
    assert value == getattr(obj, new) and isinstance(value, int)


def test_old_attribute_set_goes_to_the_new_field(replayed, used):
    """On the mutable ReplayResult, setting an old name sets the new field (with the warning);
    the frozen MemoryStats refuses it as it refuses the new name."""
    r = dataclasses.replace(replayed)
    with pytest.warns(DeprecationWarning, match="'hits'.*'pool_hits'"):
        r.hits = 42
    assert r.pool_hits == 42 and "hits" not in vars(r)
    with pytest.raises(dataclasses.FrozenInstanceError):
        used.stats().pooled_bytes = 1


DICTS = {
    "pool.counters()": (lambda mm, m, r: mm.pool.counters(),
                        {"hits": "pool_hits", "misses": "pool_misses"}),
    "MemoryStats.as_dict()": (lambda mm, m, r: mm.stats().as_dict(),
                              {"total_allocated_bytes": "reserved_bytes",
                               "pooled_bytes": "cached_bytes", "peak_bytes": "peak_in_use_bytes"}),
    "MeasuredStats.as_dict()": (lambda mm, m, r: m.as_dict(),
                                {"allocations": "num_allocs", "frees": "num_frees",
                                 "hits": "pool_hits", "misses": "pool_misses",
                                 "ooms": "num_ooms"}),
    "ReplayResult.as_dict()": (lambda mm, m, r: r.as_dict(),
                               {"hits": "pool_hits", "misses": "pool_misses",
                                "allocs": "num_allocs", "frees": "num_frees"}),
    "summary_data()": (lambda mm, m, r: summary_data(mm),
                       {"allocations": "num_allocs", "frees": "num_frees", "hits": "pool_hits",
                        "misses": "pool_misses", "ooms": "num_ooms", "segments": "num_segments",
                        "fragmentation": "fragmentation_ratio"}),
    "summary row": (lambda mm, m, r: summary_data(mm)["segments_by_class"][0],
                    {"segments": "num_segments", "free_bytes": "cached_bytes"}),
    "summarize(snapshot)": (lambda mm, m, r: summarize(take_snapshot(mm)),
                            {"segments": "num_segments", "allocated_bytes": "in_use_bytes",
                             "free_bytes": "cached_bytes",
                             "fragmentation": "fragmentation_ratio"}),
    "torch counters()": (lambda mm, m, r: _torch_counters(),
                         {"hits": "nogil_allocs", "frees": "nogil_frees", "ooms": "num_ooms"}),
}


@pytest.mark.parametrize("what", sorted(DICTS))
def test_old_dict_key_warns_and_reads_the_new_one(what, used, measured, replayed):
    """d["old"] and d.get("old") read d["new"] with a DeprecationWarning naming both; the old
    key is no key (not in the dict, its iteration or its JSON), and the listed renames are
    all of them."""
    make, renamed = DICTS[what]
    d = make(used, measured, replayed)
    assert isinstance(d, StatsDict) and dict(type(d).renamed) == renamed
    for old, new in renamed.items():
        assert new in d and old not in d and old not in json.loads(json.dumps(d))
        with pytest.warns(DeprecationWarning, match=rf"'{old}' is a deprecated name.*'{new}'"):
            assert d[old] == d[new]
        with pytest.warns(DeprecationWarning, match=rf"'{old}'"):
            assert d.get(old) == d[new]


def test_torch_replay_dict_reads_the_old_event_counts(torch_replayed):
    """TorchReplayResult.as_dict() (the PyTorch model's replay figures) names the trace's
    events num_allocs / num_frees; the old keys read them with a warning, JSON has the new."""
    d = torch_replayed.as_dict()
    assert (d["num_allocs"], d["num_frees"]) == (2, 1)
    assert "allocs" not in json.loads(json.dumps(d, default=str))
    with pytest.warns(DeprecationWarning, match="'allocs' is a deprecated name.*'num_allocs'"):
        assert d["allocs"] == 2
    with pytest.warns(DeprecationWarning, match="'frees'"):
        assert d.get("frees") == 1


def test_dask_rows_read_the_old_peak_key():
    """Dask report rows (from a stand-in scheduler_info()): 'peak_bytes' reads
    'peak_in_use_bytes' with the warning."""
    pytest.importorskip("distributed")
    from gpumem.dask.report import METRIC_NAME, rows_from_scheduler_info
    metric = {"device": "sim:0", "peak_in_use_bytes": 7}
    [row] = rows_from_scheduler_info({"workers": {"tcp://w:1": {
        "name": 0, "metrics": {METRIC_NAME: metric}}}})
    with pytest.warns(DeprecationWarning, match="'peak_bytes'.*'peak_in_use_bytes'"):
        assert row["peak_bytes"] == 7


def test_stats_dict_is_still_a_plain_dict_otherwise(used):
    """Unknown keys raise KeyError (get: the default), a copy and a pickle keep the class (so
    old keys keep reading after a trip to a Dask worker), and nothing warns on new keys."""
    c = used.pool.counters()
    with pytest.raises(KeyError):
        c["no_such_counter"]
    assert c.get("no_such_counter", -1) == -1 and c.get(3) is None
    for other in (c.copy(), pickle.loads(pickle.dumps(c))):
        assert type(other) is type(c) and other == c
        with pytest.warns(DeprecationWarning):
            assert other["hits"] == c["pool_hits"]


# --- docs ----------------------------------------------------------------------------------------
def test_the_docs_table_lists_every_name_and_every_old_name():
    """docs/statistics.md has a row for each of the nine names, with a torch key, and mentions
    every old name some output still reads (so the table cannot fall behind the code)."""
    text = (require_checkout("docs/statistics.md") / DOCS).read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    for name in VOCABULARY:
        assert name in rows, name
        assert rows[name].rstrip(" |").split("|")[-1].strip() not in ("", "–"), name
    olds = set()
    for make, renamed in DICTS.values():
        olds |= set(renamed)
    for cls in (MemoryStats, MeasuredStats, ReplayResult, TorchReplayResult):
        olds |= set(deprecated_names(cls))
    olds.add("peak_bytes")                                       # Dask rows
    for old in olds:
        assert f"`{old}`" in text, old
