"""The pool's always-on C history and the OOM dump (issue 12, item 3). Level: **real** (the Cython
pool on the simulated device, numpy, the gpumem CLI in-process).

What a user relies on: the events are there without turning anything on, in order, bounded; an
OutOfMemoryError says what happened before it; and a dump written at the OOM is a trace that
`gpumem replay` replays and a snapshot that `gpumem snapshot --load` reads.
"""
from __future__ import annotations

import time

import pytest

import gpumem
import gpumem.observe.history
from gpumem import InvalidInputError, OutOfMemoryError
from gpumem.cli import main as cli_main
from gpumem.observe.trace import OP_ALLOC, OP_FREE, read_trace
from invariants import sim_manager

MiB = 1 << 20


def test_history_is_on_by_default_and_records_in_order():
    """alloc/free through the manager land in the pool's ring: ids, requested sizes, streams,
    frees after their allocations, times non-decreasing."""
    _, mm = sim_manager("1GiB")
    assert mm.pool.history_capacity >= 100_000
    s = mm.device.create_stream()
    a = mm.malloc(100)
    b = mm.malloc(3 * MiB, stream=s)          # a miss: a new segment (still recorded)
    a.free()
    b.free()
    h = mm.pool.history()
    assert h["op"].tolist() == [OP_ALLOC, OP_ALLOC, OP_FREE, OP_FREE]
    assert h["id"].tolist() == [a.id, b.id, a.id, b.id]
    assert h["size"].tolist() == [100, 3 * MiB, 100, 3 * MiB]
    assert h["stream"].tolist() == [0, s, 0, s]
    assert (h["t_ns"][1:] >= h["t_ns"][:-1]).all()
    assert mm.pool.history(last=1)["id"].tolist() == [b.id]
    mm.close()


def test_history_is_bounded_and_can_be_turned_off():
    """A ring of 8 keeps the newest 8 events; set_history(0) records nothing; bad sizes are
    refused with InvalidInputError and leave the history as it was."""
    _, mm = sim_manager("1GiB")
    mm.pool.set_history(8)
    ids = []
    for _ in range(10):
        buf = mm.malloc(4096)
        ids.append(buf.id)
        buf.free()
    h = mm.pool.history()
    assert len(h["id"]) == 8 and h["id"].tolist() == [i for i in ids[-4:] for _ in (0, 1)]
    for bad in (-1, 1.5, True, "8", 1 << 40):
        with pytest.raises(InvalidInputError):
            mm.pool.set_history(bad)
    assert mm.pool.history_capacity == 8
    mm.pool.set_history(0)
    mm.free(mm.malloc(4096))
    assert len(mm.pool.history()["id"]) == 0
    mm.close()


def _exhaust(mm):
    held = []
    with pytest.raises(OutOfMemoryError) as info:
        while True:
            held.append(mm.malloc(3 * MiB))
    return held, info.value


def test_out_of_memory_error_carries_the_recent_history():
    """The error's .history is a trace of the allocations that filled the device."""
    _, mm = sim_manager("16MiB", cpu_fallback_enabled=False)
    held, err = _exhaust(mm)
    tr = err.history
    assert tr is not None and tr.n_allocs == len(held) and tr.n_frees == 0
    assert tr.sizes.tolist() == [3 * MiB] * len(held)
    mm.close()


def _wait_for_the_history_clock_past(t_ns: int) -> None:
    """Until the next event records a time after `t_ns`: the ticker's reading is past it, or no
    ticker runs (events read the clock then). A fixed sleep was not enough on a loaded machine,
    where the ticker thread can wait for a CPU longer than any sleep chosen here."""
    from gpumem._core.pool import CachingPool
    deadline = time.monotonic() + 30
    while 0 < CachingPool.history_clock_ns() <= t_ns:
        assert time.monotonic() < deadline, "the history clock did not tick in 30 s"
        time.sleep(0.001)


def test_oom_history_is_built_on_first_access_and_stops_at_the_error(monkeypatch):
    """A program that catches OutOfMemoryError and retries pays no history copy per error (the
    soak at near-100 % pressure slowed ~10x when every error built it); read later, the
    history still ends at the error (to the rings' clock tick, a few ms), not at the
    allocations made since."""
    _, mm = sim_manager("16MiB", cpu_fallback_enabled=False)
    built = []
    real = gpumem.observe.history.pool_trace
    monkeypatch.setattr(gpumem.observe.history, "pool_trace", lambda *a, **k: built.append(1) or real(*a, **k))
    held, err = _exhaust(mm)
    for _ in range(5):
        with pytest.raises(OutOfMemoryError):
            mm.malloc(8 * MiB)
    assert built == []
    _wait_for_the_history_clock_past(time.monotonic_ns())
    held.pop().free()
    held.append(mm.malloc(3 * MiB))               # after the error: not in its history
    tr = err.history
    assert built == [1] and tr.n_allocs == len(held) and tr.n_frees == 0
    assert err.history is tr and built == [1]     # built once
    mm.close()


def test_dump_on_oom_writes_a_trace_replay_reads_and_a_snapshot(tmp_path, monkeypatch, capsys):
    """gpumem.dump_on_oom(dir): the OOM writes oom-*.csv.gz and oom-*.json; `gpumem replay`
    replays the trace and `gpumem snapshot --load` reads the snapshot."""
    monkeypatch.setattr(gpumem.observe.history, "_dump_set", False)
    gpumem.dump_on_oom(tmp_path)
    try:
        _, mm = sim_manager("16MiB", cpu_fallback_enabled=False)
        held, err = _exhaust(mm)
    finally:
        gpumem.dump_on_oom(None)
    trace_file, snap_file = err.dump_files
    tr = read_trace(trace_file)
    assert tr.n_allocs == len(held) and tr.ids.tolist() == list(range(len(held)))
    assert cli_main(["replay", trace_file, "--device", "sim:1GiB"]) == 0
    assert cli_main(["snapshot", "--load", snap_file]) == 0
    out = capsys.readouterr().out
    assert "16.0 MiB" in out or "segments" in out
    mm.close()


def test_gpumem_dump_on_oom_environment_variable(tmp_path, monkeypatch):
    """GPUMEM_DUMP_ON_OOM=DIR does the same without code; dump_on_oom(None) overrides it."""
    monkeypatch.setattr(gpumem.observe.history, "_dump_set", False)
    monkeypatch.setenv("GPUMEM_DUMP_ON_OOM", str(tmp_path / "dumps"))
    _, mm = sim_manager("16MiB", cpu_fallback_enabled=False)
    held, err = _exhaust(mm)
    assert err.dump_files and all(p.startswith(str(tmp_path / "dumps")) for p in err.dump_files)
    gpumem.dump_on_oom(None)
    for b in held:
        b.free()
    _, err2 = _exhaust(mm)
    assert err2.dump_files is None and err2.history is not None
    mm.close()
    with pytest.raises(InvalidInputError):
        gpumem.dump_on_oom("")
