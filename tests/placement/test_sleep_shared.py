"""Sleep and wake in a shared group: two processes on one simulated 2 GiB card (issue 40,
docs/sleep_and_wake.md, the RL colocate example).

Level: **real** (the real pool and managers on gpumem_sim devices sharing one card through the
group's ledger, real processes started with multiprocessing's spawn context). Every join and
wait has a timeout, so a broken run fails instead of hanging; nothing asserts a time.
"""
from __future__ import annotations

import multiprocessing
import shutil
import tempfile

import pytest

import sleep_workers
from shared_workers import MiB

JOIN = 120.0
CARD = "sim:2GiB"


@pytest.fixture
def shared_dir(monkeypatch):
    path = tempfile.mkdtemp(prefix="gmsl", dir="/tmp")
    monkeypatch.setenv("GPUMEM_SHARED_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sleepers_bytes_serve_the_trainer_and_wake_takes_them_back(shared_dir):
    """Real: the sleeper's 1.2 GiB sleeps; the trainer then takes 1.2 GiB of the 2 GiB card
    (which would not fit beside the sleeper's memory), frees it into its cache; the sleeper's
    wake gets it back through the hand-back, at the same addresses."""
    ctx = multiprocessing.get_context("spawn")
    slept, trained, done = ctx.Event(), ctx.Event(), ctx.Event()
    results = ctx.Queue()
    big = 1228 * MiB                                  # 1.2 GiB
    procs = [ctx.Process(target=sleep_workers.sleeper,
                         args=(CARD, "rl", shared_dir, 728 * MiB, 500 * MiB, slept, trained,
                               done, results)),
             ctx.Process(target=sleep_workers.trainer,
                         args=(CARD, "rl", shared_dir, big, slept, trained, done, results))]
    for p in procs:
        p.start()
    try:
        got = {r[0]: r for r in (results.get(timeout=JOIN) for _ in procs)}
    finally:
        for p in procs:
            p.join(JOIN)
            if p.is_alive():
                p.kill()
                p.join(JOIN)
    _, released, mapped, same, s_err = got["sleeper"]
    _, taken, cached_after, t_err = got["trainer"]
    assert not s_err and not t_err, s_err + t_err
    assert released >= 0.95 * big
    assert taken == big
    assert mapped >= 0.95 * big and same
    assert cached_after < big                        # it handed its cache back for the wake
