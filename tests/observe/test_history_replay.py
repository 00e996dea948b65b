"""History recording (ring buffer -> trace file) and replay through the real pool."""
from __future__ import annotations

import gc
import logging

import numpy as np
import pytest

import gpumem_sim
from gpumem.config import MemoryConfig
from gpumem.errors import InvalidDeviceError, InvalidInputError, OutOfMemoryError
from gpumem.observe.history import HistoryRecorder
from gpumem.manager.memory_manager import MemoryManager
from gpumem.observe.replay import ReplayResult, open_replay_device, replay, replay_config
from gpumem.observe.trace import OP_ALLOC, read_trace
from invariants import DATA, sim_manager

MiB = 1 << 20
#: the four real PyTorch traces shipped with gpumem (see their README.md)
SHARED = DATA / "traces"
DEMO = DATA / "resnet50_train_step1.csv.gz"


def _mm(capacity="2GiB", **cfg) -> MemoryManager:
    base = dict(min_free_bytes=0, track_allocations=False)
    return sim_manager(capacity, install=False, base=base, **cfg)[1]


# --- history -----------------------------------------------------------------------------------------
def test_record_and_write_renumbered(tmp_path):
    mm = _mm()
    before = mm.malloc(1000)                    # allocated before recording
    rec = mm.record_history()
    a = mm.malloc(MiB, tag="a")
    b = mm.malloc(512, tag="b")
    before.free()                               # its alloc is not in the ring: left out
    a.free()
    c = mm.malloc(3 * MiB)                      # left live
    ev = rec.events()
    assert [e.op for e in ev] == ["a", "a", "f", "f", "a"]
    assert ev[0].size == MiB and ev[0].tag == "a" and ev[0].id == a.id
    assert len(rec) == 5 and rec.dropped == 0
    n = rec.write(tmp_path / "h.csv.gz")
    assert n == 4
    d = read_trace(tmp_path / "h.csv.gz")
    assert [tuple(e) [1:] for e in d] == [("a", 0, MiB), ("a", 1, 512), ("f", 0, MiB),
                                         ("a", 2, 3 * MiB)]
    assert d.t_ns[0] == 0 and np.all(np.diff(d.t_ns) >= 0)
    assert d.extra["tag"] == ["a", "b", "a", ""]
    assert d.extra["stream"] == ["0"] * 4
    rec.stop()
    b.free(), c.free()
    mm.close()


def test_ring_drops_oldest_and_orphan_frees(tmp_path):
    mm = _mm()
    rec = mm.record_history(max_entries=4)
    bufs = [mm.malloc(1024 * (i + 1)) for i in range(4)]
    for b in bufs:
        b.free()
    assert len(rec) == 4 and rec.dropped == 4 and rec.recorded == 8
    # only frees are left in the ring: all orphans, nothing written but the header
    assert rec.write(tmp_path / "h.csv") == 0
    assert len(read_trace(tmp_path / "h.csv")) == 0
    rec.stop()
    mm.close()


def test_stop_unregisters(tmp_path):
    """real (sim): a recorder reads the pool's C history, so recording registers no observer
    (the hot path calls no Python); stop() unregisters it and keeps what it had."""
    mm = _mm()
    rec = mm.record_history()
    assert rec in mm._recorders and not mm._hooks and not mm._observers
    rec.stop()
    rec.stop()                                   # idempotent
    assert rec not in mm._recorders and not mm._hooks
    mm.malloc(100).free()
    assert len(rec) == 0
    mm.close()


def test_recorder_context_and_no_buffer_refs():
    mm = _mm()
    with mm.record_history() as rec:
        buf = mm.malloc(MiB)
        import weakref
        ref = weakref.ref(buf)
        del buf
        gc.collect()
        assert ref() is None
    assert [e.op for e in rec.events()] == ["a", "f"]
    assert rec.stopped
    with pytest.raises(InvalidInputError):
        HistoryRecorder(mm, max_entries=0)
    mm.close()


def test_fallback_events_marked_cpu(tmp_path):
    mm = _mm("1GiB", cpu_fallback_enabled=True, gpu_memory_fraction=0.9)   # a hard cap
    rec = mm.record_history()
    dev = mm.malloc(MiB)
    fb = mm.malloc(950 * MiB)
    assert fb.location == "cpu"
    fb.free(), dev.free()
    t = rec.to_trace()
    assert t.extra["device"][1] == "cpu" and t.extra["device"][0] != "cpu"
    assert t.n_allocs == t.n_frees == 2
    mm.close()


def test_recorded_history_replays(tmp_path):
    mm = _mm()
    rec = mm.record_history()
    live = []
    for i in range(200):
        live.append(mm.malloc((i % 7 + 1) * 100_000))
        if i % 3 == 0:
            live.pop(0).free()
    for b in live:
        b.free()
    rec.stop()
    rec.write(tmp_path / "run.csv.gz")
    res = replay(tmp_path / "run.csv.gz", "sim:1GiB")
    res2 = replay(rec, "sim:1GiB")               # a recorder directly
    assert res.events == res2.events == 400
    assert res.peak_live_bytes == res2.peak_live_bytes == read_trace(
        tmp_path / "run.csv.gz").peak_live_bytes
    mm.close()


# --- replay ------------------------------------------------------------------------------------------------
def test_replay_demo_trace():
    data = read_trace(DEMO)
    res = replay(data)
    assert isinstance(res, ReplayResult)
    assert res.events == len(data) and res.num_allocs == data.n_allocs
    assert res.peak_live_bytes == data.peak_live_bytes
    assert res.peak_reserved_bytes >= res.peak_in_use_bytes >= res.peak_live_bytes
    assert res.reserved_live_ratio == pytest.approx(res.peak_reserved_bytes /
                                                    res.peak_live_bytes)
    assert 1.0 <= res.reserved_live_ratio < 1.5
    assert 0.5 < res.hit_rate <= 1.0 and res.pool_hits + res.pool_misses == data.n_allocs
    assert res.segments_created >= res.segments_peak == res.segments > 0
    assert res.num_ooms == 0 and res.cpu_fallbacks == 0 and res.skipped_frees == 0
    assert res.events_per_second > 0 and res.duration_s > 0
    assert res.capacity == 80 << 30 and res.device == "sim(80.00 GiB)"
    d = res.as_dict()
    assert d["events"] == res.events and "series" not in d and "snapshot" not in d
    text = str(res)
    assert "reserved/live" in text and "hit rate" in text


def test_replay_series_and_snapshot():
    data = read_trace(DEMO)
    res = replay(data, record_series=True, snapshot_at="peak")
    live, reserved = res.series["live"], res.series["reserved"]
    assert len(live) == len(reserved) == len(data)
    assert np.array_equal(live, data.live_bytes())
    assert np.all(reserved >= live)
    assert reserved.max() == res.peak_reserved_bytes
    snap = res.snapshot
    assert snap["event_index"] == data.peak_index and snap["trace"] == data.name
    allocated = sum(b["requested"] for s in snap["segments"] for b in s["blocks"]
                    if b["state"] == "allocated")
    assert allocated == data.peak_live_bytes
    with pytest.raises(InvalidInputError):
        replay(data, snapshot_at=10 ** 9)


def test_replay_too_small_device_counts_ooms(caplog):
    data = read_trace(DEMO)
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        res = replay(data, "sim:512MiB")
    assert res.num_ooms > 0 and res.failed_bytes > 0
    assert res.skipped_frees == res.num_ooms      # the free of a failed alloc is skipped
    assert res.peak_reserved_bytes <= 512 * MiB
    assert "OUT OF MEMORY" in str(res)
    oom_lines = [r for r in caplog.records if "out of memory" in r.getMessage()]
    assert 1 <= len(oom_lines) <= 2, "one OOM warning, then a summary"
    assert any("not shown" in r.getMessage() for r in caplog.records)
    with pytest.raises(OutOfMemoryError):
        replay(data, "sim:512MiB", stop_on_oom=True)


def test_replay_leaves_sim_registry_alone():
    before = gpumem_sim.installed()
    replay(read_trace(DEMO).head(200), "sim:1GiB")
    assert gpumem_sim.installed() == before


def test_replay_on_registry_device_and_device_object():
    dev = gpumem_sim.SimDevice("8GiB")
    with gpumem_sim.using(dev):
        res = replay(read_trace(DEMO).head(300), "sim:0")
        assert res.device == "sim:0"
    assert dev.live_segments == 0                  # everything returned to the device
    other = gpumem_sim.SimDevice("8GiB")
    res = replay(read_trace(DEMO).head(300), other)
    assert res.events > 0 and other.live_segments == 0


def test_replay_bad_arguments(tmp_path):
    with pytest.raises(InvalidDeviceError):
        replay(DEMO, "nodevice:0")
    with pytest.raises(InvalidInputError):
        replay(DEMO, 3.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="unknown config"):
        replay(DEMO, config="fastest")
    with pytest.raises(InvalidInputError, match="capacity"):
        open_replay_device("sim:12parsecs")


def test_replay_config_presets():
    """real: a replay's preset is the same config as gpumem tune's row of that preset (issue 41:
    `replay --config default` dropped the free margin that tune's MemoryConfig.default() row
    keeps, and gave 8 OOMs where the row gave 11): the preset's own limits, CPU fallback and
    tracking off."""
    from gpumem.planning.tune import Candidate
    for name in ("default", "inference", "constrained"):
        cfg = replay_config(name, environ={})
        assert cfg == Candidate("gpumem", name).memory_config()
        assert cfg.cpu_fallback_enabled is False and cfg.track_allocations is False
    assert replay_config("default", environ={}).min_free_bytes == MemoryConfig().min_free_bytes
    custom = MemoryConfig(max_split_size=64 * MiB)
    assert replay_config(custom) is custom
    res = replay(read_trace(DEMO).head(500), config="constrained")
    assert res.config["max_split_size"] == 64 * MiB


def test_replay_progress_callback(capsys):
    calls = []
    data = read_trace(DEMO)
    replay(data, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (len(data), len(data))
    assert all(t == len(data) for _, t in calls)
    replay(data.head(100), progress=True)            # tqdm or stderr; must not fail


def test_replay_frees_buffers_left_live():
    dev = gpumem_sim.SimDevice("1GiB")
    from gpumem.observe.trace import TraceData
    t = TraceData(np.arange(3), np.array([OP_ALLOC] * 3, dtype=np.uint8), np.arange(3),
                  np.array([MiB, 2 * MiB, 3 * MiB]))
    res = replay(t, dev)
    assert res.peak_live_bytes == 6 * MiB
    assert dev.live_segments == 0


def test_replay_shared_phase():
    res = replay(SHARED / "gpt2_train.csv.gz", phase="step1")
    assert res.trace == "gpt2_train.csv.gz[step1]"
    assert res.num_ooms == 0 and res.skipped_frees == 0
    assert res.peak_live_bytes == read_trace(SHARED / "gpt2_train.csv.gz").peak_live_bytes


@pytest.mark.parametrize("name", ["resnet50_train", "bert_varlen_infer", "gpt2_train",
                                  "gpt2_generate"])
def test_replay_shared_traces(name):
    res = replay(SHARED / f"{name}.csv.gz", "sim:80GiB")
    assert res.num_ooms == 0
    # loose regression bound; the figures themselves are in docs/seeing_memory.md
    assert 1.0 <= res.reserved_live_ratio < 1.5
    assert res.hit_rate > 0.9


def test_module_is_callable():
    import gpumem
    import gpumem.observe.replay as replay_module
    res = gpumem.replay(read_trace(DEMO).head(100), "sim:1GiB")
    assert isinstance(res, replay_module.ReplayResult)
    assert replay_module.replay is replay


def test_recording_keeps_only_tags_and_addresses():
    """real (sim): recording registers no observer; per buffer it keeps the tag of a tagged
    one (a dict) and the address (a C log), so the events of a freed buffer still carry its
    address (export_memory_viz needs it). Stopping drops both."""
    mm = _mm()
    rec = mm.record_history(max_entries=1000)
    plain = mm.malloc(MiB)
    p = plain.ptr
    tagged = mm.malloc(512, tag="t")
    assert mm._tags == {tagged.id: "t"} and not mm._hooks
    plain.free(), tagged.free()
    ev = rec.events()
    assert [(e.op, e.ptr, e.tag) for e in ev[:1]] == [("a", p, None)]
    assert ev[2].op == "f" and ev[2].ptr == 0 and ev[3].tag == "t"
    rec.stop()
    assert mm._tags is None and mm._addresses() == {}
    assert len(rec.events()) == 4                  # kept after stop
    mm.close()


def test_two_recorders_and_clear():
    """real (sim): recorders started at different points each see the events since their
    own start; clear() restarts one without touching the other."""
    mm = _mm()
    first = mm.record_history()
    mm.malloc(100).free()
    second = mm.record_history()
    mm.malloc(200).free()
    assert len(first) == 4 and len(second) == 2
    first.clear()
    mm.malloc(300).free()
    assert [e.size for e in first.events()] == [300, 300]
    assert [e.size for e in second.events()] == [200, 200, 300, 300]
    first.stop(), second.stop()
    mm.close()


def test_history_grown_for_a_recorder_and_given_back():
    """real (sim): a recorder asking for more events than the pool's history keeps grows it
    while it runs; the last recorder to stop gives the pool its own size back."""
    mm = _mm()
    own = mm.pool.history_capacity
    rec = mm.record_history(max_entries=4 * own)
    assert mm.pool.history_capacity >= 4 * own
    rec.stop()
    assert mm.pool.history_capacity == own
    mm.close()


def test_close_stops_recorders_and_keeps_their_events():
    """real (sim): closing the manager stops its recorders; their events stay readable."""
    mm = _mm()
    rec = mm.record_history()
    mm.malloc(100).free()
    mm.close()
    assert rec.stopped and [e.op for e in rec.events()] == ["a", "f"]
