"""The C allocator torch loads (gpumem/integrations/_torch_alloc.pyx), driven through ctypes
exactly as ``CUDAPluggableAllocator`` calls it: ``alloc(size, device, stream)`` and
``free(ptr, size, device, stream)``. torch itself is not needed.

Level: **real** on a simulated device (the pool, the table, the GIL handling are all real; sim
stands for the driver), and **fake driver** when the suite runs with GPUMEM_TEST_BACKENDS=cuda
on tests/fake_cuda (ci/test.sh's second run): the same tests then allocate CUDA segments through
the real cuda-python. A real torch training step on a GPU is in ci/gpu.sh only.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import textwrap
import threading
import time
import warnings

import pytest

from gpumem import MemoryConfig, MemoryManager
from gpumem.backends import open_device
from gpumem.errors import DriverError, InvalidInputError
from gpumem.integrations import torch as gm_torch
from forked import wait_for_child
from invariants import EXACT, backend_device, check, config_over, real_cuda_driver, selected_backends

MiB = 1 << 20
DEV = 0                        # the torch device index the tests bind


@pytest.fixture(params=selected_backends(("sim", "cuda")))
def torch_backend(request) -> str:
    if request.param not in ("sim", "cuda"):
        pytest.skip(f"the torch allocator serves CUDA devices; {request.param} is not tested here")
    return request.param


@pytest.fixture
def make_bound(torch_backend, sim_device):
    """``make_bound(**config)``: a manager on device 0 of the backend, bound to torch device 0;
    unbound and closed afterwards (every pointer must have been freed by then)."""
    made = []

    def make(capacity="1GiB", *, usable: int | None = None, **config) -> MemoryManager:
        dev = backend_device(torch_backend, capacity)      # capacity: sim only
        if usable is not None:                             # the fake's capacity is fixed
            config["gpu_memory_fraction"] = usable / open_device(dev).mem_get_info()[1]
        mm = MemoryManager(dev, MemoryConfig(**config_over(EXACT, config)))
        gm_torch.bind(mm, DEV)
        made.append(mm)
        return mm

    yield make
    native = gm_torch._native()
    assert native.live_blocks(DEV) == 0, "a test left pointers live in the torch table"
    native.unbind(DEV)
    for mm in made:
        mm.close()


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    """The extension's shared library opened by path, as torch does (after the import)."""
    so = ctypes.CDLL(gm_torch.library_path())
    so.gpumem_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    so.gpumem_torch_alloc.restype = ctypes.c_void_p
    so.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                     ctypes.c_void_p]
    so.gpumem_torch_free.restype = None
    return so


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_exported_symbols_have_c_linkage():
    """torch dlsym()s the two names as given: they must be exported unmangled (nm, real)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", gm_torch.library_path()],
                         capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert {gm_torch.ALLOC_SYMBOL, gm_torch.FREE_SYMBOL} <= names, sorted(names)[:20]


def test_miss_then_hit_reuses_the_block(make_bound, lib):
    """The first request goes through the manager (a new segment); once freed, the same size is
    a hit served from the cache at the same address, and the manager's stats see both."""
    mm = make_bound()
    c0 = gm_torch.counters()
    p = lib.gpumem_torch_alloc(3 * MiB, DEV, None)
    assert p
    assert gm_torch.live_blocks(DEV) == 1
    assert mm.stats().in_use_bytes >= 3 * MiB and mm.stats().segments_created == 1
    lib.gpumem_torch_free(p, 3 * MiB, DEV, None)
    q = lib.gpumem_torch_alloc(3 * MiB, DEV, None)
    assert q == p
    hits_before = mm.stats().pool_hits
    lib.gpumem_torch_free(q, 3 * MiB, DEV, None)
    r = lib.gpumem_torch_alloc(3 * MiB, DEV, None)
    assert mm.stats().pool_hits == hits_before + 1
    lib.gpumem_torch_free(r, 3 * MiB, DEV, None)
    d = delta(c0, gm_torch.counters())
    assert d == {"num_allocs": 3, "num_frees": 3, "through_python": 1, "python_frees": 1,
                 "nogil_allocs": 2, "nogil_frees": 2}, d
    assert mm.stats().in_use_bytes == 0 and mm.stats().segments_created == 1
    check(mm)


def test_oom_returns_null_and_changes_nothing(make_bound, lib):
    """A request the device cannot hold returns NULL (torch then raises its OutOfMemoryError);
    the pool is unchanged and the OOM is counted."""
    mm = make_bound("256MiB", usable=256 * MiB)
    keep = lib.gpumem_torch_alloc(MiB, DEV, None)
    before = mm.stats()
    c0 = gm_torch.counters()
    assert lib.gpumem_torch_alloc(512 * MiB, DEV, None) is None
    assert delta(c0, gm_torch.counters()) == {"num_ooms": 1}
    after = mm.stats()
    assert (after.in_use_bytes, after.reserved_bytes) == (before.in_use_bytes,
                                                          before.reserved_bytes)
    assert mm.stats().num_ooms == before.num_ooms + 1
    lib.gpumem_torch_free(keep, MiB, DEV, None)
    check(mm)


def test_cpu_fallback_memory_is_refused(make_bound, lib):
    """With CPU fallback on, the manager would hand out host memory, which cannot back a CUDA
    tensor: the entry point returns NULL and gives the host block back at once."""
    mm = make_bound("64MiB", usable=32 * MiB, cpu_fallback_enabled=True)
    c0 = gm_torch.counters()
    assert lib.gpumem_torch_alloc(48 * MiB, DEV, None) is None     # > usable, <= total
    assert delta(c0, gm_torch.counters()) == {"fallbacks_refused": 1}
    stats = mm.stats()
    assert stats.cpu_fallbacks == 1 and stats.active_buffers == 0 and stats.fallback_bytes == 0


def test_unknown_and_double_frees_are_counted(make_bound, lib):
    """A pointer gpumem did not hand out, or one freed twice, is counted and otherwise ignored:
    no crash, the pool and the live block are untouched."""
    mm = make_bound()
    p = lib.gpumem_torch_alloc(MiB, DEV, None)
    lib.gpumem_torch_free(p, MiB, DEV, None)
    q = lib.gpumem_torch_alloc(MiB, DEV, None)
    before = mm.stats()
    c0 = gm_torch.counters()
    lib.gpumem_torch_free(q + 512, MiB, DEV, None)      # inside the block, not its start
    lib.gpumem_torch_free(0xDEAD0000, 64, DEV, None)
    lib.gpumem_torch_free(None, 0, DEV, None)
    assert delta(c0, gm_torch.counters()) == {"unknown_frees": 3}
    assert mm.stats().in_use_bytes == before.in_use_bytes and gm_torch.live_blocks(DEV) == 1
    lib.gpumem_torch_free(q, MiB, DEV, None)
    c1 = gm_torch.counters()
    lib.gpumem_torch_free(q, MiB, DEV, None)            # twice
    assert delta(c1, gm_torch.counters()) == {"unknown_frees": 1}
    assert mm.stats().in_use_bytes == 0
    check(mm)


def test_bad_requests_return_null(make_bound, lib):
    """A negative size or a device index out of range is refused without touching a pool."""
    mm = make_bound()
    c0 = gm_torch.counters()
    assert lib.gpumem_torch_alloc(-1, DEV, None) is None
    assert lib.gpumem_torch_alloc(MiB, -1, None) is None
    assert lib.gpumem_torch_alloc(MiB, 64, None) is None
    assert delta(c0, gm_torch.counters()) == {"bad_requests": 3}
    assert mm.stats().num_allocs == 0


def test_observers_see_torch_memory(make_bound, lib):
    """With tracking on, every request goes through the manager's Python path so that the
    tracker sees torch's blocks (tag "torch"), hits included; frees are seen too."""
    mm = make_bound(track_allocations=True)
    p = lib.gpumem_torch_alloc(2 * MiB, DEV, None)
    lib.gpumem_torch_free(p, 2 * MiB, DEV, None)
    c0 = gm_torch.counters()
    q = lib.gpumem_torch_alloc(2 * MiB, DEV, None)                  # a cache hit in the pool
    assert delta(c0, gm_torch.counters()) == {"num_allocs": 1, "through_python": 1}
    assert mm.tracker.by_tag() == {"torch": (1, 2 * MiB)}
    lib.gpumem_torch_free(q, 2 * MiB, DEV, None)
    assert mm.tracker.count() == 0


def test_bind_refuses_bad_input_and_a_busy_device(make_bound, lib):
    """bind() names what is wrong: not a manager, a bad index, a CUDA index of a non-CUDA
    manager, another manager while torch still holds blocks of the first."""
    mm = make_bound()
    with pytest.raises(InvalidInputError, match="manager must be"):
        gm_torch.bind("cuda:0", DEV)
    with pytest.raises(InvalidInputError, match="device must be in"):
        gm_torch.bind(mm, 64)
    with pytest.raises(InvalidInputError, match="device must be an int"):
        gm_torch.bind(mm, "0")
    if not mm.device_string.startswith("cuda"):
        with pytest.raises(InvalidInputError, match="torch tensors live on CUDA devices"):
            gm_torch.bind(mm)
    p = lib.gpumem_torch_alloc(MiB, DEV, None)
    other = MemoryManager(mm.device_string, MemoryConfig(**EXACT))
    try:
        with pytest.raises(InvalidInputError, match="still has 1 live blocks"):
            gm_torch.bind(other, DEV)
        assert gm_torch._native().bound_manager(DEV) is mm
    finally:
        lib.gpumem_torch_free(p, MiB, DEV, None)
        other.close()


def test_many_threads_hits_and_misses(make_bound, lib):
    """8 threads allocate and free mixed sizes through the entry points (ctypes drops the GIL
    around each call): no two live pointers overlap, every pointer comes back, the pool's
    invariants hold and most requests were hits."""
    mm = make_bound("2GiB")
    sizes = [512, 4096, 100_000, MiB, 3 * MiB, 12 * MiB]
    live: dict[int, int] = {}
    guard = threading.Lock()
    errors: list[str] = []

    def work(seed: int) -> None:
        held = []
        for i in range(400):
            n = sizes[(seed * 7 + i) % len(sizes)]
            p = lib.gpumem_torch_alloc(n, DEV, None)
            if not p:
                errors.append(f"NULL for {n}")
                continue
            with guard:
                for start, size in live.items():
                    if start < p + n and p < start + size:
                        errors.append(f"{p:#x}+{n} overlaps {start:#x}+{size}")
                live[p] = n
            held.append((p, n))
            if len(held) > 3:
                q, m = held.pop(0)
                with guard:
                    del live[q]
                lib.gpumem_torch_free(q, m, DEV, None)
        for q, m in held:
            with guard:
                del live[q]
            lib.gpumem_torch_free(q, m, DEV, None)

    c0 = gm_torch.counters()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    d = delta(c0, gm_torch.counters())
    assert d.get("nogil_allocs", 0) + d.get("through_python", 0) == d["num_allocs"] == 8 * 400
    assert d["num_frees"] == 8 * 400
    assert d["nogil_allocs"] > d.get("through_python", 0)
    assert d.get("unknown_frees", 0) == 0 and d.get("bad_frees", 0) == 0
    assert gm_torch.live_blocks(DEV) == 0 and mm.stats().in_use_bytes == 0
    check(mm)


HAMMER_C = textwrap.dedent("""
    #include <stddef.h>
    #include <sys/types.h>
    #include <unistd.h>
    typedef void *(*alloc_fn)(ssize_t, int, void *);
    typedef void (*free_fn)(void *, ssize_t, int, void *);
    /* Alloc/free pairs until *flag is 2; returns how many completed while *flag was 1. */
    long hammer(alloc_fn a, free_fn f, ssize_t n, volatile int *flag, volatile int *started) {
        long during = 0;
        *started = 1;
        while (*flag != 2) {
            int before = *flag;
            void *p = a(n, 0, NULL);
            if (p == NULL) return -1;
            f(p, n, 0, NULL);
            if (before == 1 && *flag == 1) during++;
        }
        return during;
    }
    /* Called through ctypes.PyDLL: holds the GIL for usec microseconds. */
    void hold(volatile int *flag, unsigned usec) { *flag = 1; usleep(usec); *flag = 2; }
""")


def test_hits_run_while_another_thread_holds_the_gil(make_bound, lib, tmp_path):
    """The proof that a hit needs no GIL: a C loop (its own thread) allocates and frees while
    the main thread holds the GIL in a C sleep (ctypes.PyDLL keeps it); pairs complete during
    the sleep. A hit that took the GIL could not complete until the sleep ended."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not on PATH")
    mm = make_bound()
    warm = lib.gpumem_torch_alloc(MiB, DEV, None)       # the segment exists: later pairs hit
    lib.gpumem_torch_free(warm, MiB, DEV, None)
    so = tmp_path / "hammer.so"
    src = tmp_path / "hammer.c"
    src.write_text(HAMMER_C)
    subprocess.run([gcc, "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    free_lib = ctypes.CDLL(str(so))                     # releases the GIL around hammer()
    gil_lib = ctypes.PyDLL(str(so))                     # keeps it around hold()
    flag, started = ctypes.c_int(0), ctypes.c_int(0)
    alloc_ptr = ctypes.cast(lib.gpumem_torch_alloc, ctypes.c_void_p)
    free_ptr = ctypes.cast(lib.gpumem_torch_free, ctypes.c_void_p)
    free_lib.hammer.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ssize_t,
                                ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    free_lib.hammer.restype = ctypes.c_long
    gil_lib.hold.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_uint]
    result = []
    t = threading.Thread(target=lambda: result.append(
        free_lib.hammer(alloc_ptr, free_ptr, MiB, ctypes.byref(flag), ctypes.byref(started))))
    t.start()
    while not started.value:
        pass
    gil_lib.hold(ctypes.byref(flag), 200_000)
    t.join()
    assert result and result[0] > 0, result
    assert mm.stats().in_use_bytes == 0
    check(mm)


def test_an_unbound_device_uses_the_shared_manager(torch_backend, lib):
    """manager=None: torch device 0's first request binds gpumem.get_manager("cuda:0"); once
    that shared manager is closed (and torch holds nothing of it), the next request binds its
    replacement (fake driver only: the index names a CUDA device)."""
    if torch_backend != "cuda":
        pytest.skip("torch device indexes name CUDA devices; the fake-driver run covers this")
    import gpumem
    backend_device("cuda")
    native = gm_torch._native()
    assert native.bound_manager(DEV) is None
    try:
        p = lib.gpumem_torch_alloc(MiB, DEV, None)
        first = gpumem.get_manager("cuda:0")
        assert p and native.bound_manager(DEV) is first
        assert first.stats().in_use_bytes >= MiB
        lib.gpumem_torch_free(p, MiB, DEV, None)
        first.close()
        q = lib.gpumem_torch_alloc(MiB, DEV, None)
        second = gpumem.get_manager("cuda:0")
        assert q and second is not first and native.bound_manager(DEV) is second
        lib.gpumem_torch_free(q, MiB, DEV, None)
    finally:
        native.unbind(DEV)
        gpumem.get_manager("cuda:0").close()


FORK_HAMMER_C = textwrap.dedent("""
    #include <stddef.h>
    #include <sys/types.h>
    typedef void *(*alloc_fn)(ssize_t, int, void *);
    typedef void (*free_fn)(void *, ssize_t, int, void *);
    /* Alloc/free pairs of varied sizes (front-cache hits and pool-path carving) until *stop. */
    void churn(alloc_fn a, free_fn f, volatile int *stop, volatile int *started) {
        unsigned i = 0;
        *started = 1;
        while (!*stop) {
            ssize_t n = (ssize_t)(512u << (i++ % 12));
            void *p = a(n, 0, NULL);
            if (p != NULL) f(p, n, 0, NULL);
        }
    }
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_while_a_thread_allocates_without_the_gil(make_bound, lib, tmp_path,
                                                       torch_backend):
    """fork() while another thread is inside the pool (ctypes drops the GIL around the C loop,
    as torch's own threads call the allocator): the child must find every C lock free — the
    pool's, its front caches', the torch table's — or its first empty_cache or allocation
    spins forever on a lock whose holder does not exist there. 40 forks; each child empties
    the cache, allocates through Python and through the torch entry points, checks the pool's
    invariants and exits 0 within 20 s. Before the fork hooks took the locks, some children
    hung (their parent saw the timeout). On a real NVIDIA driver a forked child cannot use the
    parent's CUDA state (the driver's rule; GPU run of 2026-11-27: every child failed there), so
    the calls that reach the driver may fail with a DriverError (a NULL from the torch entry
    point), but the pool's invariants must hold before and after, and nothing may hang."""
    real = real_cuda_driver(torch_backend)
    errors = tmp_path / "child-errors"
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not on PATH")
    mm = make_bound()
    so, src = tmp_path / "churn.so", tmp_path / "churn.c"
    src.write_text(FORK_HAMMER_C)
    subprocess.run([gcc, "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    churn = ctypes.CDLL(str(so))                # releases the GIL around churn()
    churn.churn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                            ctypes.POINTER(ctypes.c_int)]
    stop, started = ctypes.c_int(0), ctypes.c_int(0)
    t = threading.Thread(target=churn.churn, args=(
        ctypes.cast(lib.gpumem_torch_alloc, ctypes.c_void_p),
        ctypes.cast(lib.gpumem_torch_free, ctypes.c_void_p),
        ctypes.byref(stop), ctypes.byref(started)))
    t.start()
    hung = failed = 0
    try:
        while not started.value:
            time.sleep(0.001)
        for _ in range(40):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
                pid = os.fork()
            if pid == 0:                        # child: its exit code says whether it worked
                code = 1
                try:
                    mm.pool.check_invariants()      # the pool's lock is free
                    try:
                        mm.empty_cache()
                        mm.malloc(3 * MiB).free()
                        p = lib.gpumem_torch_alloc(MiB, DEV, None)
                        if p:
                            lib.gpumem_torch_free(p, MiB, DEV, None)
                        result = 0 if p or real else 2
                    except DriverError:
                        if not real:
                            raise
                        result = 0
                    mm.pool.check_invariants()      # a driver refusal left the pool whole
                    code = result
                except BaseException as exc:        # the parent's assertion shows why
                    with open(errors, "a") as f:
                        f.write(f"{type(exc).__name__}: {exc}\n")
                finally:
                    os._exit(code)
            code = wait_for_child(pid, 20)
            hung += code is None
            failed += code not in (0, None)
            if hung:
                break
    finally:
        stop.value = 1
        t.join(30)
    why = errors.read_text()[:2000] if errors.exists() else ""
    assert hung == 0 and failed == 0, f"{hung} child(ren) hung, {failed} failed: {why}"
    assert mm.stats().in_use_bytes == 0
    check(mm)
