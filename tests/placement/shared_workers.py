"""Process bodies for tests/placement/test_shared_budget.py and asv_benchmarks/shared_budget.py,
started with multiprocessing's spawn context (importable by name in the child).

Every wait here has a timeout, so a broken run fails instead of hanging. The release-request
wait of the requesting member is widened (``shared_budget.REPLY_WAIT``): the tests assert what
happens, never how fast, and the test machine may be loaded.
"""
from __future__ import annotations

import os
import time
import traceback

MiB = 1 << 20
TIMEOUT = 60.0


def shared_config(group: str, hand_back: bool = True, budget: object = 1.0):
    from gpumem import MemoryConfig
    return MemoryConfig(shared_group=group, shared_budget=budget, shared_hand_back=hand_back,
                        min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False,
                        track_allocations=False, pressure_thresholds=(0.97, 0.98, 0.99))


def alternating_peaks(index: int, count: int, card: str, group: str, hand_back: bool,
                      base: int, peak: int, barrier, results, shared_dir: str) -> None:
    """One of ``count`` processes on one shared sim card: each holds ``base`` bytes all along
    and, in its own round, ``peak`` bytes more that it then frees (they stay cached). Puts
    ``(index, out-of-memory count, error text)`` on ``results``."""
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    ooms, error = 0, ""
    try:
        from gpumem import MemoryManager
        from gpumem.errors import OutOfMemoryError
        from gpumem.placement import shared_budget
        shared_budget.REPLY_WAIT = 5.0           # generous: the machine may be loaded
        mm = MemoryManager(card, shared_config(group, hand_back))
        held = mm.malloc(base)
        barrier.wait(TIMEOUT)
        for round_ in range(count):
            if round_ == index:
                try:
                    big = mm.malloc(peak)
                    big.free()                    # cached from now on
                except OutOfMemoryError:
                    ooms += 1
            barrier.wait(TIMEOUT)                 # the others sit here, their watchers awake
        held.free()
        barrier.wait(TIMEOUT)
        mm.close()
    except Exception:
        error = traceback.format_exc()
        barrier.abort()
    results.put((index, ooms, error))


def hold_and_spin(card: str, group: str, nbytes: int, cached: bool, ready, stop,
                  shared_dir: str, budget: object = 1.0, chunk: int = 0) -> None:
    """Take ``nbytes`` (in segments of ``chunk`` bytes each if given: plain segments), free them
    into the cache if ``cached``, say so on ``ready``, then spin in a pure-Python loop (the GIL
    held but for the interpreter's switches) until ``stop``."""
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    from gpumem import MemoryManager
    cfg = shared_config(group, budget=budget)
    if chunk:
        cfg = cfg.replace(expandable_segments=False)
    mm = MemoryManager(card, cfg)
    bufs = [mm.malloc(chunk) for _ in range(nbytes // chunk)] if chunk else [mm.malloc(nbytes)]
    if cached:
        for buf in bufs:
            buf.free()
    ready.set()
    deadline = time.monotonic() + TIMEOUT
    n = 0
    while not stop.is_set() and time.monotonic() < deadline:
        for _ in range(1_000_000):                # pure Python, tens of ms between the checks
            n += 1
    mm.close()


def fork_then_die_holding_lock(card: str, group: str, nbytes: int, conn,
                               shared_dir: str) -> None:
    """A member that holds ``nbytes`` live, forks a child that sleeps (as a DataLoader worker
    would), sends the child's pid on ``conn``, then is SIGKILLed while it holds the ledger's
    lock."""
    import signal
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    from gpumem import MemoryManager
    mm = MemoryManager(card, shared_config(group))
    mm.malloc(nbytes)
    child = os.fork()
    if child == 0:
        time.sleep(TIMEOUT)
        os._exit(0)
    conn.send(child)
    with mm._growth.shared._ledger.locked():
        os.kill(os.getpid(), signal.SIGKILL)


def exec_after_join(card: str, group: str, nbytes: int, ready, shared_dir: str) -> None:
    """A member that holds ``nbytes`` live, says so on ``ready``, then execs another program
    (a Python that sleeps): same pid, same start time, no gpumem."""
    import sys
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    from gpumem import MemoryManager
    mm = MemoryManager(card, shared_config(group))
    mm.malloc(nbytes)
    ready.set()
    os.execv(sys.executable, [sys.executable, "-c", f"import time; time.sleep({TIMEOUT})"])


def hold_with_late_watcher(card: str, group: str, nbytes: int, delay: float, ready, stop,
                           shared_dir: str) -> None:
    """Cache ``nbytes``, then wait for ``stop``; the watcher gets to each request ``delay``
    seconds late (what a loaded machine does to a runnable thread waiting for a core or the
    GIL), the process running all along."""
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    from gpumem import MemoryManager
    from gpumem.placement import shared_budget
    answer = shared_budget.SharedBudget.answer

    def late_answer(self):
        time.sleep(delay)
        return answer(self)
    shared_budget.SharedBudget.answer = late_answer
    mm = MemoryManager(card, shared_config(group))
    mm.malloc(nbytes).free()
    ready.set()
    stop.wait(TIMEOUT)
    mm.close()


def walker(card: str, group: str, policy: str, seed: int, conn, shared_dir: str,
           budget: object) -> None:
    """One member of a random walk: on ("walk", steps) it makes ``steps`` random mallocs and
    frees (1 to 40 MiB, out-of-memory counted) and answers ("done", ooms); on ("check",) it
    answers, under its manager's lock, (its slot's reserved, its pool's reserved + held pages,
    its card slot's bytes, its device's live bytes); on ("quit",) it closes and ends."""
    import random
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    from gpumem import MemoryManager
    from gpumem.errors import OutOfMemoryError
    rng = random.Random(seed)
    mm = MemoryManager(card, shared_config(group, budget=budget).replace(segments=policy))
    shared, growth = mm._growth.shared, mm._growth
    live = []
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        if msg[0] == "walk":
            ooms = 0
            for _ in range(msg[1]):
                if live and (len(live) > 8 or rng.random() < 0.45):
                    live.pop(rng.randrange(len(live))).free()
                    continue
                try:
                    live.append(mm.malloc(rng.randint(1, 40) * MiB))
                except OutOfMemoryError:
                    ooms += 1
            conn.send(("done", ooms))
        elif msg[0] == "check":
            with growth.lock:
                held = growth.expandable.held_bytes if growth.expandable else 0
                with shared._ledger.locked() as ledger:
                    slot = ledger.slot(shared._index).reserved
                    card_slot = ledger.slot(shared._card._index).card_bytes
                conn.send(("check", slot, mm.pool.reserved_bytes + held, card_slot,
                           mm.device.live_bytes))
        else:
            for buf in live:
                buf.free()
            mm.close()
            conn.send(("bye",))
            return
