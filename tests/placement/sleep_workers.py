"""Process bodies for tests/placement/test_sleep_shared.py (spawn context: importable by name).

The RL colocate pattern on one shared sim card: a *sleeper* (the inference engine) whose tagged
memory sleeps while a *trainer* uses the card, then wakes through the group's hand-back. Every
wait has a timeout, so a broken run fails instead of hanging; the release-request wait is widened
(``shared_budget.REPLY_WAIT``): the tests assert what happens, never how fast.
"""
from __future__ import annotations

import os
import traceback

from shared_workers import MiB, TIMEOUT, shared_config


def sleeper(card: str, group: str, shared_dir: str, weights: int, kv: int, slept, trained,
            done, results) -> None:
    """Hold ``weights`` bytes in tag "weights" and ``kv`` in tag "kv", sleep both, say so on
    ``slept``, wait for ``trained``, wake both. Puts ``("sleeper", released, mapped, same
    addresses, error text)`` on ``results``."""
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    released = mapped = 0
    same, error = False, ""
    try:
        from gpumem import MemoryManager
        from gpumem.placement import shared_budget
        shared_budget.REPLY_WAIT = 5.0
        mm = MemoryManager(card, shared_config(group))
        with mm.region("weights"):
            w = [mm.malloc(weights // 4) for _ in range(4)]
        with mm.region("kv"):
            k = mm.malloc(kv)
        ptrs = [b.ptr for b in w + [k]]
        released = mm.sleep(["weights", "kv"], backup=False)
        slept.set()
        if not trained.wait(TIMEOUT):
            raise TimeoutError("the trainer did not finish")
        mapped = mm.wake()
        same = [b.ptr for b in w + [k]] == ptrs
        for b in w + [k]:
            b.memset(1)                   # mapped again: usable
            b.free()
        mm.close()
    except Exception:
        error = traceback.format_exc()
        slept.set()
    finally:
        done.set()
    results.put(("sleeper", released, mapped, same, error))


def trainer(card: str, group: str, shared_dir: str, nbytes: int, slept, trained, done,
            results) -> None:
    """Once the sleeper slept: take ``nbytes`` and free them (they stay cached), say so on
    ``trained``, and stay in the group (its watcher answers the sleeper's hand-back request)
    until ``done``. Puts ``("trainer", got, cached after, error text)`` on ``results``."""
    os.environ["GPUMEM_SHARED_DIR"] = shared_dir
    got, cached, error = 0, -1, ""
    try:
        from gpumem import MemoryManager
        mm = MemoryManager(card, shared_config(group))
        if not slept.wait(TIMEOUT):
            raise TimeoutError("the sleeper did not sleep")
        buf = mm.malloc(nbytes)
        got = buf.nbytes
        buf.free()                        # cached: the sleeper's wake must ask for it
        trained.set()
        done.wait(TIMEOUT)
        cached = mm.stats().cached_bytes
        mm.close()
    except Exception:
        error = traceback.format_exc()
        trained.set()
    results.put(("trainer", got, cached, error))


__all__ = ["sleeper", "trainer", "MiB"]
