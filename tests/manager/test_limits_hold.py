"""Limits hold whatever the segment policy, and release paths are exception-safe (issue 39,
points 1 and 2).

Point 1: a miss that compacts moves free pages between segments. The pool stops counting them
when they are taken, but the device holds them throughout and the manager holds them again
once they are mapped at their target: every limit check must see them. Seeded random walks
over every policy sample the device's bytes after every operation.

Point 2: an error other than the driver's refusal (e.g. the shared ledger's lock timing out)
raised while page handles are given back must leave every handle counted: given back, or
held and retried; the error reaches the caller once the accounting is consistent.

Level: real (the Cython pool and the manager on gpumem_sim; faults through stand-ins of the
simulated driver's calls and of the shared card's ledger).
"""
from __future__ import annotations

import os
import random
import warnings

import pytest

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import OutOfMemoryError
from gpumem.placement.ledger import SharedLedgerError
from invariants import check

MiB = 1 << 20
GiB = 1 << 30
POLICIES = ["plain", "fast", "auto", "tight"]


def _walk(mm, dev, rng, steps, after_op):
    """``steps`` seeded allocations and frees (many sizes, a few trims); ``after_op(step,
    freed)`` after each (``freed``: the step was a free)."""
    live = []
    for step in range(steps):
        op = rng.random()
        freed = False
        if op < 0.55:
            size = rng.choice([rng.randrange(1, 2 * MiB), rng.randrange(MiB, 64 * MiB)])
            try:
                live.append(mm.malloc(size))
            except OutOfMemoryError:
                pass
        elif op < 0.98 and live:
            live.pop(rng.randrange(len(live))).free()
            freed = True
        else:
            mm.shrink(rng.randrange(0, 64 * MiB))
        after_op(step, freed)
    check(mm, live)
    return live


# the three caps of a manager's own limits, each 768 MiB on a 1 GiB device
CAPS = {
    "fraction": dict(gpu_memory_fraction=0.75, reserve_bytes=0, min_free_bytes=0),
    "min_free_bytes": dict(gpu_memory_fraction=1.0, reserve_bytes=0, min_free_bytes=256 * MiB),
    "reserve_bytes": dict(gpu_memory_fraction=1.0, reserve_bytes=256 * MiB, min_free_bytes=0),
}


@pytest.mark.parametrize("cap", sorted(CAPS))
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_walk_never_passes_the_limit(policy, cap):
    """On sim:1GiB with a 768 MiB limit (a fraction, min_free_bytes or reserve_bytes), 800
    random steps under each segment policy: after every step the device holds at most 768 MiB
    (page moves included: tight and auto held up to 802 MiB before the fix) and exactly what
    the manager's reserved_bytes says."""
    for seed in range(2):
        dev = gpumem_sim.SimDevice("1GiB", seed=seed)
        mm = MemoryManager(dev, MemoryConfig(segments=policy, cpu_fallback_enabled=False,
                                             **CAPS[cap]))
        peak = 0

        def sample(step, freed):
            nonlocal peak
            peak = max(peak, dev.live_bytes)
            assert dev.live_bytes <= 768 * MiB, (
                f"{policy}/{cap} seed {seed} step {step}: the device holds "
                f"{dev.live_bytes / MiB:.1f} MiB, past the 768 MiB limit")
            assert dev.live_bytes == mm.stats().reserved_bytes
        try:
            _walk(mm, dev, random.Random(seed), 800, sample)
        finally:
            mm.close()
        assert peak > 700 * MiB, "the walk never came near the limit: it proves little"
        assert dev.live_bytes == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_walk_with_max_pool_size(policy):
    """With max_pool_size=64MiB besides a 0.75 fraction: after every step the device holds at
    most 768 MiB, and after every free the cache is at most 64 MiB unless none of it can go
    back (no wholly free segment, no whole free page handle)."""
    dev = gpumem_sim.SimDevice("1GiB", seed=3)
    mm = MemoryManager(dev, MemoryConfig(segments=policy, cpu_fallback_enabled=False,
                                         gpu_memory_fraction=0.75, reserve_bytes=0,
                                         min_free_bytes=0, max_pool_size=64 * MiB))

    def sample(step, freed):
        assert dev.live_bytes <= 768 * MiB, f"{policy} step {step}: {dev.live_bytes} bytes"
        st = mm.stats()
        assert dev.live_bytes == st.reserved_bytes
        if freed and st.cached_bytes > 64 * MiB:
            exp = mm.expandable_segments
            assert mm.pool.whole_free_bytes == 0 and (exp is None or exp.trimmable() == 0), (
                f"{policy} step {step}: {st.cached_bytes} bytes cached, past max_pool_size, "
                f"while some could go back")
    try:
        _walk(mm, dev, random.Random(3), 800, sample)
    finally:
        mm.close()
    assert dev.live_bytes == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_shared_budget_walk_single_member(policy):
    """As the only member of a shared group with shared_budget=0.75 on sim:1GiB, 800 random
    steps: the device never holds more than the 768 MiB budget, and after every step the
    member's slot in the ledger says what the device holds (before the fix: up to 868 MiB)."""
    from gpumem.placement.shared_budget import group_members
    group = f"limits-hold-{os.getpid()}-{policy}"
    dev = gpumem_sim.SimDevice("1GiB", seed=5)
    mm = MemoryManager(dev, MemoryConfig(segments=policy, cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0, shared_group=group,
                                         shared_budget=0.75))

    def sample(step, freed):
        assert dev.live_bytes <= 768 * MiB, (
            f"{policy} step {step}: the device holds {dev.live_bytes / MiB:.1f} MiB, past "
            f"the group's 768 MiB budget")
        assert dev.live_bytes == mm.stats().reserved_bytes
    try:
        _walk(mm, dev, random.Random(5), 800, sample)
        members = group_members(mm._growth.shared._ledger)
        assert [m.reserved for m in members] == [dev.live_bytes]
    finally:
        mm.close()
    assert dev.live_bytes == 0


# --- point 2: exception-safe release paths ---------------------------------------------------
def _raising_nth(dev, name, nth, exc_type=SharedLedgerError):
    """Make ``dev.<name>`` raise ``exc_type`` (before doing anything) on its ``nth`` call from
    now on; the calls it saw."""
    real = getattr(dev, name)
    calls = []

    def stand_in(*args):
        calls.append(args)
        if len(calls) == nth:
            raise exc_type(f"{name} failed (test)")
        return real(*args)
    setattr(dev, name, stand_in)
    return calls


@pytest.mark.parametrize("policy", ["tight", "auto"])
def test_error_while_releasing_pages_strands_nothing(policy):
    """A non-driver error from the 3rd page release of an empty_cache: the error reaches the
    caller, every other handle was still given back, the one that failed is held (counted in
    reserved_bytes and held_bytes: the device still holds it) and the next trim frees it."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments=policy, cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0, release_before_grow=False))
    try:
        bufs = [mm.malloc(24 * MiB) for _ in range(8)]
        for b in bufs:
            b.free()
        assert dev.live_page_handles >= 4
        calls = _raising_nth(dev, "vm_release", 3)
        with pytest.raises(SharedLedgerError):
            mm.empty_cache()
        st = mm.stats()
        assert dev.live_bytes == st.reserved_bytes == st.held_bytes > 0, (
            f"the device holds {dev.live_bytes} bytes, the manager counts {st.reserved_bytes}")
        assert dev.live_page_handles == 1           # every other handle was given back
        check(mm)
        mm.empty_cache()                         # the retry
        assert dev.live_bytes == mm.stats().reserved_bytes == 0
    finally:
        mm.close()
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)


def test_error_while_closing_strands_nothing():
    """close() while page releases fail once with a non-driver error: close completes (it
    warns), retries the held handle, and leaves nothing on the device."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments="tight", cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0))
    bufs = [mm.malloc(24 * MiB) for _ in range(4)]
    for b in bufs[1:]:
        b.free()
    _raising_nth(dev, "vm_release", 2)
    with pytest.warns(RuntimeWarning, match="on close"):
        mm.close()
    assert (dev.live_bytes, dev.live_page_handles, dev.live_mappings,
            dev.live_reservations) == (0, 0, 0, 0)


def test_error_while_freeing_plain_segments_strands_nothing():
    """Plain segments: a non-driver error from one segment's free while the cache is released
    puts that segment back into the pool, still frees the others, and then reaches the
    caller; the device holds exactly what reserved_bytes says."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments="plain", cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0))
    try:
        bufs = [mm.malloc(30 * MiB) for _ in range(5)]
        for b in bufs:
            b.free()
        _raising_nth(dev, "free_segment", 2)
        with pytest.raises(SharedLedgerError):
            mm.empty_cache()
        st = mm.stats()
        assert dev.live_bytes == st.reserved_bytes == 30 * MiB
        check(mm)
        mm.empty_cache()
        assert dev.live_bytes == mm.stats().reserved_bytes == 0
    finally:
        mm.close()


def test_shared_card_ledger_timeout_strands_no_page():
    """The issue's case: on a sim card shared through a group's ledger, the card's bookkeeping
    raises SharedLedgerError (its lock not had within its bound) during the 2nd page release
    of an empty_cache. The error reaches the caller; the device and the card hold exactly
    what the manager counts; a retry and close() leave nothing behind."""
    group = f"limits-card-{os.getpid()}"
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments="tight", cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0, shared_group=group))
    card = dev._card
    if card is None:
        mm.close()
        pytest.skip("this platform's shared group gives the sim device no shared card")
    try:
        bufs = [mm.malloc(24 * MiB) for _ in range(4)]
        for b in bufs:
            b.free()
        real, calls = card.charge, []

        def charge(delta):
            if delta < 0:
                calls.append(delta)
                if len(calls) == 2:
                    raise SharedLedgerError("the ledger's lock was not had in 2 s (test)")
            return real(delta)
        card.charge = charge
        with pytest.raises(SharedLedgerError):
            mm.empty_cache()
        st = mm.stats()
        assert dev.live_bytes == st.reserved_bytes == st.held_bytes > 0
        card.charge = real
        mm.empty_cache()
        assert dev.live_bytes == mm.stats().reserved_bytes == 0
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mm.close()
    assert (dev.live_bytes, dev.live_page_handles, dev.live_reservations) == (0, 0, 0)


def test_error_while_unmapping_keeps_the_segment_for_a_retry():
    """A non-driver error from the 2nd unmap while a wholly free segment is released: the
    mappings not unmapped and the reservation stay counted (held_bytes, reserved_bytes equal
    to what the device holds), the error reaches the caller, and the next empty_cache gives
    all of it back."""
    dev = gpumem_sim.SimDevice("1GiB")
    mm = MemoryManager(dev, MemoryConfig(segments="tight", cpu_fallback_enabled=False,
                                         gpu_memory_fraction=1.0, reserve_bytes=0,
                                         min_free_bytes=0, release_before_grow=False))
    try:
        mm.malloc(40 * MiB).free()
        _raising_nth(dev, "vm_unmap", 2)
        with pytest.raises(SharedLedgerError):
            mm.empty_cache()
        st = mm.stats()
        assert dev.live_bytes == st.reserved_bytes == st.held_bytes > 0
        assert dev.live_reservations == 1 and mm.expandable_segments.held_pages > 0
        mm.empty_cache()
        assert (dev.live_bytes, dev.live_page_handles, dev.live_mappings,
                dev.live_reservations) == (0, 0, 0, 0)
        assert mm.stats().reserved_bytes == 0
    finally:
        mm.close()
