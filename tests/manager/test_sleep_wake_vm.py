"""Sleep and wake on both virtual-memory drivers the tests have (issue 40): every test runs at
level **real** (host-backed gpumem_sim) and **fake driver** (the real cuda-python against
tests/fake_cuda, whose VMM block enforces the driver's rules: it runs in ci/test.sh's cuda
passes and skips elsewhere), through the ``vm`` fixture of tests/vm_managers.py, which also
asserts that no physical handle, mapping or reservation is left after close(). The fake has no
fault switch, so refusals are injected by a stand-in for the device's call (refusing_nth).
"""
from __future__ import annotations

import pytest

from gpumem.errors import DriverError, GpuMemoryError, OutOfMemoryError
from vm_managers import fill, intact, refusing_nth, vm  # noqa: F401
from gpumem.units import MiB


def live_handles(v) -> int:
    return v.leaks()[0] - v.base[0]


def tagged(v, tag: str, sizes: list[int]) -> list[tuple[object, bytes]]:
    with v.mm.region(tag):
        bufs = [v.mm.malloc(n) for n in sizes]
    return [(b, fill(b, i + len(tag))) for i, b in enumerate(bufs)]


@pytest.mark.parametrize("call,nth", [("vm_create", 2), ("vm_map_many", 1)])
def test_refused_wake_keeps_the_tag_asleep_then_succeeds(vm, monkeypatch, call, nth):
    """Real and fake driver: a wake whose second page creation (or first mapping) the driver
    refuses raises OutOfMemoryError, leaves no new handle or mapping and the tag asleep with
    its backup; the next wake restores every byte at the same addresses."""
    v = vm
    weights = tagged(v, "weights", [6 * MiB, 3 * MiB, 10 * MiB, 1 * MiB, 16384])
    kv = tagged(v, "kv", [8 * MiB])
    plain = v.mm.malloc(2 * MiB)
    plain_data = fill(plain, 9)
    ptrs = [b.ptr for b, _ in weights]
    physical = v.physical
    released = v.mm.sleep(["weights", "kv"], backup=["weights"])
    assert released >= sum(b.nbytes for b, _ in weights + kv)
    assert physical - v.physical == released
    handles = live_handles(v)
    with pytest.raises(GpuMemoryError, match="weights"):
        weights[0][0].copy_to_host()
    stand_in, calls = refusing_nth(v.mm.device, call, nth)
    monkeypatch.setattr(v.mm.device, call, stand_in)
    with pytest.raises(OutOfMemoryError, match="stays asleep"):
        v.mm.wake("weights")
    monkeypatch.undo()
    assert calls and live_handles(v) == handles
    assert weights[0][0].asleep_tag == "weights"
    assert v.mm.stats().backup_bytes == sum(b.nbytes for b, _ in weights)
    assert v.mm.wake("weights") > 0
    assert [b.ptr for b, _ in weights] == ptrs
    intact(weights + [(plain, plain_data)])
    assert v.mm.wake() > 0                        # kv, discarded: usable again
    kv[0][0].memset(5)
    for b, _ in weights + kv:
        v.mm.free(b)
    plain.free()
    v.mm.empty_cache()
    assert v.physical == 0


def test_refused_unmap_leaves_the_tag_awake(vm, monkeypatch):
    """Real and fake driver: a sleep whose second unmap the driver refuses maps back what it
    unmapped and raises; the tag is awake with every byte in place."""
    v = vm
    bufs = tagged(v, "w", [4 * MiB, 4 * MiB, 4 * MiB])
    v.mm.empty_cache()                            # the sleep's first trim has nothing to do
    stand_in, _ = refusing_nth(v.mm.device, "vm_unmap", 2)
    monkeypatch.setattr(v.mm.device, "vm_unmap", stand_in)
    with pytest.raises(DriverError):
        v.mm.sleep("w")
    monkeypatch.undo()
    assert bufs[0][0].asleep_tag is None and v.mm.stats().asleep_bytes == 0
    assert v.mm.stats().backup_bytes == 0
    intact(bufs)
    assert v.mm.sleep("w") > 0
    assert v.mm.wake("w") > 0
    intact(bufs)
    for b, _ in bufs:
        b.free()


def test_sleep_cycles_return_every_handle(vm):
    """Real and fake driver: ten sleep/wake cycles with frees while asleep leave the physical
    memory where one cycle does, and closing leaves nothing (the fixture checks)."""
    v = vm
    bufs = tagged(v, "w", [5 * MiB] * 6)
    v.mm.sleep("w")
    v.mm.wake()
    after_one = v.physical
    for _ in range(10):
        v.mm.sleep("w")
        v.mm.wake("w")
        assert v.physical == after_one
    intact(bufs)
    v.mm.sleep("w")
    for b, _ in bufs[3:]:
        b.free()                                   # freed while asleep
    v.mm.wake()
    intact(bufs[:3])
    assert v.physical < after_one
