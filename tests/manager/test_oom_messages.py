"""What an OutOfMemoryError and memory_summary tell a user about the limits that refused them.

Each setting that can refuse a request when the user set it (a hard limit: ``min_free_bytes``,
``gpu_memory_fraction``, ``reserve_bytes``) is named in the error with its value and the value
that would have let the request through; each test then applies that advice and checks the request is served, so the
advice is not just words. ``max_pool_size`` only caps the cache and never refuses a request.

Level: **real** (the real pool and MemoryManager on gpumem_sim devices).
"""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import OutOfMemoryError
from gpumem.observe.summary import summary_data
from gpumem_sim import SimDevice

MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


def _fresh(capacity: str = "1GiB", other: int = 0, **config) -> MemoryManager:
    gpumem_sim.install(SimDevice(capacity, other_process_bytes=other))
    return MemoryManager("sim:0", MemoryConfig(**config))


def _oom(mm: MemoryManager, nbytes: int) -> OutOfMemoryError:
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(nbytes, fallback=False)
    return info.value


def test_min_free_bytes_is_named_with_its_value_and_the_fix():
    """malloc(600 MiB, fallback=False) on a fresh sim:1GiB with the user's min_free_bytes=512MiB
    (a hard limit). The error says min_free_bytes=512 MiB refused it and how to lower it
    (MemoryConfig, configure, GPUMEM_MIN_FREE_BYTES); the value it suggests serves the request.
    (The default's soft 512 MiB serves it: tests/manager/test_soft_limits.py.)"""
    err = _oom(_fresh(min_free_bytes="512MiB"), 600 * MiB)
    msg = str(err)
    assert "min_free_bytes=512.00 MiB (your hard limit) refused it" in msg
    assert "GPUMEM_MIN_FREE_BYTES=" in msg and "configure(" in msg
    assert "gpu_memory_fraction" not in msg          # 600 MiB is within usable memory
    suggested = re.search(r'MemoryConfig\(min_free_bytes="(\w+)"\)', msg).group(1)
    assert suggested == "424MiB"
    mm = _fresh(min_free_bytes=suggested)
    mm.malloc(600 * MiB, fallback=False).free()


def test_gpu_memory_fraction_is_named_with_the_fraction_that_fits():
    """A request over usable memory set by gpu_memory_fraction names that setting and its
    value; the fraction it suggests serves the request."""
    err = _oom(_fresh(gpu_memory_fraction=0.5, min_free_bytes=0), 600 * MiB)
    msg = str(err)
    assert "gpu_memory_fraction=0.5 (your hard limit) refused it" in msg
    assert "min_free_bytes" not in msg
    need = float(re.search(r"MemoryConfig\(gpu_memory_fraction=([0-9.]+)\)", msg).group(1))
    assert 0.5 < need <= 0.6
    mm = _fresh(gpu_memory_fraction=need, min_free_bytes=0)
    mm.malloc(600 * MiB, fallback=False).free()


def test_reserve_bytes_is_named_when_it_sets_usable_memory():
    """With reserve_bytes the tighter limit, the error names reserve_bytes (not the fraction),
    counts what the manager already holds, and the reserve it suggests serves the request."""
    mm = _fresh(reserve_bytes="400MiB", min_free_bytes=0, gpu_memory_fraction=1.0)
    held = mm.malloc(300 * MiB, fallback=False)
    msg = str(_oom(mm, 400 * MiB))
    assert "reserve_bytes=400.00 MiB (your hard limit) refused it" in msg
    assert "300.00 MiB held" in msg
    suggested = re.search(r'MemoryConfig\(reserve_bytes="(\w+)"\)', msg).group(1)
    held.free()
    mm = _fresh(reserve_bytes=suggested, min_free_bytes=0, gpu_memory_fraction=1.0)
    a = mm.malloc(300 * MiB, fallback=False)
    mm.malloc(400 * MiB, fallback=False).free()
    a.free()


def test_a_full_device_blames_no_setting():
    """When other processes hold the device, no setting is blamed: the error says the device
    refused it, how little it has free and that no gpumem setting refused it (hard limits that
    leave room, or the soft defaults)."""
    for config in ({"min_free_bytes": 0, "gpu_memory_fraction": 1.0}, {}):
        mm = _fresh(other=900 * MiB, **config)
        msg = str(_oom(mm, 200 * MiB))
        assert "the device refused it: it has only 124.00 MiB free" in msg
        assert "no gpumem setting refused it" in msg
        assert "(your hard limit)" not in msg


def test_memory_summary_usable_is_what_can_be_allocated():
    """memory_summary's "usable" on a fresh sim:1GiB with the user's min_free_bytes=512MiB is
    512 MiB (a hard margin): 512 MiB can be allocated, 514 MiB cannot. With the defaults (soft)
    it is the whole card, and all of it can be allocated."""
    mm = _fresh(min_free_bytes="512MiB")
    assert "usable 512.00 MiB" in mm.memory_summary()
    assert summary_data(mm)["allocatable_bytes"] == 512 * MiB
    _oom(mm, 514 * MiB)
    mm.malloc(512 * MiB, fallback=False).free()
    mm = _fresh()
    assert summary_data(mm)["allocatable_bytes"] == 1024 * MiB
    mm.malloc(1024 * MiB, fallback=False).free()


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1 << 20, 1 << 40), fraction=st.floats(0.05, 1.0),
       reserved_share=st.floats(0.0, 1.0), request_share=st.floats(0.0, 1.0),
       free_share=st.floats(0.0, 1.0), min_free=st.integers(0, 1 << 34))
def test_suggested_values_let_the_request_through(total, fraction, reserved_share,
                                                  request_share, free_share, min_free):
    """Over random devices and requests, the values the error suggests (a fraction to raise
    to, a min_free_bytes to lower to) satisfy the very check that refused the request: the
    manager's usable memory, int(total * fraction), holds what it has plus the request, and
    the device's free memory less the request keeps the suggested min_free_bytes."""
    from gpumem.manager.limits import refusal_causes
    reserved = int(total * reserved_share)
    nbytes = int(total * request_share)
    free = int((total - reserved) * free_share)
    config = MemoryConfig(gpu_memory_fraction=fraction, min_free_bytes=min_free,
                          reserve_bytes=0)
    usable = int(total * fraction)
    causes = refusal_causes(nbytes, config=config, total=total, reserve=0, hold=usable,
                            reserved=reserved, free=free)
    for cause in causes:
        m = re.search(r"MemoryConfig\(gpu_memory_fraction=([0-9.]+)\)", cause)
        if m:
            need = float(m.group(1))
            assert need <= 1.0 and int(total * need) >= reserved + nbytes, cause
        m = re.search(r'MemoryConfig\(min_free_bytes="(\d+)MiB"\)', cause)
        if m:
            assert free - nbytes >= int(m.group(1)) * MiB, cause
    if reserved + nbytes > usable:
        assert any(c.startswith("gpu_memory_fraction=") for c in causes)
    if min_free and nbytes <= free < nbytes + min_free:
        assert any(c.startswith("min_free_bytes=") for c in causes)
