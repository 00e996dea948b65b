"""AllocationTracker: live buffers, ages, sizes, leak reports, no references kept."""
from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest

from gpumem.observe import tracking
from gpumem.errors import InvalidInputError
from gpumem.manager.memory_manager import MemoryManager
from gpumem.observe.tracking import AllocationTracker, BufferMetadata
from invariants import sim_manager

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def _manager(capacity: str = "1GiB", **cfg) -> MemoryManager:
    """A tracking manager (min_free_bytes 0, other settings default) on an uninstalled device."""
    base = dict(track_allocations=True, min_free_bytes=0)
    return sim_manager(capacity, install=False, base=base, **cfg)[1]


def test_tracking_off_registers_nothing():
    mm = _manager(track_allocations=False)
    assert mm.tracker is None and mm._hooks is False
    with pytest.raises(InvalidInputError, match="track_allocations"):
        mm.check_leaks()
    mm.close()


def test_count_total_live_and_metadata():
    mm = _manager()
    t = mm.tracker
    a = mm.malloc(3 * MiB, tag="weights")
    b = mm.malloc(100, tag=("act", 1))
    assert t.count() == len(t) == 2
    assert t.total_bytes() == 3 * MiB + 100
    m = t.get(a.id)
    assert isinstance(m, BufferMetadata)
    assert (m.id, m.nbytes, m.elements, m.tag, m.location) == (a.id, 3 * MiB, 3 * MiB,
                                                               "weights", "device")
    assert m.stack is None and "track_stacks" in m.where
    assert [x.id for x in t.live()] == [a.id, b.id]
    with pytest.raises(Exception):
        m.nbytes = 5          # frozen
    b.free()
    assert t.count() == 1 and t.total_bytes() == 3 * MiB
    assert t.peak_bytes == 3 * MiB + 100
    assert t.total_allocs == 2 and t.total_frees == 1
    a.free()
    assert t.check_leaks() == [] and mm.check_leaks() == []
    mm.close()


def test_find_old_allocations(monkeypatch):
    """real (sim): a buffer's creation time is its allocation event in the pool's C history
    (the history clock: CLOCK_MONOTONIC sampled every ~1 ms, time.monotonic()'s scale); the tracker's "now" is then faked
    so that the ages are large and exact."""
    mm = _manager()
    old = mm.malloc(1024, tag="old")
    time.sleep(0.05)                        # more than a history clock tick (~1 ms)
    new = mm.malloc(1024, tag="new")
    t_old = mm.tracker.get(old.id).created_at
    t_new = mm.tracker.get(new.id).created_at
    assert 0.04 <= t_new - t_old < 5 and abs(t_new - time.monotonic()) < 5
    clock = [t_new + 10]

    class FakeTime:
        @staticmethod
        def monotonic():
            return clock[0]

        @staticmethod
        def time():
            return 1.7e9 + clock[0]

    monkeypatch.setattr(tracking, "time", FakeTime)
    assert [m.tag for m in mm.tracker.find_old_allocations(10.03)] == ["old"]
    assert [m.tag for m in mm.tracker.find_old_allocations(0)] == ["old", "new"]
    assert mm.tracker.find_old_allocations(100) == []
    assert mm.tracker.get(old.id).age() == pytest.approx(10 + t_new - t_old)
    assert mm.tracker.get(old.id).exact_age
    with pytest.raises(InvalidInputError):
        mm.tracker.find_old_allocations(-1)
    del old, new
    mm.close()


def test_get_large_allocations():
    mm = _manager()
    bufs = [mm.malloc(s, tag=s) for s in (10, 2 * MiB, 5 * MiB, MiB)]
    assert [m.nbytes for m in mm.tracker.get_large_allocations("1MiB")] == [5 * MiB, 2 * MiB,
                                                                            MiB]
    assert [m.nbytes for m in mm.tracker.get_large_allocations(3 * MiB)] == [5 * MiB]
    assert mm.tracker.by_tag()[10] == (1, 10)
    for b in bufs:
        b.free()
    mm.close()


def test_no_reference_kept_buffer_collected_and_untracked():
    mm = _manager()
    buf = mm.malloc(4 * MiB, tag="temp")
    ref = weakref.ref(buf)
    assert mm.tracker.count() == 1
    del buf
    gc.collect()
    assert ref() is None, "the tracker (or someone) kept the buffer alive"
    assert mm.tracker.count() == 0
    assert mm.stats().in_use_bytes == 0
    mm.close()


def test_tracker_does_not_keep_manager_alive():
    mm = _manager()
    tracker = mm.tracker
    ref = weakref.ref(mm)
    del mm
    gc.collect()
    assert ref() is None
    assert tracker.manager is None


def test_fallback_buffers_tracked_apart():
    mm = _manager("1GiB", cpu_fallback_enabled=True, gpu_memory_fraction=0.9)   # a hard cap
    dev = mm.malloc(MiB, tag="dev")
    fb = mm.malloc(950 * MiB, tag="spill")      # above the user's 0.9 GiB: CPU fallback
    assert fb.location == "cpu"
    locs = sorted(m.location for m in mm.tracker.live())
    assert locs == ["cpu", "device"]
    assert mm.tracker.get(fb.id, "cpu").tag == "spill"
    fb.free()
    assert [m.tag for m in mm.tracker.live()] == ["dev"]
    dev.free()
    mm.close()


def test_report_leaks_logs_tag_size_and_where(caplog):
    mm = _manager(track_stacks=True)
    keep = mm.malloc(7 * MiB, tag="forgotten")
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        text = mm.tracker.report_leaks(at="checkpoint")
    assert "1 buffer(s) still live" in text and "checkpoint" in text
    assert "forgotten" in text and "7.00 MiB" in text
    assert "test_tracking.py" in text                 # where it was created (stacks on)
    assert any(r.levelno == logging.WARNING and "forgotten" in r.getMessage()
               for r in caplog.records)
    meta = mm.tracker.check_leaks()[0]
    assert meta.stack and meta.stack[0].startswith(__file__) and "in test_report" in meta.stack[0]
    keep.free()
    assert mm.tracker.report_leaks() == ""
    mm.close()


def test_close_reports_leaks(caplog):
    mm = _manager()
    keep = mm.malloc(MiB, tag="still-here")
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        mm.close()
    assert any("still-here" in r.getMessage() and "close()" in r.getMessage()
               for r in caplog.records)
    del keep


def test_report_is_limited():
    t = AllocationTracker()

    class FakeBuf:
        def __init__(self, i):
            self.id, self.nbytes, self.tag = i, 100 + i, None
            self.location, self.device, self.stream = "device", "sim:0", 0

    for i in range(tracking.REPORT_LIMIT + 5):
        t.on_alloc(FakeBuf(i))
    text = t.format_report()
    assert "... and 5 more" in text
    assert text.count("\n  buffer ") == tracking.REPORT_LIMIT
    t.clear()
    assert t.count() == 0


def test_report_at_interpreter_exit():
    script = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        import gpumem, gpumem_sim
        from gpumem.config import MemoryConfig
        mm = gpumem.MemoryManager(gpumem_sim.SimDevice("1GiB"),
                                  MemoryConfig(track_allocations=True, min_free_bytes=0))
        buf = mm.malloc(3 << 20, tag="leaky")
        closed = gpumem.MemoryManager(gpumem_sim.SimDevice("1GiB"),
                                      MemoryConfig(track_allocations=True, min_free_bytes=0))
        b2 = closed.malloc(1 << 20, tag="closed-one")
        closed.close()
        print("done")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "interpreter exit" in r.stderr and "leaky" in r.stderr
    # the closed manager reported at close(), not again at exit
    assert r.stderr.count("closed-one") == 1


def test_fragmentation_warning(caplog):
    """real (sim): a miss that needs a new segment while the cache holds enough bytes in
    smaller holes logs one fragmentation WARNING (manager._check_fragmentation)."""
    mm = _manager("4GiB", track_allocations=False, max_pooled_per_bucket=64,
                  release_before_grow=False)
    # fill 20 MiB segments with 4 MiB blocks, free every other one: 8 MiB+ cached in 4 MiB holes
    bufs = [mm.malloc(4 * MiB) for _ in range(40)]
    for b in bufs[::2]:
        b.free()
    with caplog.at_level(logging.WARNING, logger="gpumem"):
        big = mm.malloc(12 * MiB)
    assert any("fragment" in r.getMessage() for r in caplog.records)
    big.free()
    mm.close()


# --- the tracker reads the pool (stacks off) ---------------------------------------------------------
def test_stacks_off_keeps_no_python_state_per_untagged_buffer():
    """real (sim): with stacks off the tracker is no observer (the alloc and free paths call
    no Python); the only per-buffer state is the tag of a tagged buffer, and the figures
    (live buffers, bytes, counts, stream) come from the pool's live blocks and counters."""
    mm = _manager()
    t = mm.tracker
    assert t.reads_pool and not mm._hooks and not mm._observers
    s = mm.device.create_stream()
    plain = [mm.malloc(1000 + i) for i in range(5)]
    tagged = mm.malloc(2 * MiB, tag="kv", stream=s)
    assert mm._tags == {tagged.id: "kv"}
    assert t.count() == 6 and t.total_bytes() == sum(1000 + i for i in range(5)) + 2 * MiB
    m = t.get(tagged.id)
    assert (m.nbytes, m.tag, m.stream, m.device, m.location) == (2 * MiB, "kv", s,
                                                                  mm.device_string, "device")
    assert [x.id for x in t.live()] == [b.id for b in plain] + [tagged.id]
    for b in plain:
        b.free()
    assert [x.tag for x in t.check_leaks()] == ["kv"] and t.total_frees == 5
    tagged.free()
    assert t.check_leaks() == [] and t.total_allocs == 6
    mm.close()


def test_a_free_waiting_for_another_stream_is_not_live():
    """real (sim): a buffer freed while another stream uses it (record_stream) is gone for
    the tracker at free(), though the pool keeps its block until the stream passes."""
    mm = _manager()
    s = mm.device.create_stream()
    buf = mm.malloc(MiB, tag="shared")
    buf.record_stream(s)
    buf.free()
    assert mm.pending_free_count == 1
    assert mm.tracker.count() == 0 and mm.tracker.check_leaks() == []
    mm.collect_pending_frees(wait=True)
    mm.close()


def test_age_of_a_buffer_older_than_the_history():
    """real (sim): a buffer whose allocation event has left the pool's history is still
    reported, with the oldest time the history holds as a lower bound ("age >= "); once
    learnt, that time stays the buffer's."""
    mm = _manager()
    mm.pool.set_history(4)
    keep = mm.malloc(MiB, tag="old")
    for _ in range(8):
        mm.malloc(100).free()
    m = mm.tracker.get(keep.id)
    assert m is not None and m.tag == "old" and not m.exact_age
    assert "age >= " in m.describe()
    for _ in range(8):
        mm.malloc(100).free()
    assert mm.tracker.get(keep.id).created_at == m.created_at
    keep.free()
    mm.close()


def test_peak_bytes_replayed_from_the_history():
    """real (sim): peak_bytes (requested bytes) is replayed from the history's events since
    the last read; when some have left the history the level comes from the pool's
    requested-bytes counter."""
    mm = _manager()
    t = mm.tracker
    a = mm.malloc(5 * MiB)
    a.free()
    assert t.peak_bytes == 5 * MiB
    b, c = mm.malloc(MiB), mm.malloc(2 * MiB)
    b.free(), c.free()
    assert t.peak_bytes == 5 * MiB
    d = mm.malloc(7 * MiB + 3)
    d.free()
    assert t.peak_bytes == 7 * MiB + 3
    mm.pool.set_history(4)
    x, y = mm.malloc(9 * MiB), mm.malloc(MiB)
    for _ in range(10):
        mm.malloc(100).free()
    assert t.peak_bytes == 10 * MiB + 100            # the two big allocs left the history
    x.free(), y.free()
    mm.close()


def test_clear_forgets_the_buffers_live_now_only():
    """real (sim): clear() (the plug-ins call it after reporting) hides the buffers live now
    from later reports; buffers allocated after it are reported."""
    mm = _manager()
    a = mm.malloc(100, tag="a")
    mm.tracker.clear()
    assert mm.tracker.count() == 0 and mm.tracker.check_leaks() == []
    b = mm.malloc(200, tag="b")
    assert [m.tag for m in mm.tracker.live()] == ["b"] and mm.tracker.count() == 1
    a.free(), b.free()
    mm.close()


def test_stale_tags_are_pruned():
    """real (sim): the tags of freed buffers are dropped once the dict outgrows its limit;
    the tags of live buffers stay."""
    mm = _manager()
    keep = mm.malloc(100, tag="keep")
    for i in range(10_000):
        mm.malloc(100, tag=i).free()
    assert len(mm._tags) <= mm._tags_limit < 10_000
    assert mm._tags[keep.id] == "keep" and mm.tracker.get(keep.id).tag == "keep"
    keep.free()
    mm.close()


def test_a_tracker_registered_by_hand_counts_each_buffer_once():
    """real (sim): a stacks-off tracker built on a manager and also added as an observer
    ignores the callbacks (the pool already knows the buffer): no buffer is counted twice."""
    mm = _manager(track_allocations=False)
    t = AllocationTracker(mm)
    mm.add_observer(t)
    b = mm.malloc(100, tag="x")
    assert t.count() == 1 and [m.id for m in t.live()] == [b.id]
    b.free()
    assert t.count() == 0
    mm.remove_observer(t)
    mm.close()
