"""CPU fallback: host memory when the device is exhausted, and migration back to the device.

Data integrity is checked byte for byte: a pattern written into a FallbackBuffer must read back
equal from the device buffer it migrates to. The simulated device backs its segments with host
bytes (``back_memory=True``) so copies work there; the backend-agnostic tests also run on real
backends named in ``GPUMEM_TEST_BACKENDS`` (by default only ``sim``), exhausting the device
through ``gpu_memory_fraction`` rather than by filling it.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import gpumem_sim
from gpumem import Buffer, FallbackBuffer, MemoryConfig, MemoryManager
from gpumem.errors import (DoubleFreeError, ForeignBufferError, InvalidInputError,
                           OutOfMemoryError)
from gpumem_sim import SimDevice
from invariants import EXACT, backend_device, selected_backends, sim_manager

MiB = 1 << 20


pytestmark = pytest.mark.usefixtures("clean_registry")   # see conftest.py


@pytest.fixture(params=selected_backends(default=("sim",)))
def device(request) -> str:
    """A device string on each selected backend (sim: a fresh 4 GiB host-backed device)."""
    return backend_device(request.param, "4GiB", back_memory=True)


def sim(capacity: int = 256 * MiB, **kw) -> tuple[SimDevice, MemoryManager]:
    """``sim_manager`` on a host-backed SimDevice, 256 MiB unless told: EXACT, with CPU
    fallback on."""
    return sim_manager(capacity, back_memory=True, base=dict(EXACT, cpu_fallback_enabled=True),
                       **kw)


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_fallback_under_injected_faults_keeps_data_on_migrate():
    dev, mm = sim(expandable_segments=False)  # plain segments: fail_after faults alloc_segment
    dev.inject(fail_after=0)
    fb = mm.malloc(3 * MiB + 123, tag="kv")
    assert isinstance(fb, FallbackBuffer)
    assert fb.location == "cpu" and fb.device == "cpu" and fb.alive and fb.tag == "kv"
    data = pattern(fb.nbytes, 1)
    fb.copy_from_host(data)
    assert np.array_equal(np.asarray(fb), data)        # host memory: a numpy view
    st = mm.stats()
    assert st.cpu_fallbacks == 1 and st.fallback_bytes == fb.nbytes and st.active_buffers == 1
    dev.clear_faults()                                  # room on the device again
    buf = fb.migrate_to_device()
    assert type(buf) is Buffer and buf.location == "device" and buf.device == "sim:0"
    assert buf.nbytes == 3 * MiB + 123 and buf.tag == "kv"
    assert np.array_equal(buf.copy_to_host(), data)
    assert not fb.alive
    st = mm.stats()
    assert st.cpu_fallbacks == 1                       # a count of events, kept
    assert st.fallback_bytes == 0
    mm.pool.check_invariants()


def test_fallback_when_device_full_then_make_room_and_migrate():
    dev, mm = sim(256 * MiB)
    held = [mm.malloc(100 * MiB), mm.malloc(100 * MiB)]
    fb = mm.malloc(100 * MiB)                           # does not fit: host memory
    assert isinstance(fb, FallbackBuffer)
    data = pattern(fb.nbytes, 2)
    fb.copy_from_host(data)
    with pytest.raises(OutOfMemoryError):
        fb.migrate_to_device()                          # still no room: nothing changes
    assert fb.alive and np.array_equal(fb.copy_to_host(), data)
    assert mm.stats().fallback_bytes == 100 * MiB
    held.pop().free()
    buf = fb.migrate_to_device()
    assert np.array_equal(buf.copy_to_host(), data)
    assert mm.stats().fallback_bytes == 0 and mm.stats().active_buffers == 2


def test_fallback_buffer_takes_record_stream_like_a_buffer():
    dev, mm = sim(256 * MiB)
    held = [mm.malloc(100 * MiB), mm.malloc(100 * MiB)]
    fb = mm.malloc(100 * MiB)
    assert isinstance(fb, FallbackBuffer)
    s = dev.create_stream()
    fb.record_stream(s)                                 # host memory: nothing to wait for
    with pytest.raises(InvalidInputError, match="not a stream of"):
        fb.record_stream(9999)
    fb.free()
    assert mm.pending_free_bytes == 0 and mm.stats().fallback_bytes == 0
    with pytest.raises(InvalidInputError, match="has been freed"):
        fb.record_stream(s)
    for b in held:
        b.free()


def test_migrate_never_falls_back_again():
    dev, mm = sim()
    dev.inject(fail_after=0)
    fb = mm.malloc(MiB)
    with pytest.raises(OutOfMemoryError):
        fb.migrate_to_device()
    assert mm.stats().cpu_fallbacks == 1                # no second fallback
    assert fb.alive


def test_fallback_on_backend(device: str):
    """Exhaust usable memory through gpu_memory_fraction on any backend, fall back, make
    room, migrate, and compare bytes."""
    probe = MemoryManager(device, MemoryConfig(min_free_bytes=0))
    total = probe.total_memory
    probe.close()
    fraction = min(1.0, 64 * MiB / total)
    mm = MemoryManager(device, MemoryConfig(min_free_bytes=0, gpu_memory_fraction=fraction,
                                            reserve_bytes=0))
    try:
        usable = mm.usable_memory
        big = mm.malloc(usable * 3 // 4)
        fb = mm.malloc(usable // 2)
        assert isinstance(fb, FallbackBuffer)
        data = pattern(fb.nbytes, 3)
        fb.copy_from_host(data)
        big.free()
        mm.empty_cache()
        buf = fb.migrate_to_device()
        assert buf.device == mm.device_string
        assert np.array_equal(buf.copy_to_host(), data)
        assert mm.stats().cpu_fallbacks == 1
        buf.free()
    finally:
        mm.close()


def test_with_cpu_fallback_false_makes_oom_raise():
    dev, mm = sim()
    mm2 = MemoryManager("sim:0", mm.config.with_cpu_fallback(False))
    dev.inject(fail_after=0)
    with pytest.raises(OutOfMemoryError, match="CPU fallback is disabled"):
        mm2.malloc(MiB)
    assert mm2.stats().cpu_fallbacks == 0 and mm2.stats().num_ooms == 1
    assert isinstance(mm.malloc(MiB), FallbackBuffer)   # the same device, fallback on


def test_migrate_of_freed_buffer_is_invalid():
    dev, mm = sim()
    dev.inject(fail_after=0)
    fb = mm.malloc(MiB)
    fb.free()
    dev.clear_faults()
    with pytest.raises(InvalidInputError, match="freed"):
        fb.migrate_to_device()
    assert mm.stats().active_buffers == 0 and mm.stats().fallback_bytes == 0


def test_migrated_buffer_cannot_migrate_again():
    dev, mm = sim()
    dev.inject(fail_after=0)
    fb = mm.malloc(MiB)
    dev.clear_faults()
    fb.migrate_to_device()
    with pytest.raises(InvalidInputError):
        fb.migrate_to_device()


def test_fallback_free_rules():
    dev, mm = sim()
    other_dev = SimDevice(64 * MiB)
    gpumem_sim.install(dev, other_dev)
    other = MemoryManager("sim:1", MemoryConfig(min_free_bytes=0))
    dev.inject(fail_after=0)
    fb = mm.malloc(MiB)
    with pytest.raises(ForeignBufferError):
        other.free(fb)
    mm.free(fb)                                         # through the manager
    with pytest.raises(DoubleFreeError):
        fb.free()
    with mm.malloc(MiB) as fb2:                         # context manager
        assert fb2.alive
    assert not fb2.alive
    assert mm.stats().fallback_bytes == 0 and mm.stats().active_buffers == 0


def test_dropped_fallback_buffer_is_accounted():
    dev, mm = sim()
    dev.inject(fail_after=0)
    fb = mm.malloc(MiB)
    assert mm.stats().fallback_bytes == MiB
    del fb
    gc.collect()
    assert mm.stats().fallback_bytes == 0 and mm.stats().active_buffers == 0


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_many_fallbacks_under_random_faults_keep_their_data(expandable):
    """Random driver refusals (of new segments, or with expandable segments of new pages):
    every request is served, on the device or the CPU, keeps its bytes and moves back once
    the faults stop (level real: sim with host-backed memory)."""
    dev, mm = sim(1024 * MiB, seed=3, expandable_segments=expandable)
    if expandable:
        dev.inject_vm(create_rate=0.15)   # per page: a 12 MiB request makes 6 of them
    else:
        dev.inject(fail_rate=0.6)
    bufs = [mm.malloc(12 * MiB + i * 4096) for i in range(24)]
    datas = []
    for i, b in enumerate(bufs):
        d = pattern(b.nbytes, 100 + i)
        b.copy_from_host(d)
        datas.append(d)
    fallbacks = [b for b in bufs if isinstance(b, FallbackBuffer)]
    assert fallbacks and len(fallbacks) < len(bufs)
    assert mm.stats().cpu_fallbacks == len(fallbacks)
    dev.clear_faults()
    dev.inject_vm(create_rate=0.0)
    moved = [b.migrate_to_device() if isinstance(b, FallbackBuffer) else b for b in bufs]
    for b, d in zip(moved, datas):
        assert type(b) is Buffer
        assert np.array_equal(b.copy_to_host(), d)
    assert mm.stats().fallback_bytes == 0
    mm.pool.check_invariants()


def test_fallback_disabled_by_env():
    dev = SimDevice(64 * MiB)
    gpumem_sim.install(dev)
    cfg = MemoryConfig.from_env({"GPUMEM_CPU_FALLBACK_ENABLED": "0", "GPUMEM_MIN_FREE_BYTES": "0"})
    mm = MemoryManager("sim:0", cfg)
    with pytest.raises(OutOfMemoryError):
        mm.malloc(100 * MiB)


# --- visible fallback (issue 15 item 3) -----------------------------------------------------------
def test_first_fallback_warns_once_with_a_filterable_category():
    """real (sim): the first fallback of a manager emits a CpuFallbackWarning (a GpumemWarning,
    a UserWarning) pointing at the caller's line; the second does not warn again."""
    import warnings

    from gpumem import CpuFallbackWarning, GpumemWarning
    dev, mm = sim()
    hold = mm.malloc(200 * MiB)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fb1 = mm.malloc(100 * MiB)
        fb2 = mm.malloc(100 * MiB)
    assert isinstance(fb1, FallbackBuffer) and isinstance(fb2, FallbackBuffer)
    ours = [w for w in rec if issubclass(w.category, GpumemWarning)]
    assert len(ours) == 1 and ours[0].category is CpuFallbackWarning
    assert issubclass(CpuFallbackWarning, UserWarning)
    assert ours[0].filename == __file__
    assert "fallback=False" in str(ours[0].message)
    for b in (fb1, fb2, hold):
        b.free()


def test_fallback_warning_as_error_leaves_nothing_allocated():
    """real (sim): with the category turned into an error, malloc raises it and no host
    memory is handed out (stats unchanged); the device buffers are untouched."""
    import warnings

    from gpumem import CpuFallbackWarning
    dev, mm = sim()
    hold = mm.malloc(200 * MiB)
    before = mm.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CpuFallbackWarning)
        with pytest.raises(CpuFallbackWarning):
            mm.malloc(100 * MiB)
    after = mm.stats()
    assert (after.cpu_fallbacks, after.fallback_bytes, after.active_buffers) == (
        before.cpu_fallbacks, before.fallback_bytes, before.active_buffers)
    hold.free()


def test_malloc_fallback_false_raises_oom_instead_of_host_memory():
    """real (sim): malloc(..., fallback=False) refuses the CPU fallback for that call only;
    the reason says so; the next plain malloc still falls back. A non-bool is refused."""
    dev, mm = sim()
    hold = mm.malloc(200 * MiB)
    with pytest.raises(OutOfMemoryError, match="fallback=False"):
        mm.malloc(100 * MiB, fallback=False)
    assert mm.stats().cpu_fallbacks == 0
    small = mm.malloc(4096, fallback=False)          # a hit is served as usual
    assert isinstance(small, Buffer)
    with pytest.warns(UserWarning):
        fb = mm.malloc(100 * MiB)
    assert isinstance(fb, FallbackBuffer)
    with pytest.raises(InvalidInputError, match="fallback must be True or False"):
        mm.malloc(4096, fallback=0)
    for b in (fb, small, hold):
        b.free()


def test_buffer_and_fallback_buffer_share_one_public_base():
    """real (sim): isinstance(x, gpumem.AnyBuffer) holds for a device Buffer and a
    FallbackBuffer, and not for other objects."""
    from gpumem import AnyBuffer
    dev, mm = sim()
    dev_buf = mm.malloc(200 * MiB)
    with pytest.warns(UserWarning):
        fb = mm.malloc(100 * MiB)
    assert isinstance(dev_buf, AnyBuffer) and isinstance(fb, AnyBuffer)
    assert not isinstance(b"x", AnyBuffer)
    fb.free()
    dev_buf.free()
