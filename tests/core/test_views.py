"""Typed zero-copy views (Buffer.view) and the array interfaces built on them.

Level: real (numpy on host memory of the cpu backend and of CPU-fallback buffers, the real
pool). The per-backend test runs on each backend of GPUMEM_TEST_BACKENDS; in ci/test.sh's second
run that is cuda on tests/fake_cuda (fake driver level), where __cuda_array_interface__ is
checked.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import gpumem
from gpumem import BufferInUseError, InvalidInputError, MemoryManager
from gpumem._core.view import BufferView

KiB = 1 << 10


@pytest.fixture
def host(make_manager) -> MemoryManager:
    return make_manager("cpu")


def _bytes(buf) -> np.ndarray:
    return buf.copy_to_host()


# --- shapes, strides, offsets --------------------------------------------------------------
def test_default_view_is_the_whole_buffer_as_bytes(host):
    buf = host.malloc(100)
    v = buf.view()
    assert (v.dtype, v.shape, v.strides, v.offset, v.nbytes) == (np.dtype("u1"), (100,), (1,),
                                                                 0, 100)
    assert v.ptr == buf.ptr and v.c_contiguous and v.buffer is buf


@pytest.mark.parametrize("dtype, shape, strides, offset", [
    ("float32", (4, 8), None, 0),
    ("int16", (3, 5), (2, 6), 64),              # Fortran order
    ("float64", (4,), (-8,), 24),               # reversed: element 0 is the last one
    ("uint32", (2, 3), (24, 8), 4),             # every other element
    ("complex64", (0, 5), None, 256),           # empty, offset at the end
    ("int8", (), None, 7),                      # 0-d
])
def test_view_reads_the_bytes_numpy_would(host, dtype, shape, strides, offset):
    """np.asarray(view) equals numpy's own strided view of the same bytes."""
    buf = host.malloc(256)
    pattern = (np.arange(256) * 7 % 251).astype(np.uint8)
    buf.copy_from_host(pattern)
    v = buf.view(dtype, shape, strides, offset)
    arr = np.asarray(v)
    dt = np.dtype(dtype)
    expect = np.ndarray(shape, dt, buffer=pattern, offset=offset, strides=v.strides)
    assert arr.shape == tuple(shape) and arr.dtype == dt
    assert np.array_equal(arr, expect)
    assert arr.ctypes.data == buf.ptr + offset               # zero-copy


def test_writes_through_numpy_are_seen_by_copy_to_host(host):
    buf = host.malloc(4 * KiB)
    buf.memset(0)
    a = np.asarray(buf.view("float32", (32, 32)))
    a[:] = np.arange(1024, dtype=np.float32).reshape(32, 32)
    assert np.array_equal(_bytes(buf).view(np.float32), np.arange(1024, dtype=np.float32))
    b = np.asarray(buf)                                      # Buffer's own interface
    b[:4] = 0xAB
    assert bytes(_bytes(buf)[:4]) == b"\xab" * 4


def test_read_only_view(host):
    """readonly=True reaches numpy through both interfaces of a view."""
    buf = host.malloc(64)
    v = buf.view("int32", readonly=True)
    assert not np.asarray(v).flags.writeable and v.__array_interface__["data"][1] is True
    assert np.asarray(buf.view()).flags.writeable


def test_numpy_keeps_the_view_as_base(host):
    """numpy holds what keeps the memory: the view for a view, the view's bytes object for
    the Buffer's own interface (which holds the view)."""
    buf = host.malloc(64)
    a = np.asarray(buf.view("u2", (4, 8)))
    assert isinstance(a.base, BufferView) and a.shape == (4, 8)
    b = np.asarray(buf)
    assert b.shape == (64,) and b.ctypes.data == buf.ptr and buf.exports == 2


# --- bad arguments: InvalidInputError naming the argument, nothing changes ----------------------
@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(dtype="no-such-type"), InvalidInputError, "dtype"),
    (dict(dtype=object), InvalidInputError, "dtype"),
    (dict(dtype="S"), InvalidInputError, "no size"),
    (dict(dtype=("f4", (2,))), InvalidInputError, "sub-array"),
    (dict(offset=-1), InvalidInputError, "offset must be in"),
    (dict(offset=129), InvalidInputError, "offset must be in"),
    (dict(dtype="f8", offset=4), InvalidInputError, "alignment"),
    (dict(offset=1.0), TypeError, "offset must be an int"),
    (dict(offset=True), TypeError, "offset must be an int"),
    (dict(shape=(-1,)), InvalidInputError, "shape must not be negative"),
    (dict(shape=129), InvalidInputError, "outside the buffer's 128 bytes"),
    (dict(dtype="f4", shape=(4, 9)), InvalidInputError, "outside the buffer's 128 bytes"),
    (dict(shape=(2**40, 2**40)), InvalidInputError, "than memory can address"),
    (dict(shape=(2**70,)), InvalidInputError, "than memory can address"),
    (dict(shape=(3,), strides=(2**61,)), InvalidInputError, "outside the buffer's 128"),
    (dict(shape=(2**61, 2), strides=(0, -2**62 + 1)), InvalidInputError, "outside the"),
    (dict(shape=(1,) * 65), InvalidInputError, "at most 64"),
    (dict(shape=(2, "3")), TypeError, "shape must hold ints"),
    (dict(shape=True), TypeError, "not a bool"),
    (dict(shape=2.0), TypeError, "shape must be an int"),
    (dict(strides=(1,)), InvalidInputError, "strides given without shape"),
    (dict(shape=(2, 2), strides=(1,)), InvalidInputError, "one byte stride per dimension"),
    (dict(dtype="i4", shape=(4,), strides=(6,)), InvalidInputError, "multiples of the item"),
    (dict(shape=(2,), strides=(-1,)), InvalidInputError, "outside the buffer's 128"),
    (dict(shape=(16,), strides=(9,)), InvalidInputError, "outside the buffer's 128 bytes"),
])
def test_bad_view_arguments(host, kwargs, exc, words):
    buf = host.malloc(128)
    in_use = host.pool.in_use_bytes
    with pytest.raises(exc, match=words):
        buf.view(**kwargs)
    assert buf.exports == 0 and buf.alive and host.pool.in_use_bytes == in_use
    buf.free()


def test_views_cannot_be_built_directly():
    with pytest.raises(TypeError, match="Buffer.view"):
        BufferView()
    with pytest.raises(TypeError, match="made of gpumem Buffers"):
        BufferView._of(bytearray(8), "u1", None, None, 0, False)


def test_view_of_a_freed_buffer(host):
    buf = host.malloc(64)
    buf.free()
    with pytest.raises(InvalidInputError, match="freed"):
        buf.view()


# --- lifetime: free() refused while views live; a dropped buffer waits for its views ------------
def test_free_is_refused_while_a_view_or_array_lives(host):
    buf = host.malloc(1024)
    arr = np.asarray(buf.view("float64"))                    # only the array holds the view
    assert buf.exports == 1
    before = host.pool.in_use_bytes
    with pytest.raises(BufferInUseError, match="1 view"):
        buf.free()
    with pytest.raises(BufferInUseError):
        host.free(buf)
    assert buf.alive and host.pool.in_use_bytes == before    # nothing changed
    arr[:] = 1.5                                             # the memory is still ours
    del arr
    assert buf.exports == 0
    buf.free()
    assert not buf.alive and host.pool.in_use_bytes == before - 1024


def test_arrays_from_the_buffers_own_interface_count_too(host):
    buf = host.malloc(64)
    a = np.asarray(buf)
    assert buf.exports == 1
    with pytest.raises(BufferInUseError):
        buf.free()
    del a
    buf.free()


def test_leaving_a_with_block_with_a_live_view_frees_after_the_last_view(host):
    """`with mm.malloc(n) as buf: a = np.asarray(buf)` must not fail at the end of the block:
    the block goes back to the pool when the last array made from it dies, never under it."""
    in_use = host.pool.in_use_bytes
    with host.malloc(64) as buf:
        a = np.asarray(buf.view("uint8"))
        a[:] = 7
    assert buf.alive and host.pool.in_use_bytes > in_use     # still owned by `a`
    assert bytes(buf.copy_to_host()[:4]) == b"\x07" * 4
    del a
    gc.collect()
    assert not buf.alive and host.pool.in_use_bytes == in_use
    with pytest.raises(gpumem.DoubleFreeError):
        buf.free()


def test_a_dropped_buffer_goes_back_with_its_last_view(host):
    buf = host.malloc(4096)
    in_use = host.pool.in_use_bytes
    arr = np.asarray(buf.view("int32"))
    del buf
    gc.collect()
    assert host.pool.in_use_bytes == in_use                  # the array still owns the block
    arr[:] = 7
    del arr
    gc.collect()
    assert host.pool.in_use_bytes == in_use - 4096


def test_view_survives_and_refcounts_return(host):
    import sys
    buf = host.malloc(64)
    start = sys.getrefcount(buf)
    views = [buf.view("u2") for _ in range(10)]
    assert buf.exports == 10 and sys.getrefcount(buf) == start + 10
    del views
    assert buf.exports == 0 and sys.getrefcount(buf) == start


# --- CPU fallback buffers ------------------------------------------------------------------------
def test_fallback_buffer_views(fallback):
    mm, held, fb = fallback
    assert isinstance(fb, gpumem.FallbackBuffer)
    a = np.asarray(fb.view("float32", (16, 16)))
    a[:] = 3.0
    assert np.all(fb.copy_to_host()[:1024].view(np.float32) == 3.0)
    whole = np.asarray(fb)
    assert whole.nbytes == fb.nbytes and fb.exports == 2
    with pytest.raises(BufferInUseError):
        fb.free()
    with pytest.raises(BufferInUseError):
        fb.migrate_to_device()
    assert fb.alive and mm.stats().fallback_bytes == fb.nbytes
    del a, whole
    fb.free()
    held.free()
    assert mm.stats().fallback_bytes == 0


# --- each backend: which protocols it offers ------------------------------------------------------
def test_protocols_offered_by_each_backend(backend_manager):
    """Host memory: __array_interface__ and the buffer protocol; cuda: the CUDA array
    interface (v3, with the stream); sim and OpenCL memory is not addressable by either, so
    they raise AttributeError (hasattr is False) and DLPack raises BufferError."""
    mm = backend_manager
    backend = mm.device.backend
    buf = mm.malloc(4096)
    v = buf.view("float32", (8, 16), (4, 32), offset=64)
    assert buf.exports == 1
    assert hasattr(v, "__array_interface__") == hasattr(buf, "__array_interface__") \
        == (backend == "cpu")
    assert hasattr(v, "__cuda_array_interface__") == (backend == "cuda")
    if backend == "cuda":
        s = mm.device.create_stream()
        on_s = mm.malloc(256, stream=s)
        cai = v.__cuda_array_interface__
        assert cai == {"shape": (8, 16), "typestr": "<f4", "data": (buf.ptr + 64, False),
                       "strides": (4, 32), "version": 3, "stream": 1}
        assert buf.__cuda_array_interface__["strides"] is None
        assert on_s.__cuda_array_interface__["stream"] == s
        on_s.free()
        mm.device.destroy_stream(s)
    if backend in ("sim", "opencl"):
        with pytest.raises(BufferError, match="no DLPack device"):
            v.__dlpack__()
        with pytest.raises(BufferError, match="no DLPack device"):
            buf.__dlpack_device__()
    with pytest.raises(BufferInUseError):
        buf.free()
    del v
    buf.free()


def test_views_of_a_closed_manager_refuse_their_protocols(make_manager):
    mm = make_manager("cpu")
    v = mm.malloc(64).view()
    mm.close()
    with pytest.raises(InvalidInputError, match="freed"):
        v.__array_interface__
    with pytest.raises(InvalidInputError, match="freed"):
        v.__dlpack__()
