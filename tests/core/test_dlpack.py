"""DLPack export of gpumem buffers and views (``__dlpack__``, ``__dlpack_device__``).

Level: real. numpy.from_dlpack is the consumer for host memory (the cpu backend and
CPU-fallback buffers); tests/dlpack_structs.py reads capsules through ctypes from dlpack.h's
layout, written apart from gpumem's Cython structs, and plays a C consumer (rename the capsule
"used_...", call the deleter without the GIL). The cuda capsule is checked the same way on the
fake driver in test_cuda_fake_driver.py.
"""
from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest

import dlpack_structs as dl
from gpumem import BufferInUseError, InvalidInputError, MemoryManager

KDLCPU, KDLCUDA, KDLCUDAHOST = 1, 2, 3

# Every numpy dtype, by type character (np.typecodes["All"]), with a length or unit where
# the type needs one; object ('O') is refused by view() itself.
ALL_DTYPES = [c + {"S": "4", "U": "2", "V": "8", "M": "8[ns]", "m": "8[s]"}.get(c, "")
              for c in np.typecodes["All"] if c != "O"]
# What DLPack can carry: native bool, ints, uints, IEEE floats and complexes; not long double,
# bytes, str, void, datetime, timedelta (numpy's own __dlpack__ refuses the same ones).
DLPACK_KINDS = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}


def _dlpack_ok(dt: np.dtype) -> bool:
    return dt.kind in DLPACK_KINDS and dt.itemsize <= {"f": 8, "c": 16}.get(dt.kind, 8)


@pytest.fixture
def host(make_manager) -> MemoryManager:
    return make_manager("cpu")


def _host_type(buf) -> int:
    """kDLCUDAHost when the segment is pinned (CUDA present, e.g. the fake-driver run)."""
    handle, _ = buf.segment_location()
    return KDLCUDAHOST if buf.manager.device.segment_pinned(handle) else KDLCPU


# --- numpy.from_dlpack: zero-copy, every dtype ----------------------------------------------------
def test_from_dlpack_is_zero_copy(host):
    buf = host.malloc(4096)
    buf.memset(0)
    a = np.from_dlpack(buf.view("float32", (16, 16), offset=1024))
    assert a.shape == (16, 16) and a.ctypes.data == buf.ptr + 1024
    a[:] = np.arange(256, dtype=np.float32).reshape(16, 16)
    got = buf.copy_to_host()[1024:2048].view(np.float32)
    assert np.array_equal(got, np.arange(256, dtype=np.float32))
    whole = np.from_dlpack(buf)                              # the Buffer itself: 1-D uint8
    assert whole.dtype == np.uint8 and whole.shape == (4096,) and whole.ctypes.data == buf.ptr
    assert buf.__dlpack_device__() == (_host_type(buf), 0)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_numpy_dtype(host, dtype):
    """Each dtype numpy has: numpy.asarray (array interface) works for all; numpy.from_dlpack
    for the DLPack-representable ones, with the same bits; the others raise BufferError."""
    dt = np.dtype(dtype)
    buf = host.malloc(64 * dt.itemsize)
    ref = np.random.default_rng(0).integers(0, 256, buf.nbytes, dtype=np.uint8)
    if dt.kind == "b":
        ref %= 2                                             # bools are 0 or 1
    buf.copy_from_host(ref)
    v = buf.view(dt, (8, 8))
    a = np.asarray(v)
    assert a.dtype == dt and a.ctypes.data == buf.ptr
    assert a.tobytes() == ref.tobytes()
    if _dlpack_ok(dt):
        b = np.from_dlpack(v)
        assert b.dtype == dt and b.ctypes.data == buf.ptr and b.tobytes() == ref.tobytes()
    else:
        with pytest.raises(BufferError, match="no DLPack equivalent"):
            v.__dlpack__()
    del a
    assert buf.exports == 1


def test_object_dtype_is_refused(host):
    with pytest.raises(InvalidInputError, match="Python objects"):
        host.malloc(64).view(object)


def test_non_native_byte_order_is_refused_by_dlpack_only(host):
    buf = host.malloc(64)
    buf.copy_from_host(np.arange(16, dtype=">i4").view(np.uint8))
    assert np.array_equal(np.asarray(buf.view(">i4")), np.arange(16))
    with pytest.raises(BufferError, match="no DLPack equivalent"):
        buf.view(">i4").__dlpack__()


# --- the capsule's fields -------------------------------------------------------------------------
@pytest.mark.parametrize("max_version", [None, (0, 8), (1, 0), (2, 3)])
def test_capsule_fields(host, max_version):
    buf = host.malloc(1024)
    v = buf.view("int16", (3, 5), (2, 6), offset=64)
    cap = v.__dlpack__(max_version=max_version)
    versioned = max_version is not None and max_version[0] >= 1
    assert dl.capsule_name(cap) == ("dltensor_versioned" if versioned else "dltensor")
    s = dl.summary(cap)
    assert s["data"] == buf.ptr + 64 and s["byte_offset"] == 0
    assert s["device"] == (_host_type(buf), 0)
    assert (s["ndim"], s["shape"], s["strides"]) == (2, (3, 5), (1, 3))   # strides in elements
    assert s["dtype"] == (0, 16, 1) and s["has_deleter"]
    if versioned:
        assert s["version"] == (1, 0) and s["flags"] == 0


def test_read_only_views_need_a_versioned_capsule(host):
    v = host.malloc(64).view("f4", readonly=True)
    with pytest.raises(BufferError, match="read-only"):
        v.__dlpack__()
    cap = v.__dlpack__(max_version=(1, 0))
    assert dl.summary(cap)["flags"] == 1                     # DLPACK_FLAG_BITMASK_READ_ONLY
    assert not np.from_dlpack(v).flags.writeable


def test_copy_and_device_requests(host):
    buf = host.malloc(64)
    with pytest.raises(BufferError, match="copy=True"):
        buf.__dlpack__(copy=True)
    assert dl.capsule_name(buf.__dlpack__(copy=False)) == "dltensor"
    with pytest.raises(BufferError, match="dl_device"):
        buf.__dlpack__(dl_device=(KDLCUDA, 0))
    cap = buf.__dlpack__(dl_device=(KDLCPU, 0), max_version=(1, 0))   # pinned counts as CPU
    assert dl.summary(cap)["device"] == (KDLCPU, 0)
    assert np.from_dlpack(buf, device="cpu", copy=False).ctypes.data == buf.ptr
    with pytest.raises(TypeError, match="copy must be"):
        buf.__dlpack__(copy="yes")
    del cap
    assert buf.exports == 0


@pytest.mark.parametrize("max_version", [(), (1,), (1, 0, 0), 5, "x", (1.5, 0)])
def test_max_version_that_is_no_pair_of_ints_is_a_type_error(host, max_version):
    """real: a max_version that is not a (major, minor) pair of ints is a TypeError naming it,
    and nothing is exported (``()`` raised IndexError before; found by tests/fuzz/views.py)."""
    buf = host.malloc(64)
    with pytest.raises(TypeError, match="max_version must be None or a \\(major, minor\\)"):
        buf.__dlpack__(max_version=max_version)
    assert buf.exports == 0
    assert dl.capsule_name(buf.__dlpack__(max_version=[1, 0])) == "dltensor_versioned"


# --- lifetime: unconsumed, consumed, no leak ------------------------------------------------------
@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_unconsumed_capsule_releases_everything(host, max_version):
    buf = host.malloc(64)
    v = buf.view()
    refs = sys.getrefcount(v)
    cap = v.__dlpack__(max_version=max_version)
    assert sys.getrefcount(v) == refs + 1 and buf.exports == 1
    with pytest.raises(BufferInUseError):
        buf.free()
    del cap                                                  # never consumed: its destructor
    assert sys.getrefcount(v) == refs                        # calls the deleter
    del v
    assert buf.exports == 0
    buf.free()


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_consumed_capsule_is_released_by_the_consumers_deleter(host, max_version):
    buf = host.malloc(64)
    cap = buf.__dlpack__(max_version=max_version)
    assert buf.exports == 1
    dl.consume(cap)                                          # deleter called without the GIL
    assert buf.exports == 0
    assert dl.capsule_name(cap).startswith("used_")
    del cap                                                  # a used capsule frees nothing
    buf.free()


def test_deleter_called_from_another_thread(host):
    buf = host.malloc(64)
    cap = buf.__dlpack__(max_version=(1, 0))
    t = threading.Thread(target=dl.consume, args=(cap,))
    t.start()
    t.join()
    assert buf.exports == 0


def test_numpy_consumer_keeps_the_buffer_until_its_array_dies(host):
    buf = host.malloc(256)
    a = np.from_dlpack(buf.view("u4"))
    assert buf.exports == 1
    with pytest.raises(BufferInUseError):
        buf.free()
    del a
    gc.collect()
    assert buf.exports == 0
    buf.free()


def test_many_exports_leave_no_references_behind(host):
    buf = host.malloc(4096)
    start = sys.getrefcount(buf)
    for i in range(200):
        kind = i % 4
        if kind == 0:
            np.from_dlpack(buf.view("f8"))
        elif kind == 1:
            buf.__dlpack__()
        elif kind == 2:
            dl.consume(buf.__dlpack__(max_version=(1, 0)))
        else:
            np.asarray(buf)
    gc.collect()
    assert buf.exports == 0 and sys.getrefcount(buf) == start


# --- CPU-fallback buffers and devices without DLPack ----------------------------------------------
def test_fallback_buffer_dlpack(fallback):
    mm, held, fb = fallback
    a = np.from_dlpack(fb.view("int64", (4, 4)))
    a[:] = 42
    assert np.all(fb.copy_to_host()[:128].view(np.int64) == 42)
    assert fb.__dlpack_device__()[0] in (KDLCPU, KDLCUDAHOST)
    assert np.from_dlpack(fb).nbytes == fb.nbytes
    with pytest.raises(BufferInUseError):
        fb.free()
    del a
    gc.collect()
    fb.free()
    held.free()


def test_sim_buffers_have_no_dlpack(manager):
    buf = manager.malloc(64)
    with pytest.raises(BufferError, match="sim:0 buffers have no DLPack device"):
        np.from_dlpack(buf)
    assert buf.exports == 0
    buf.free()
