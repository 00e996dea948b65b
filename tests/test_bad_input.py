"""Misuse raises one specific error and leaves the manager exactly as it was: the same stats
(apart from ``num_ooms``, which counts out-of-memory errors), the same segments and blocks,
and no driver traffic."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpumem_sim
from gpumem import (ClosedManagerError, DoubleFreeError, ForeignBufferError, InvalidDeviceError,
                    InvalidInputError, MemoryConfig, MemoryManager, OutOfMemoryError)
from invariants import check, snapshot_state

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def busy(make_manager):
    """A manager with live buffers and cached blocks, so "unchanged" means something."""
    mm = make_manager()
    live = [mm.malloc(n) for n in (100, 5000, 3 * MiB, 12 * MiB)]
    mm.malloc(700_000).free()
    mm.malloc(40 * MiB).free()
    check(mm, live)
    return mm, live


class Unchanged:
    """``with Unchanged(mm, ooms=1):`` asserts the state (and the sim driver's call count) is
    the same afterwards, and that num_ooms grew by `ooms`."""

    def __init__(self, mm, *, ooms: int = 0) -> None:
        self.mm = mm
        self.ooms = ooms

    def __enter__(self):
        self.state = snapshot_state(self.mm)
        self.num_ooms = self.mm.stats().num_ooms
        self.calls = len(self.mm.device.calls)
        self.alloc_calls = self.mm.device.alloc_calls
        return self

    def __exit__(self, *exc):
        assert snapshot_state(self.mm) == self.state, "a failed call changed the manager's state"
        assert self.mm.stats().num_ooms == self.num_ooms + self.ooms
        assert self.mm.device.alloc_calls == self.alloc_calls, "a failed call asked the driver"
        assert len(self.mm.device.calls) == self.calls
        return False


# --- sizes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [-1, -4096, -(1 << 70), np.int64(-1)])
def test_negative_size(busy, n):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(InvalidInputError, match="nbytes"):
            mm.malloc(n)
    check(mm, live)


@pytest.mark.parametrize("n", [1.0, 1.5, float("nan"), "100", "1MiB", None, b"1", [1], 1j,
                               np.float64(8.0)])
def test_non_integer_size(busy, n):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(TypeError):
            mm.malloc(n)
    check(mm, live)


@pytest.mark.parametrize("n", [True, False, np.bool_(True)])
def test_bool_size(busy, n):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(TypeError):
            mm.malloc(n)


@pytest.mark.parametrize("n", [np.int64(100), np.uint32(4096), np.int8(5), np.uint64(3 * MiB)])
def test_numpy_integer_size_is_accepted(busy, n):
    mm, live = busy
    buf = mm.malloc(n)
    assert buf.nbytes == int(n) and type(buf.nbytes) is int
    check(mm, live + [buf])


class Index:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def test_index_protocol_size_is_accepted(busy):
    mm, live = busy
    buf = mm.malloc(Index(1000))
    assert buf.nbytes == 1000
    with Unchanged(mm):
        with pytest.raises(InvalidInputError):
            mm.malloc(Index(-3))
    check(mm, live + [buf])


class IntSubclass(int):
    pass


@pytest.mark.parametrize("n, error, match", [
    (-1, InvalidInputError, "nbytes must be >= 0, got -1"),
    (-(1 << 70), InvalidInputError, "nbytes must be >= 0"),      # overflows a C long long
    (IntSubclass(-5), InvalidInputError, "nbytes must be >= 0, got -5"),
    (True, TypeError, "nbytes must be an int, got bool"),
    (2.0, TypeError, "nbytes must be an int, got float"),
])
def test_size_checks_around_the_positional_fast_path(busy, n, error, match):
    """real (sim): malloc reads an exact int with C compares only (no Python int per call);
    every value that path does not take still gets the specific error and no state change."""
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(error, match=match):
            mm.malloc(n)
    check(mm, live)


@pytest.mark.parametrize("n", [0, 1, 4096, IntSubclass(4096)])
def test_sizes_on_and_beside_the_fast_path_allocate(busy, n):
    """real (sim): exact ints and int subclasses give a buffer of exactly that many bytes."""
    mm, live = busy
    buf = mm.malloc(n)
    assert buf.nbytes == n
    check(mm, live + [buf])
    buf.free()


@pytest.mark.parametrize("n", [4 * GiB + 1, 8 * GiB, 1 << 62, 1 << 64, 1 << 200])
def test_size_above_capacity_fails_at_once(busy, n):
    mm, live = busy
    with Unchanged(mm, ooms=1):
        with pytest.raises(OutOfMemoryError) as info:
            mm.malloc(n)
    assert info.value.requested >= min(n, 1 << 62)
    assert "total memory" in str(info.value)
    check(mm, live)


def test_size_above_capacity_fails_at_once_even_with_fallback(sim_device, make_manager):
    sim_device("1GiB")
    mm = make_manager(cpu_fallback_enabled=True)
    live = [mm.malloc(4096)]
    with Unchanged(mm, ooms=1):
        with pytest.raises(OutOfMemoryError):
            mm.malloc(2 * GiB)
    assert mm.stats().cpu_fallbacks == 0
    check(mm, live)


def test_oom_message_names_every_quantity(sim_device, make_manager):
    sim_device("256MiB")
    mm = make_manager()
    live = [mm.malloc(100 * MiB)]
    mm.malloc(4096).free()
    with pytest.raises(OutOfMemoryError) as info:
        mm.malloc(200 * MiB)
    msg = str(info.value)
    for word in ("requested", "free", "total", "in use", "cached", "limit"):
        assert word in msg, (word, msg)
    assert "200.00 MiB" in msg and "256.00 MiB" in msg and "sim:0" in msg
    e = info.value
    assert (e.requested, e.total, e.in_use) == (200 * MiB, 256 * MiB, 100 * MiB)
    assert e.free is not None and e.cached is not None and e.limit == 256 * MiB
    check(mm, live)


# --- freeing -------------------------------------------------------------------------------------------
def test_double_free_via_buffer(busy):
    mm, live = busy
    buf = mm.malloc(4096)
    buf.free()
    with Unchanged(mm):
        with pytest.raises(DoubleFreeError):
            buf.free()
        with pytest.raises(DoubleFreeError):
            mm.free(buf)
    assert isinstance(DoubleFreeError("x"), InvalidInputError)
    check(mm, live)


def test_double_free_after_block_was_reused(busy):
    """The stale buffer must not free the block now owned by a newer buffer."""
    mm, live = busy
    old = mm.malloc(4096)
    ptr = old.ptr
    mm.free(old)
    new = mm.malloc(4096)
    assert new.ptr == ptr
    with Unchanged(mm):
        with pytest.raises(DoubleFreeError):
            mm.free(old)
    assert new.alive
    check(mm, live + [new])


def test_freeing_a_buffer_of_another_manager(sim_device, make_manager):
    sim_device("1GiB", count=2)
    a, b = make_manager("sim:0"), make_manager("sim:1")
    same_dev = make_manager("sim:0")
    buf = a.malloc(4096)
    for other in (b, same_dev):
        with Unchanged(other), Unchanged(a):
            with pytest.raises(ForeignBufferError):
                other.free(buf)
    assert buf.alive
    check(a, [buf])
    check(b, [])


def test_freeing_a_fallback_buffer_of_another_manager(sim_device, make_manager):
    sim_device("16MiB")
    a = make_manager(cpu_fallback_enabled=True)
    b = make_manager(cpu_fallback_enabled=True)
    hold = a.malloc(12 * MiB)
    fb = a.malloc(8 * MiB)
    assert fb.location == "cpu"
    with Unchanged(b):
        with pytest.raises(ForeignBufferError):
            b.free(fb)
    assert fb.alive
    check(a, [hold, fb])


def test_freeing_after_close(busy):
    mm, live = busy
    mm.close()
    with pytest.raises(ClosedManagerError):
        live[0].free()
    with pytest.raises(ClosedManagerError):
        mm.free(live[1])
    with pytest.raises(InvalidInputError):          # ClosedManagerError is an InvalidInputError
        mm.free(live[2])
    with pytest.raises(ClosedManagerError):
        mm.malloc(1)


@pytest.mark.parametrize("obj", [42, None, object(), "buffer", memoryview(b"abc"),
                                 np.zeros(4, np.uint8)])
def test_free_of_a_non_buffer(busy, obj):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(TypeError):
            mm.free(obj)
    check(mm, live)


def test_freed_buffer_refuses_data_access(busy):
    mm, live = busy
    buf = mm.malloc(4096)
    buf.free()
    with Unchanged(mm):
        for call in (lambda: buf.copy_to_host(), lambda: buf.copy_from_host(b"x"),
                     lambda: buf.memset(1), lambda: buf.segment_location()):
            with pytest.raises(InvalidInputError):
                call()
    check(mm, live)


@pytest.mark.parametrize("value", [256, -1, 1000])
def test_memset_value_out_of_range(busy, value):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises((InvalidInputError, OverflowError)):
            live[0].memset(value)


def test_copy_larger_than_the_buffer(busy):
    mm, live = busy
    buf = live[0]                                   # 100 bytes
    with Unchanged(mm):
        with pytest.raises(InvalidInputError):
            buf.copy_from_host(bytes(101))
        with pytest.raises(InvalidInputError):
            buf.copy_to_host(np.empty(101, np.uint8))
    buf.copy_from_host(bytes(range(100)))
    assert bytes(buf.copy_to_host()) == bytes(range(100))


# --- streams -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream, exc", [
    (-1, InvalidInputError), (12345, InvalidInputError), ("s", TypeError), (1.5, TypeError),
    (True, TypeError), (object(), TypeError), (np.int64(-2), InvalidInputError),
    (1 << 64, (InvalidInputError, TypeError)), (1 << 100, (InvalidInputError, TypeError))])
def test_bad_stream_handle(busy, stream, exc):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(exc):
            mm.malloc(4096, stream=stream)
    check(mm, live)


def test_bad_stream_object_handle(busy):
    mm, live = busy

    class S:
        handle = "not an int"

    class Neg:
        handle = -5

    with Unchanged(mm):
        with pytest.raises(TypeError):
            mm.malloc(4096, stream=S())
        with pytest.raises(InvalidInputError):
            mm.malloc(4096, stream=Neg())


def test_destroyed_stream_is_rejected(busy):
    mm, live = busy
    s = mm.device.create_stream()
    mm.device.destroy_stream(s)
    with Unchanged(mm):
        with pytest.raises(InvalidInputError):
            mm.malloc(4096, stream=s)


def test_stream_of_another_device_is_rejected(sim_device, make_manager):
    """A stream made on sim:1 is not a stream of sim:0: refused, nothing changes on sim:0."""
    sim_device("1GiB", count=2)
    mm = make_manager("sim:0")
    keep = mm.malloc(4096)
    other = gpumem_sim.installed()[1]
    foreign = [other.create_stream() for _ in range(3)][-1]   # no such handle on sim:0
    with Unchanged(mm):
        with pytest.raises(InvalidInputError, match="not a stream of sim:0"):
            mm.malloc(4096, stream=foreign)
    check(mm, [keep])


# --- devices ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["tpu:0", "gpu", "", "sim0", "cuda0"])
def test_unknown_device_string(sim_device, device):
    sim_device("1GiB")
    with pytest.raises(InvalidDeviceError) as info:
        MemoryManager(device, MemoryConfig())
    assert "sim:0" in str(info.value)                 # lists the devices that exist


@pytest.mark.parametrize("device", ["sim:99", "sim:1", "sim:x", "sim:-1", "sim:1.0"])
def test_sim_index_out_of_range(sim_device, device):
    dev = sim_device("1GiB")
    with pytest.raises(InvalidDeviceError):
        MemoryManager(device, MemoryConfig())
    assert dev.alloc_calls == 0


@pytest.mark.parametrize("device", [42, 1.5, object()])     # None: the default device
def test_device_of_wrong_type(sim_device, device):
    sim_device("1GiB")
    with pytest.raises((InvalidInputError, InvalidDeviceError)):
        MemoryManager(device, MemoryConfig())


def test_config_of_wrong_type(sim_device):
    sim_device("1GiB")
    with pytest.raises(InvalidInputError):
        MemoryManager("sim:0", {"gpu_memory_fraction": 0.5})


@pytest.mark.parametrize("value", ["abc", "16GiB,,8GiB", "-1GiB", "0", "1.5B", "16 parsecs",
                                   "16GiB;8GiB"])
def test_malformed_sim_devices_env(sim_device, monkeypatch, value):
    gpumem_sim.uninstall()
    monkeypatch.setenv(gpumem_sim.ENV_VAR, value)
    with pytest.raises(InvalidInputError) as info:
        MemoryManager("sim:0", MemoryConfig())
    assert gpumem_sim.ENV_VAR in str(info.value)
    gpumem_sim.uninstall()


def test_sim_devices_env_is_read(sim_device, monkeypatch):
    gpumem_sim.uninstall()
    monkeypatch.setenv(gpumem_sim.ENV_VAR, "1GiB, 512MiB")
    mm = MemoryManager("sim:1", MemoryConfig(min_free_bytes=0))
    assert mm.total_memory == 512 * MiB
    mm.close()
    gpumem_sim.uninstall()


@pytest.mark.parametrize("capacity", ["abc", "-5", -5, 0, "0GiB", "1.5B", "12 parsecs", None,
                                      1.5, True])
def test_bad_sim_capacity(capacity):
    with pytest.raises(InvalidInputError):
        gpumem_sim.SimDevice(capacity)


# --- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0, 0.0, 1.5, -0.1, float("nan"), float("inf"), True, False,
                                      "0.5", None])
def test_bad_gpu_memory_fraction(fraction):
    with pytest.raises(InvalidInputError, match="gpu_memory_fraction"):
        MemoryConfig(gpu_memory_fraction=fraction)


@pytest.mark.parametrize("value", [-1, -GiB, 1.5, "1 gig", "-1GiB", True])
def test_bad_min_free_bytes(value):
    with pytest.raises(InvalidInputError, match="min_free_bytes"):
        MemoryConfig(min_free_bytes=value)


def test_bad_config_on_an_existing_manager_changes_nothing(busy):
    mm, live = busy
    with Unchanged(mm):
        with pytest.raises(InvalidInputError):
            mm.config.replace(gpu_memory_fraction=math.nan)
        with pytest.raises(InvalidInputError):
            mm.set_max_pool_size(-5)
    check(mm, live)
