"""The cuda backend through the real cuda-python against tests/fake_cuda, a C test double of
libcuda.so.1 (no GPU here): the fake itself (smoke.py, in child processes), then, in a run with
the fake loaded (ci/test.sh's second run: LD_LIBRARY_PATH + GPUMEM_TEST_BACKENDS=cuda), what
only the fake lets a test see: driver-side leaks and busy streams."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fake_cuda
from gpumem import MemoryConfig, MemoryManager
from gpumem.backends import cuda as cuda_mod
from invariants import check

MiB = 1 << 20
HERE = Path(__file__).resolve().parents[1]   # tests/


@pytest.fixture
def fake_lib_dir(tmp_path) -> Path:
    """The fake built into a fresh folder; skips where cuda-python, gcc or cuda.h is missing."""
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-python is not installed")
    try:
        return fake_cuda.build(tmp_path).parent
    except fake_cuda.FakeCudaBuildError as exc:
        pytest.skip(str(exc).splitlines()[0])


def test_fake_driver_under_cuda_python_and_gpumem(fake_lib_dir):
    """smoke.py: every driver call gpumem makes, through cuda.bindings, on the fake (with and
    without cuGetProcAddress_v2, no device, two devices), then gpumem's CudaBackend on it."""
    out = subprocess.run([sys.executable, str(HERE / "fake_cuda" / "smoke.py")],
                         capture_output=True, text=True, timeout=300)
    failures = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert out.returncode == 0 and not failures, out.stdout[-4000:] + out.stderr[-2000:]
    assert "ALL CHECKS PASSED" in out.stdout


# --- with the fake loaded in this process (the `fake` fixture of conftest.py) -----------------
def _live(fake) -> tuple[int, int, int]:
    return (fake.fake_cuda_live_allocations(), fake.fake_cuda_live_events(),
            fake.fake_cuda_live_streams())


def test_calls_go_through_the_cython_module_when_built(fake):
    built = importlib.util.find_spec("gpumem.backends._cuda_native") is not None
    wanted = os.environ.get("GPUMEM_CUDA_NATIVE", "1") != "0"
    assert cuda_mod.BACKEND.native is (built and wanted)
    mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False))
    try:
        assert mm.device.properties().extra["native_calls"] is cuda_mod.BACKEND.native
    finally:
        mm.close()


def test_manager_gives_the_driver_everything_back(fake):
    before = _live(fake)
    mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False))
    s = mm.device.create_stream()
    bufs = [mm.malloc(n) for n in (100, 3 * MiB, 25 * MiB)]
    bufs[1].record_stream(s)
    bufs[1].free()                           # deferred: an event is recorded on s
    assert fake.fake_cuda_live_events() == before[1] + 1
    check(mm, [bufs[0], bufs[2]])
    mm.device.destroy_stream(s)
    mm.close()
    assert _live(fake) == before


def test_busy_stream_holds_a_recorded_block_back(fake):
    mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False))
    try:
        s = mm.device.create_stream()
        a = mm.malloc(MiB)
        keep = mm.malloc(MiB)                # the 2 MiB small segment is now full
        loc = a.segment_location()
        a.record_stream(s)
        fake.fake_cuda_set_stream_busy(ctypes.c_void_p(s), 1000)
        a.free()
        b = mm.malloc(MiB)                   # s has not passed a's free: not reused
        assert b.segment_location() != loc and mm.pending_free_bytes == MiB
        mm.device.synchronize()              # clears the fake's busy count
        c = mm.malloc(MiB)
        assert c.segment_location() == loc and mm.pending_free_bytes == 0
        check(mm, [keep, b, c])
        for buf in (keep, b, c):
            buf.free()
        mm.device.destroy_stream(s)
    finally:
        mm.close()


def test_manager_left_open_at_exit_is_quiet(fake_lib_dir):
    """At interpreter exit the device's finalizer releases the primary context before the
    manager's __del__ runs; close() must then see the device closed and say nothing."""
    lib_dir = fake_lib_dir
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import gpumem\n"
            "mm = gpumem.MemoryManager('cuda:0')\n"
            "bufs = [mm.malloc(n) for n in (100, 5 << 20)]\n"
            "print('allocated', mm.stats().reserved_bytes > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=HERE.parent,
                         env=fake_cuda.env(lib_dir, PYTHONPATH=str(HERE.parent)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "allocated True"
    assert "Warning" not in out.stderr and "Error" not in out.stderr, out.stderr


# --- DLPack and the CUDA array interface on the cuda backend (fake driver) -------------------
def test_cuda_dlpack_capsule_fields(fake):
    """The capsule of a cuda view, read through ctypes with dlpack.h's layout
    (tests/dlpack_structs.py): kDLCUDA, the device pointer, shape, strides in elements."""
    import dlpack_structs as dl
    mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False))
    try:
        buf = mm.malloc(4 * MiB)
        v = buf.view("float64", (64, 32), (8, 512), offset=4096)
        assert v.__dlpack_device__() == (2, 0) and buf.__dlpack_device__() == (2, 0)
        for max_version, name in ((None, "dltensor"), ((1, 0), "dltensor_versioned")):
            cap = v.__dlpack__(stream=-1, max_version=max_version)
            assert dl.capsule_name(cap) == name
            s = dl.summary(cap)
            assert s["data"] == buf.ptr + 4096 and s["device"] == (2, 0)
            assert (s["shape"], s["strides"], s["dtype"]) == ((64, 32), (1, 64), (2, 64, 1))
            if max_version:
                assert s["version"] == (1, 0) and s["flags"] == 0
            dl.consume(cap)
        cap = buf.__dlpack__(stream=-1, max_version=(1, 0))   # never consumed
        assert dl.summary(cap)["shape"] == (4 * MiB,) and buf.exports == 2
        del cap, v
        assert buf.exports == 0
        with pytest.raises(BufferError, match="dl_device"):
            buf.__dlpack__(stream=-1, dl_device=(1, 0))
        with pytest.raises(BufferError, match="stream=0 is ambiguous"):
            buf.__dlpack__(stream=0)
        buf.free()
    finally:
        mm.close()


def test_cuda_dlpack_orders_the_consumer_stream_after_the_producer(fake):
    """__dlpack__(stream=consumer): an event on the buffer's stream and cuStreamWaitEvent on the
    consumer's, so the consumer's later work waits for the producer's pending work (the fake
    makes a stream that waits on a busy stream's event busy too); stream=-1 asks for nothing.
    The event is destroyed at once, and the consumer stream is recorded on the buffer."""
    import dlpack_structs as dl
    mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False))
    try:
        producer, consumer = mm.device.create_stream(), mm.device.create_stream()
        buf = mm.malloc(MiB, stream=producer)
        events = fake.fake_cuda_live_events()
        fake.fake_cuda_set_stream_busy(ctypes.c_void_p(producer), 1000)
        dl.consume(buf.__dlpack__(stream=-1))
        assert mm.device.stream_idle(consumer) and buf.used_on_streams == ()
        dl.consume(buf.__dlpack__(stream=consumer))
        assert not mm.device.stream_idle(consumer)          # waits for the producer's work
        assert fake.fake_cuda_live_events() == events
        assert buf.used_on_streams == (consumer,)
        mm.device.synchronize()
        assert buf.__cuda_array_interface__["stream"] == producer
        buf.free()
        mm.collect_pending_frees(wait=True)
        for s in (producer, consumer):
            mm.device.destroy_stream(s)
    finally:
        mm.close()


def test_pinned_host_buffers_are_kdlcudahost(fake):
    """With CUDA present the cpu backend pins its segments: DLPack says kDLCUDAHost, numpy
    still takes the memory (and a consumer may ask for it as kDLCPU)."""
    import numpy as np
    mm = MemoryManager("cpu", MemoryConfig(cpu_fallback_enabled=False))
    try:
        assert mm.device.properties().extra["pinned"]
        buf = mm.malloc(4096)
        assert buf.__dlpack_device__() == (3, 0)
        a = np.from_dlpack(buf.view("int32"))
        a[:] = 5
        assert np.all(buf.copy_to_host().view(np.int32) == 5)
        b = np.from_dlpack(buf, device="cpu")
        assert b.ctypes.data == buf.ptr
        del a, b
        buf.free()
    finally:
        mm.close()
