"""A close() racing with threads that allocate and free (issue 39, point 8): a thread that was
already inside malloc or free when the manager closed gets a buffer or ClosedManagerError,
never an internal error about a segment handle it never saw, and no handle is lost.

The interleavings are forced with the manager's slow-path lock (held by the test while the
other thread reaches it) rather than left to luck; a short bounded stress runs the issue's
mix of allocating, reconfiguring and closing threads.

Level: real (the Cython pool and the manager on gpumem_sim).
"""
from __future__ import annotations

import random
import threading
import time
import warnings

import pytest

import gpumem
import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import ClosedManagerError, OutOfMemoryError
from gpumem.placement.shared import close_shared_managers

MiB = 1 << 20


@pytest.mark.parametrize("policy", ["plain", "auto"])
def test_free_that_trims_while_close_runs(policy):
    """A free() whose cache cap makes it trim waits for the slow-path lock while close() runs:
    it must not give the closed manager's segments back a second time (before the fix the
    driver said "unknown segment handle"); the free raises ClosedManagerError or returns, and
    the device holds nothing."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments=policy, cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0, max_pool_size=0))
    keep = mm.malloc(30 * MiB)
    buf = mm.malloc(30 * MiB)
    errors: list[BaseException] = []
    entered = threading.Event()
    real_trim = mm._miss.trim_cache

    def trim_entered():
        entered.set()            # the free reached its trim: the pool took the block back
        real_trim()              # ... and now waits for the slow-path lock
    mm._miss.trim_cache = trim_entered

    def free():
        try:
            buf.free()
        except ClosedManagerError:
            pass
        except BaseException as exc:
            errors.append(exc)
    with mm._slow:               # the test holds the lock: the trim waits for it
        t = threading.Thread(target=free)
        t.start()
        assert entered.wait(30), "the free never reached its trim"
        time.sleep(0.05)         # let it block on the lock (either order is correct)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mm.close()           # re-entrant: runs now, while the free waits
    t.join(30)
    assert not t.is_alive()
    assert not errors, f"free() raised {errors[0]!r} instead of returning or ClosedManagerError"
    assert (dev.live_bytes, dev.live_segments, dev.live_page_handles,
            dev.live_reservations) == (0, 0, 0, 0)
    del keep


def test_miss_waiting_for_the_lock_while_close_runs():
    """A malloc that missed and waits for the slow-path lock while close() runs gets
    ClosedManagerError, and nothing is left on the device."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments="auto", cpu_fallback_enabled=True,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0))
    got: list = []
    entered = threading.Event()
    real = mm._miss.malloc

    def miss(*args):
        entered.set()
        return real(*args)
    mm._miss.malloc = miss

    def alloc():
        try:
            got.append(mm.malloc(64 * MiB))
        except BaseException as exc:
            got.append(exc)
    with mm._slow:
        t = threading.Thread(target=alloc)
        t.start()
        assert entered.wait(30)
        time.sleep(0.05)
        mm.close()
    t.join(30)
    assert len(got) == 1 and isinstance(got[0], ClosedManagerError), got
    assert (dev.live_bytes, dev.live_page_handles, dev.live_reservations) == (0, 0, 0)


def test_close_racing_with_misses_stress(sim_device):
    """The issue's mix, bounded to a few seconds: six threads allocate and free through
    get_manager("sim:0") (a cache cap makes frees trim), two reconfigure it with force=True,
    one closes the shared managers: only buffers, ClosedManagerError and OutOfMemoryError are
    seen, and once all is closed the device holds nothing."""
    dev = sim_device("1GiB")
    knobs = dict(cpu_fallback_enabled=False, min_free_bytes=0, gpu_memory_fraction=1.0,
                 reserve_bytes=0, max_pool_size=16 * MiB)
    gpumem.configure("sim:0", force=True, **knobs)
    stop = time.monotonic() + 4.0
    errors: list[BaseException] = []

    def guarded(work):
        def run(i):
            try:
                work(i)
            except BaseException as exc:
                errors.append(exc)
        return run

    @guarded
    def allocate(i):
        rng = random.Random(i)
        live = []
        while time.monotonic() < stop:
            try:
                live.append(gpumem.get_manager("sim:0").malloc(
                    rng.choice([rng.randrange(1, MiB), rng.randrange(MiB, 48 * MiB)])))
                if len(live) > 4:
                    live.pop(rng.randrange(len(live))).free()
            except (ClosedManagerError, OutOfMemoryError):
                live.clear()

    @guarded
    def reconfigure(i):
        while time.monotonic() < stop:
            gpumem.configure("sim:0", force=True, **knobs)
            time.sleep(0.002)

    @guarded
    def closer(i):
        while time.monotonic() < stop:
            mm = gpumem.get_manager("sim:0")
            close_shared_managers()
            mm.close()
            time.sleep(0.005)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        threads = ([threading.Thread(target=allocate, args=(i,)) for i in range(6)]
                   + [threading.Thread(target=reconfigure, args=(i,)) for i in range(2)]
                   + [threading.Thread(target=closer, args=(0,))])
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        close_shared_managers()
    assert not any(t.is_alive() for t in threads)
    assert not errors, f"{len(errors)} unexpected error(s), first: {errors[0]!r}"
    assert (dev.live_bytes, dev.live_page_handles, dev.live_reservations) == (0, 0, 0)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no-fallback"])
def test_close_after_the_ladder_failed(fallback):
    """A miss whose ladder found no device memory, and a close() that runs as soon as the
    ladder drops the lock: the miss gets ClosedManagerError, not an OutOfMemoryError nor a
    FallbackBuffer from a closed manager (whose host manager would never be closed)."""
    dev = gpumem_sim.SimDevice("256MiB")
    mm = MemoryManager(dev, MemoryConfig(segments="auto", cpu_fallback_enabled=fallback,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0))
    hog = mm.malloc(200 * MiB)
    real = mm._miss.malloc_device

    def ladder_then_close(*args):
        buf = real(*args)                    # None: the device is full
        t = threading.Thread(target=mm.close)
        t.start()                            # the lock is free now: close() runs to the end
        t.join(30)
        assert mm.closed
        return buf
    mm._miss.malloc_device = ladder_then_close
    with pytest.raises(ClosedManagerError):
        mm.malloc(100 * MiB)
    assert mm.fallback_manager is None       # no host manager made after close()
    assert (dev.live_bytes, dev.live_page_handles, dev.live_reservations) == (0, 0, 0)
    del hog
