"""Tests of gpumem_sim (the simulated driver) and the "sim" backend adapter.

Every test leaves the sim registry as it found it (autouse fixture), so the file runs under
pytest-xdist in any order.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpumem_sim
from gpumem.backends import get_backend, open_device
from gpumem.backends.base import Device
from gpumem.backends.sim import BACKEND, SimBackend
from gpumem.errors import DriverError, DriverOutOfMemory, InvalidDeviceError, InvalidInputError
from gpumem.units import GiB, KiB, MiB
from gpumem_sim import SimCall, SimDevice


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


def outcomes(dev: SimDevice, n: int, nbytes: int = 256) -> list[bool]:
    """Try ``n`` allocations (freeing each success at once); True where it succeeded."""
    result = []
    for _ in range(n):
        try:
            h, _ = dev.alloc_segment(nbytes)
        except DriverOutOfMemory:
            result.append(False)
        else:
            dev.free_segment(h)
            result.append(True)
    return result


# --- construction and validation ------------------------------------------------------------
def test_capacity_strings_and_properties():
    dev = SimDevice("16GiB", seed=5)
    assert isinstance(dev, Device)
    assert dev.capacity == 16 * GiB
    assert dev.mem_get_info() == (16 * GiB, 16 * GiB)
    props = dev.properties()
    assert props.total_memory == 16 * GiB
    assert props.alignment == 256
    assert props.name == "SimDevice 16.00 GiB"
    assert props.extra["simulated"] is True
    assert props.extra["seed"] == 5
    assert props.extra["back_memory"] is False
    named = SimDevice(MiB, name="Fake A100", alignment=512, back_memory=True)
    assert named.properties().name == "Fake A100"
    assert named.properties().alignment == 512
    assert named.properties().extra["back_memory"] is True
    assert SimDevice(np.int64(4096)).capacity == 4096
    assert dev.index == -1 and "not installed" in dev.device_string


@pytest.mark.parametrize("kwargs, word", [
    ({"capacity": -1}, "capacity"),
    ({"capacity": 0}, "capacity"),
    ({"capacity": "lots"}, "capacity"),
    ({"capacity": True}, "capacity"),
    ({"capacity": 1.5}, "capacity"),
    ({"capacity": 1 << 49}, "capacity"),
    ({"capacity": MiB, "alignment": 0}, "alignment"),
    ({"capacity": MiB, "alignment": 3}, "alignment"),
    ({"capacity": MiB, "alignment": 384}, "alignment"),
    ({"capacity": MiB, "alignment": True}, "alignment"),
    ({"capacity": MiB, "alignment": "256"}, "alignment"),
    ({"capacity": MiB, "alignment": 1 << 31}, "alignment"),
    ({"capacity": MiB, "name": ""}, "name"),
    ({"capacity": MiB, "name": 7}, "name"),
    ({"capacity": MiB, "other_process_bytes": MiB + 1}, "other_process_bytes"),
    ({"capacity": MiB, "other_process_bytes": -1}, "other_process_bytes"),
    ({"capacity": MiB, "other_process_bytes": "many"}, "other_process_bytes"),
    ({"capacity": MiB, "back_memory": 1}, "back_memory"),
    ({"capacity": MiB, "seed": 1.5}, "seed"),
    ({"capacity": MiB, "seed": True}, "seed"),
    ({"capacity": MiB, "fail_after": -1}, "fail_after"),
    ({"capacity": MiB, "fail_after": True}, "fail_after"),
    ({"capacity": MiB, "fail_after": 2.0}, "fail_after"),
    ({"capacity": MiB, "fail_rate": -0.1}, "fail_rate"),
    ({"capacity": MiB, "fail_rate": 1.5}, "fail_rate"),
    ({"capacity": MiB, "fail_rate": math.nan}, "fail_rate"),
    ({"capacity": MiB, "fail_rate": True}, "fail_rate"),
    ({"capacity": MiB, "fail_rate": "0.5"}, "fail_rate"),
    ({"capacity": MiB, "fail_free": -2}, "fail_free"),
    ({"capacity": MiB, "fail_free": 0.5}, "fail_free"),
    ({"capacity": MiB, "fail_kind": "boom"}, "fail_kind"),
])
def test_bad_constructor_arguments(kwargs, word):
    capacity = kwargs.pop("capacity")
    with pytest.raises(InvalidInputError, match=word):
        SimDevice(capacity, **kwargs)


def test_bad_call_arguments():
    dev = SimDevice(MiB, back_memory=True)
    for bad in (0, -5, True, 1.0, "1KiB"):
        with pytest.raises(InvalidInputError, match="nbytes"):
            dev.alloc_segment(bad)
    assert dev.alloc_calls == 0  # invalid calls never reach the driver's count
    h, _ = dev.alloc_segment(100)
    with pytest.raises(InvalidInputError, match="value"):
        dev.memset(h, 0, 256, 1)
    with pytest.raises(InvalidInputError, match="offset"):
        dev.resolve(h, -1, 1)
    with pytest.raises(InvalidInputError, match="read-only"):
        dev.copy_to_host(h, 0, memoryview(b"abc"))
    with pytest.raises(InvalidInputError, match="buffer protocol"):
        dev.copy_from_host(h, 0, [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="contiguous"):
        dev.copy_from_host(h, 0, np.zeros(8, dtype=np.uint8)[::2])
    for bad in ({"fail_rate": 2}, {"fail_after": -1}, {"fail_free": "yes"}, {"seed": None}):
        with pytest.raises(InvalidInputError):
            dev.inject(**bad)
    assert dev.faults["fail_rate"] == 0.0  # a rejected inject changes nothing


# --- accounting, alignment, placement -----------------------------------------------------
def test_mem_get_info_is_exact():
    dev = SimDevice(MiB, alignment=256, other_process_bytes=1000)
    assert dev.mem_get_info() == (MiB - 1000, MiB)
    h1, _ = dev.alloc_segment(1)          # reserves 256
    h2, _ = dev.alloc_segment(256)        # 256
    h3, _ = dev.alloc_segment(257)        # 512
    assert dev.mem_get_info() == (MiB - 1000 - 1024, MiB)
    assert dev.live_bytes == 1024 and dev.live_segments == 3
    dev.free_segment(h2)
    assert dev.mem_get_info() == (MiB - 1000 - 768, MiB)
    dev.set_other_process_bytes("64KiB")
    assert dev.mem_get_info() == (MiB - 64 * KiB - 768, MiB)
    dev.free_segment(h1)
    dev.free_segment(h3)
    assert dev.mem_get_info() == (MiB - 64 * KiB, MiB)
    assert dev.live_bytes == 0 and dev.live_segments == 0
    assert dev.peak_live_bytes == 1024
    assert dev.mem_get_info_calls == 5


@pytest.mark.parametrize("alignment", [1, 256, 4096, 2 * MiB])
def test_segments_are_aligned_and_inside_the_window(alignment):
    dev = SimDevice(64 * MiB, alignment=alignment)
    assert dev.base_address % max(alignment, 1 << 40) == 0
    for n in (1, 3, alignment + 1, 5000, 3 * alignment - 1):
        h, base = dev.alloc_segment(n)
        assert base % alignment == 0
        assert dev.base_address <= base
        assert base + n <= dev.base_address + dev.capacity
        assert dev.resolve(h, 0, n) == base
    reserved = {s.handle: s.reserved for s in dev.segments()}
    assert all(r % alignment == 0 for r in reserved.values())
    assert dev.live_bytes == sum(reserved.values())


def test_devices_never_share_addresses():
    a, b = SimDevice("1TiB"), SimDevice("2TiB")
    lo_a, hi_a = a.base_address, a.base_address + a.capacity
    lo_b, hi_b = b.base_address, b.base_address + b.capacity
    assert hi_a <= lo_b or hi_b <= lo_a
    assert hi_a < 1 << 63 and hi_b < 1 << 63


def test_out_of_memory_when_full_leaves_state_unchanged():
    dev = SimDevice(64 * KiB, alignment=1024)
    h, base = dev.alloc_segment(64 * KiB)
    assert base == dev.base_address
    assert dev.mem_get_info() == (0, 64 * KiB)
    with pytest.raises(DriverOutOfMemory) as info:
        dev.alloc_segment(1)
    err = info.value
    assert isinstance(err, DriverError) and isinstance(err, MemoryError)
    assert err.code_name == "SIM_ERROR_OUT_OF_MEMORY" and err.code == 2
    assert err.injected is False
    assert dev.failed_allocs == 1 and dev.alloc_calls == 2
    assert dev.live_segments == 1 and dev.mem_get_info() == (0, 64 * KiB)
    dev.free_segment(h)
    h2, base2 = dev.alloc_segment(64 * KiB)
    assert base2 == dev.base_address and h2 != h


def test_out_of_memory_from_address_fragmentation():
    dev = SimDevice(4 * KiB, alignment=1024)
    hs = [dev.alloc_segment(1024)[0] for _ in range(4)]
    dev.free_segment(hs[0])
    dev.free_segment(hs[2])
    assert dev.mem_get_info()[0] == 2048           # enough bytes free...
    assert dev.largest_free_range() == 1024        # ...but not contiguous
    with pytest.raises(DriverOutOfMemory, match="fragmented"):
        dev.alloc_segment(2048)
    dev.free_segment(hs[1])                        # coalesces [0, 3072)
    assert dev.largest_free_range() == 3072
    _, base = dev.alloc_segment(2048)
    assert base == dev.base_address


def test_best_fit_placement_uses_the_smallest_hole():
    dev = SimDevice(16 * KiB, alignment=1024)
    a, _ = dev.alloc_segment(3 * KiB)
    sep1, _ = dev.alloc_segment(KiB)
    b, b_base = dev.alloc_segment(KiB)
    sep2, _ = dev.alloc_segment(KiB)
    dev.free_segment(a)   # 3 KiB hole at the start
    dev.free_segment(b)   # 1 KiB hole in the middle; 10 KiB free at the end
    _, base = dev.alloc_segment(KiB)
    assert base == b_base
    _, base = dev.alloc_segment(2 * KiB)
    assert base == dev.base_address


def test_other_processes_take_memory():
    dev = SimDevice(MiB)
    dev.set_other_process_bytes(MiB - 4096)
    with pytest.raises(DriverOutOfMemory, match="free of"):
        dev.alloc_segment(8192)
    h, _ = dev.alloc_segment(4096)
    assert dev.mem_get_info() == (0, MiB)
    with pytest.raises(InvalidInputError, match="other_process_bytes"):
        dev.set_other_process_bytes(MiB)   # only 1 MiB - 4096 is not in our segments
    dev.set_other_process_bytes(0)
    dev.alloc_segment(8192)
    dev.free_segment(h)
    assert dev.other_process_bytes == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=60),
       st.sampled_from([1, 64, 512, 4096]))
def test_random_alloc_free_keeps_exact_accounting(ops, alignment):
    dev = SimDevice(256 * KiB, alignment=alignment, other_process_bytes=12345)
    live: dict[int, tuple[int, int]] = {}
    for is_free, n in ops:
        if is_free and live:
            h = sorted(live)[n % len(live)]
            dev.free_segment(h)
            del live[h]
            continue
        try:
            h, base = dev.alloc_segment(n)
        except DriverOutOfMemory:
            continue
        live[h] = (base, -(-n // alignment) * alignment)
    spans = sorted(live.values())
    for (b1, r1), (b2, _) in zip(spans, spans[1:]):
        assert b1 + r1 <= b2                       # no two segments overlap
    assert all(b % alignment == 0 for b, _ in spans)
    used = sum(r for _, r in spans)
    assert dev.mem_get_info() == (256 * KiB - 12345 - used, 256 * KiB)
    assert dev.live_segments == len(live)


# --- fault injection --------------------------------------------------------------------------
def test_fail_after_lets_n_calls_through_then_fails_all():
    dev = SimDevice(MiB, fail_after=2)
    dev.alloc_segment(100)
    dev.alloc_segment(100)
    for _ in range(3):
        with pytest.raises(DriverOutOfMemory) as info:
            dev.alloc_segment(100)
        assert info.value.injected is True
        assert "fail_after" in str(info.value)
    assert dev.alloc_calls == 5 and dev.failed_allocs == 3 and dev.injected_failures == 3
    assert dev.live_segments == 2
    dev.inject(fail_after=1)                       # a new count starts now
    dev.alloc_segment(100)
    with pytest.raises(DriverOutOfMemory):
        dev.alloc_segment(100)
    dev.clear_faults()
    dev.alloc_segment(100)
    assert dev.live_segments == 4


def test_fail_after_zero_and_genuine_failures_use_up_the_count():
    assert outcomes(SimDevice(MiB, fail_after=0), 3) == [False, False, False]
    dev = SimDevice(4096, alignment=256, fail_after=2)
    with pytest.raises(DriverOutOfMemory) as info:
        dev.alloc_segment(8192)                    # call 1: genuinely too big
    assert info.value.injected is False
    dev.alloc_segment(256)                         # call 2: let through
    with pytest.raises(DriverOutOfMemory) as info:
        dev.alloc_segment(256)                     # call 3: injected
    assert info.value.injected is True


def test_fail_rate_is_deterministic_per_seed():
    a = outcomes(SimDevice(MiB, fail_rate=0.3, seed=42), 400)
    b = outcomes(SimDevice(MiB, fail_rate=0.3, seed=42), 400)
    c = outcomes(SimDevice(MiB, fail_rate=0.3, seed=43), 400)
    assert a == b
    assert a != c
    assert 80 < a.count(False) < 160               # about 30 % of 400
    assert outcomes(SimDevice(MiB, fail_rate=0.0, seed=1), 100) == [True] * 100
    assert outcomes(SimDevice(MiB, fail_rate=1.0, seed=1), 100) == [False] * 100


def test_higher_fail_rate_fails_a_superset_and_reseed_restarts():
    low = outcomes(SimDevice(MiB, fail_rate=0.1, seed=9), 350)
    high = outcomes(SimDevice(MiB, fail_rate=0.5, seed=9), 350)
    assert all(h is False for lo, h in zip(low, high) if lo is False)
    assert high.count(False) > low.count(False)
    dev = SimDevice(MiB, seed=9)
    assert outcomes(dev, 50) == [True] * 50
    dev.inject(fail_rate=0.1)                      # call k still uses the k-th draw
    assert outcomes(dev, 300) == low[50:]
    dev.inject(seed=9)                             # a reseed starts the stream again
    assert outcomes(dev, 300) == low[:300]


def test_fail_kind_error_raises_a_plain_driver_error():
    dev = SimDevice(MiB, fail_after=0, fail_kind="error")
    with pytest.raises(DriverError) as info:
        dev.alloc_segment(10)
    assert not isinstance(info.value, DriverOutOfMemory)
    assert info.value.code_name == "SIM_ERROR_INJECTED"
    assert dev.calls == [SimCall("alloc", 10, None, "injected_error")]


def test_failing_frees_keep_the_segment():
    dev = SimDevice(MiB, fail_free=True)
    h, _ = dev.alloc_segment(1000)
    for _ in range(2):
        with pytest.raises(DriverError) as info:
            dev.free_segment(h)
        assert not isinstance(info.value, DriverOutOfMemory)
        assert info.value.injected is True
    assert dev.live_segments == 1 and dev.live_bytes == 1024
    assert dev.failed_frees == 2 and dev.free_calls == 2
    dev.clear_faults()
    dev.free_segment(h)
    assert dev.live_segments == 0


def test_fail_free_count_fails_only_that_many():
    dev = SimDevice(MiB)
    hs = [dev.alloc_segment(10)[0] for _ in range(3)]
    dev.inject(fail_free=2)
    results = []
    for h in hs + hs[:2]:
        try:
            dev.free_segment(h)
            results.append(True)
        except DriverError:
            results.append(False)
    assert results == [False, False, True, True, True]
    assert dev.live_segments == 0


def test_unknown_and_double_free():
    dev = SimDevice(MiB)
    h, _ = dev.alloc_segment(10)
    dev.free_segment(h)
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        dev.free_segment(h)
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        dev.free_segment(12345)
    assert dev.free_calls == 1
    h2, _ = dev.alloc_segment(10)
    assert h2 != h                                  # handles are never reused


def test_call_log_records_the_order_of_driver_calls():
    dev = SimDevice(2048, alignment=1024)
    h1, _ = dev.alloc_segment(1024)
    h2, _ = dev.alloc_segment(1024)
    with pytest.raises(DriverOutOfMemory):
        dev.alloc_segment(1024)
    dev.synchronize()
    dev.free_segment(h1)
    h3, _ = dev.alloc_segment(1000)
    assert dev.calls == [
        SimCall("alloc", 1024, h1, "ok"), SimCall("alloc", 1024, h2, "ok"),
        SimCall("alloc", 1024, None, "oom"), SimCall("synchronize", 0, None, "ok"),
        SimCall("free", 1024, h1, "ok"), SimCall("alloc", 1000, h3, "ok"),
    ]
    assert [c.op for c in dev.calls] == ["alloc", "alloc", "alloc", "synchronize", "free", "alloc"]
    dev.reset_counters()
    assert dev.calls == [] and dev.alloc_calls == 0 and dev.peak_live_bytes == dev.live_bytes


# --- host-backed memory --------------------------------------------------------------------
def test_back_memory_round_trip_and_memset():
    dev = SimDevice(MiB, back_memory=True)
    h, _ = dev.alloc_segment(1000)
    out = bytearray(1000)
    dev.copy_to_host(h, 0, memoryview(out))
    assert out == bytes(1000)                       # fresh segments read as zeros
    dev.copy_from_host(h, 10, memoryview(b"hello"))
    arr = np.arange(100, dtype=np.float32)
    dev.copy_from_host(h, 500, memoryview(arr))
    back = np.empty(100, dtype=np.float32)
    dev.copy_to_host(h, 500, memoryview(back))
    np.testing.assert_array_equal(back, arr)
    dev.memset(h, 20, 0xAB, 30)
    dev.copy_to_host(h, 0, memoryview(out))
    assert out[10:15] == b"hello"
    assert out[20:50] == b"\xab" * 30
    assert out[15:20] == bytes(5) and out[50:100] == bytes(50)
    with pytest.raises(InvalidInputError, match="outside segment"):
        dev.copy_from_host(h, 998, memoryview(b"abc"))
    with pytest.raises(InvalidInputError, match="outside segment"):
        dev.memset(h, 0, 1, 1001)


def test_patterns_in_adjacent_segments_stay_separate():
    dev = SimDevice(64 * KiB, alignment=256, back_memory=True)
    segs = [dev.alloc_segment(n) for n in (256, 300, 256, 1000)]
    bases = [b for _, b in segs]
    assert bases == sorted(bases) and bases[1] - bases[0] == 256  # truly adjacent
    for i, (h, _) in enumerate(segs):
        n = dev.segments()[i].nbytes
        dev.memset(h, 0, i + 1, n)
    for i, (h, _) in enumerate(segs):
        n = dev.segments()[i].nbytes
        buf = bytearray(n)
        dev.copy_to_host(h, 0, memoryview(buf))
        assert buf == bytes([i + 1]) * n


def test_freed_segment_bytes_are_discarded():
    dev = SimDevice(4096, alignment=4096, back_memory=True)
    h, base = dev.alloc_segment(4096)
    dev.memset(h, 0, 0x5A, 4096)
    dev.free_segment(h)
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        dev.copy_from_host(h, 0, memoryview(b"x"))
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        dev.copy_to_host(h, 0, memoryview(bytearray(1)))
    h2, base2 = dev.alloc_segment(4096)
    assert base2 == base                            # same address range...
    buf = bytearray(4096)
    dev.copy_to_host(h2, 0, memoryview(buf))
    assert buf == bytes(4096)                       # ...but none of the old bytes


def test_copies_need_back_memory():
    dev = SimDevice(MiB)
    h, _ = dev.alloc_segment(64)
    with pytest.raises(InvalidInputError, match="back_memory"):
        dev.copy_from_host(h, 0, memoryview(b"abc"))
    with pytest.raises(InvalidInputError, match="back_memory"):
        dev.copy_to_host(h, 0, memoryview(bytearray(3)))
    with pytest.raises(InvalidInputError, match="back_memory"):
        dev.memset(h, 0, 0, 3)


def test_resolve_checks_handle_and_bounds():
    dev = SimDevice(MiB)
    h, base = dev.alloc_segment(1000)
    assert dev.resolve(h, 0, 1000) == base
    assert dev.resolve(h, 600, 400) == base + 600
    assert dev.resolve(h, 1000, 0) == base + 1000
    with pytest.raises(InvalidInputError, match="outside segment"):
        dev.resolve(h, 600, 401)
    with pytest.raises(InvalidInputError, match="unknown segment handle"):
        dev.resolve(h + 1, 0, 1)


# --- streams and events -------------------------------------------------------------------
def test_stream_work_model():
    dev = SimDevice(MiB, back_memory=True)
    assert dev.stream_idle(0)
    s1, s2 = dev.create_stream(), dev.create_stream()
    assert (s1, s2) == (1, 2)
    assert dev.submit(s1) == 1
    assert dev.submit(s1, n=2) == 3
    dev.submit(s2)
    assert not dev.stream_idle(s1) and not dev.stream_idle(s2) and dev.stream_idle(0)
    assert dev.pending(s1) == 3
    assert dev.complete(s1, n=2) == 2
    assert not dev.stream_idle(s1)
    with pytest.raises(InvalidInputError, match="pending"):
        dev.complete(s1, n=2)
    assert dev.complete(s1) == 1 and dev.stream_idle(s1)
    assert not dev.stream_idle(s2)
    # copies are synchronous but never advance the simulated queues
    h, _ = dev.alloc_segment(10)
    dev.copy_from_host(h, 0, memoryview(b"ab"), stream=s2)
    assert not dev.stream_idle(s2)
    assert dev.complete() == 1 and dev.stream_idle(s2)
    dev.submit(s1)
    dev.submit(0)
    dev.synchronize()
    assert dev.stream_idle(s1) and dev.stream_idle(0)
    assert dev.synchronize_calls == 1


def test_events_and_stream_lifetime():
    dev = SimDevice(MiB)
    s = dev.create_stream()
    dev.submit(s)
    e1 = dev.record_event(s)
    dev.submit(s)
    e2 = dev.record_event(s)
    assert not dev.event_done(e1)
    dev.complete(s, n=1)
    assert dev.event_done(e1) and not dev.event_done(e2)
    dev.submit(s)
    dev.destroy_stream(s)
    assert dev.event_done(e2)                       # destroyed streams drain
    for call in (dev.stream_idle, dev.submit, dev.destroy_stream, dev.pending):
        with pytest.raises(InvalidInputError, match="unknown stream"):
            call(s)
    with pytest.raises(InvalidInputError, match="unknown stream"):
        dev.stream_idle(99)
    with pytest.raises(InvalidInputError, match="default stream"):
        dev.destroy_stream(0)
    assert dev.create_stream() == s + 1             # stream handles are not reused
    with pytest.raises(InvalidInputError, match="unknown event"):
        dev.event_done(1234)


# --- registry, environment, backend ----------------------------------------------------------
def test_no_sim_device_unless_installed_but_explicit_sim0_opens_the_demo_device():
    """Issue 15 item 2 (real): with nothing installed and GPUMEM_SIM_DEVICES unset there is no
    simulated device to list or pick, yet an explicit "sim:0" still opens one 16 GiB demo
    device, the same object every time and outside the registry."""
    assert gpumem_sim.installed() == () and gpumem_sim.nothing_installed()
    dev = open_device("sim:0")
    assert dev.capacity == gpumem_sim.DEFAULT_CAPACITY == 16 * GiB
    assert dev.device_string == "sim:0"
    assert open_device("sim") is dev is gpumem_sim.demo_device()    # made once, then kept
    assert gpumem_sim.installed() == ()                              # still not listed
    gpumem_sim.uninstall()
    assert open_device("sim:0") is not dev          # uninstall() starts from a fresh demo device
    (row,) = BACKEND.describe()
    assert not row.available and row.simulated and "no simulated device installed" in row.reason
    with pytest.raises(InvalidDeviceError, match="0 sim device"):
        open_device("sim:1")                                         # only sim:0 has a demo
    gpumem_sim.install()                     # explicitly none: sim:0 is then an error
    with pytest.raises(InvalidDeviceError, match="0 sim device"):
        open_device("sim:0")


def test_sim_size_string_opens_a_private_device():
    """Device strings mean the same everywhere (real): "sim:80GiB" is a new private device of
    that size, named as asked, never installed; a malformed size names the device string."""
    a, b = open_device("sim:80GiB"), open_device(" sim : 1.5 GiB ")
    assert (a.capacity, a.device_string) == (80 * GiB, "sim:80GiB")
    assert (b.capacity, b.device_string) == (3 * GiB // 2, "sim:1.5GiB")
    assert open_device("sim:80GiB") is not a and gpumem_sim.installed() == ()
    for bad in ("sim:lots", "sim:-1GiB"):
        with pytest.raises(InvalidDeviceError, match="after 'sim:' give an index"):
            open_device(bad)
    for bad in ("sim:4parsecs", "sim:0GiB"):
        with pytest.raises(InvalidInputError, match=f"device '{bad}' capacity"):
            open_device(bad)


def test_env_variable_describes_devices(monkeypatch):
    monkeypatch.setenv(gpumem_sim.ENV_VAR, "1GiB, 512MiB")
    devs = gpumem_sim.installed()
    assert [d.capacity for d in devs] == [GiB, 512 * MiB]
    assert [d.device_string for d in devs] == ["sim:0", "sim:1"]
    gpumem_sim.uninstall()
    monkeypatch.setenv(gpumem_sim.ENV_VAR, "  ")
    assert gpumem_sim.installed() == ()


@pytest.mark.parametrize("value, bad", [
    ("16GiB,,8GiB", "item 1"), ("16GiB,lots", "'lots'"), ("0", "'0'"), ("-1GiB", "'-1GiB'"),
    ("4 parsecs", "'4 parsecs'"),
])
def test_malformed_env_variable(monkeypatch, value, bad):
    monkeypatch.setenv(gpumem_sim.ENV_VAR, value)
    with pytest.raises(InvalidInputError) as info:
        gpumem_sim.installed()
    assert gpumem_sim.ENV_VAR in str(info.value) and bad in str(info.value)
    with pytest.raises(InvalidInputError, match=gpumem_sim.ENV_VAR):
        BACKEND.device_count()
    assert BACKEND.availability() == (True, "")


def test_install_replaces_without_touching_old_devices(monkeypatch):
    monkeypatch.setenv(gpumem_sim.ENV_VAR, "1GiB,1GiB,1GiB")
    a, b = SimDevice("1MiB"), SimDevice("2MiB")
    assert gpumem_sim.install(a, b) == (a, b)
    assert (a.device_string, b.device_string) == ("sim:0", "sim:1")
    h, _ = b.alloc_segment(100)
    c = SimDevice("4MiB")
    gpumem_sim.install(c)
    assert gpumem_sim.installed() == (c,)
    assert b.index == 1 and b.live_segments == 1    # the old device still works as it was
    b.free_segment(h)
    gpumem_sim.install(c)                           # same index again: fine
    gpumem_sim.install()
    assert gpumem_sim.installed() == ()
    gpumem_sim.uninstall()
    assert len(gpumem_sim.installed()) == 3         # back to the environment


def test_install_rejects_bad_devices():
    a = SimDevice(MiB)
    with pytest.raises(InvalidInputError, match="twice"):
        gpumem_sim.install(a, a)
    with pytest.raises(InvalidInputError, match="SimDevice"):
        gpumem_sim.install("16GiB")  # type: ignore[arg-type]
    assert a.index == -1                            # a failed install changes nothing
    b = SimDevice(MiB)
    gpumem_sim.install(a, b)
    with pytest.raises(InvalidInputError, match="sim:1"):
        gpumem_sim.install(b)                       # would rename sim:1 to sim:0
    assert gpumem_sim.installed() == (a, b)


def test_using_restores_previous_state(monkeypatch):
    monkeypatch.setenv(gpumem_sim.ENV_VAR, "2GiB")
    outer = SimDevice(MiB)
    gpumem_sim.install(outer)
    with gpumem_sim.using(SimDevice(KiB), SimDevice(2 * KiB)) as devs:
        assert gpumem_sim.installed() == devs and len(devs) == 2
    assert gpumem_sim.installed() == (outer,)
    gpumem_sim.uninstall()
    with gpumem_sim.using(SimDevice(KiB)):
        pass
    assert [d.capacity for d in gpumem_sim.installed()] == [2 * GiB]


def test_backend_adapter():
    assert isinstance(BACKEND, SimBackend) and BACKEND.name == "sim"
    assert get_backend("sim") is BACKEND
    a, b = SimDevice("1GiB"), SimDevice("2GiB", other_process_bytes="1GiB")
    gpumem_sim.install(a, b)
    assert BACKEND.availability() == (True, "")
    assert BACKEND.device_count() == 2
    assert BACKEND.open(1) is b
    assert open_device("sim:0") is a and open_device("sim") is a
    rows = BACKEND.describe()
    assert [(r.device, r.total_memory, r.free_memory, r.simulated) for r in rows] == [
        ("sim:0", GiB, GiB, True), ("sim:1", 2 * GiB, GiB, True)]
    for bad in (2, -1, "0", True):
        with pytest.raises(InvalidDeviceError, match=r"sim:0 \(1.00 GiB\), sim:1 \(2.00 GiB\)"):
            BACKEND.open(bad)
    with pytest.raises(InvalidDeviceError):
        open_device("sim:7")
    gpumem_sim.install()
    assert BACKEND.device_count() == 0
    assert [(r.device, r.available, r.simulated) for r in BACKEND.describe()] == [
        ("sim", False, True)]


# --- threads -------------------------------------------------------------------------------
def test_concurrent_alloc_free_is_consistent():
    dev = SimDevice(8 * MiB, alignment=512, back_memory=True)
    errors: list[BaseException] = []

    def worker(tag: int) -> None:
        try:
            mine = []
            for i in range(200):
                h, _ = dev.alloc_segment(512 + (i % 7) * 100)
                dev.memset(h, 0, tag, 512)
                mine.append(h)
                if i % 3 == 0:
                    dev.free_segment(mine.pop(0))
            for h in mine:
                buf = bytearray(512)
                dev.copy_to_host(h, 0, memoryview(buf))
                assert buf == bytes([tag]) * 512
                dev.free_segment(h)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t + 1,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert dev.live_segments == 0 and dev.mem_get_info() == (8 * MiB, 8 * MiB)
    assert dev.alloc_calls == 1600 and dev.free_calls == 1600
    assert dev.largest_free_range() == 8 * MiB       # everything coalesced back
