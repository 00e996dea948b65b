"""The pool's C lock never waits on Python (issue 9, bug 1). Level: **real** (CPython's cyclic GC,
threads and the real Cython pool on the simulated device).

Rule under test: while the pool lock is held no Python object is created and no Python code runs,
so the cyclic GC cannot run a finalizer there; and a thread holding the GIL never spins on the
lock (it tries the lock, else releases the GIL and waits). Each scenario runs in a child process
with a timeout, because the failure mode is a hang: a child that does not finish in time fails
the test instead of hanging the suite.

The garbage is set up so that a collection of an *older* generation is due while the pool builds
its results: the cycles sit in generation 1 and the GC thresholds are low, so the thousands of
dicts a snapshot of 1,000+ buffers creates trigger that collection inside the introspection
call. Before the fix that collection ran under the lock (same thread: Buffer.__dealloc__ ->
gm_free spun on the lock it held; two threads: a finalizer that sleeps let another thread spin
on the lock while holding the GIL).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TIMEOUT_S = 60          # a healthy run takes well under a second; a hang never ends

PRELUDE = textwrap.dedent("""
    import gc, sys, threading, time
    import gpumem_sim
    from gpumem import MemoryConfig, MemoryManager

    gpumem_sim.install(gpumem_sim.SimDevice("4GiB"))
    mm = MemoryManager("sim:0", MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                                             cpu_fallback_enabled=False))
    live = [mm.malloc(4096 + 512 * (i % 7)) for i in range(1500)]

    class Holder:
        # cyclic garbage that holds a buffer (refers to itself)
        def __init__(self, buf):
            self.me = self
            self.buf = buf

    gc.freeze()                 # everything so far out of the way: collections are cheap

    def make_old_garbage(n, cls=Holder):
        # n cycles holding buffers, garbage in generation 1, with a gen-1 collection due
        # within ~2 x 20 allocations of GC objects (the pool's results make thousands)
        gc.set_threshold(100000, 1, 1)
        holders = [cls(mm.malloc(8192)) for _ in range(n)]
        gc.collect(0)           # they survive (still referenced): now in generation 1
        del holders[:]          # ... and garbage from here on
        gc.set_threshold(20, 1, 1)
""")

SAME_THREAD = PRELUDE + textwrap.dedent("""
    make_old_garbage(200)
    before = mm.pool.counters()["active_blocks"]
    for call in (mm.pool.segments, mm.snapshot, lambda: mm.pool.counters(consistent=True),
                 mm.pool.check_invariants, mm.stats, mm.pool.live_segment_handles,
                 mm.empty_cache):
        call()
        make_old_garbage(200)
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    gc.collect()
    after = mm.pool.counters()["active_blocks"]
    assert after == len(live), (before, after, len(live))
    mm.pool.check_invariants()
    print("OK", before, after)
""")

TWO_THREADS = PRELUDE + textwrap.dedent("""
    class SleepyHolder(Holder):
        def __del__(self):          # lets the GIL go, as logging or I/O in a finalizer does
            time.sleep(0.002)

    stop = threading.Event()
    done = [0]

    def allocate():
        while not stop.is_set():
            mm.free(mm.malloc(4096))
            done[0] += 1

    t = threading.Thread(target=allocate, daemon=True)
    t.start()
    for _ in range(5):
        make_old_garbage(50, SleepyHolder)
        mm.pool.segments()
        mm.snapshot()
        mm.pool.counters(consistent=True)
        mm.pool.check_invariants()
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert done[0] > 0
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    gc.collect()
    mm.pool.check_invariants()
    assert mm.pool.counters()["active_blocks"] == len(live)
    print("OK", done[0])
""")


def _run(script: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        hung = True             # (failing outside the handler keeps the report short)
    if hung:
        pytest.fail(f"hung for {TIMEOUT_S} s: the pool lock waited on Python (a GC pass or a "
                    f"finalizer ran while it was held)")


def test_introspection_with_old_cyclic_garbage_holding_buffers_does_not_hang():
    """segments(), snapshot(), counters(consistent=True), check_invariants(), stats(),
    live_segment_handles() and empty_cache() with 1,500 live buffers and generation-2 cyclic
    garbage that holds buffers: each finishes, and the garbage's buffers return to the pool."""
    r = _run(SAME_THREAD)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr


def test_second_thread_allocating_while_a_sleeping_finalizer_runs_does_not_hang():
    """A thread allocating in a loop while the main thread takes snapshots and garbage whose
    __del__ sleeps (releasing the GIL) is collected: both make progress and the pool stays
    consistent."""
    r = _run(TWO_THREADS)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
