"""The public .pxd works for downstream Cython: a tiny extension compiled at test time cimports
``gpumem._core.pool`` and runs gm_alloc/gm_free on a live pool without the GIL, from several
threads at once (as numpy's test_extending does for numpy.random)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import gpumem
from invariants import check

REPO_ROOT = Path(gpumem.__file__).resolve().parent.parent
MiB = 1 << 20

PYX = textwrap.dedent("""
    # cython: language_level=3
    # distutils: language = c++
    from libc.stdint cimport uint64_t
    from gpumem._core.pool cimport (CachingPool, gm_pool, gm_alloc, gm_free, gm_block, gm_round,
                                    gm_block_address, GM_OK, GM_MISS, GM_UNKNOWN_STREAM,
                                    GM_BAD_BLOCK)

    def hit_pairs(CachingPool pool, size_t nbytes, int n, uint64_t stream=0):
        '''n alloc/free pairs without the GIL; returns (pairs that were both GM_OK, the address
        of the first block).'''
        cdef gm_pool* p = pool._p
        cdef gm_block* b
        cdef int i, ok = 0
        cdef size_t first = 0
        with nogil:
            for i in range(n):
                if gm_alloc(p, nbytes, stream, &b) == GM_OK:
                    if i == 0:
                        first = gm_block_address(b)
                    if gm_free(p, b, b.serial) == GM_OK:
                        ok += 1
        return ok, first

    def alloc_code(CachingPool pool, size_t nbytes, uint64_t stream=0):
        '''The return code of one gm_alloc (the block, if any, is freed again).'''
        cdef gm_block* b = NULL
        cdef int rc
        with nogil:
            rc = gm_alloc(pool._p, nbytes, stream, &b)
            if rc == GM_OK:
                gm_free(pool._p, b, b.serial)
        return rc

    def double_free_code(CachingPool pool, size_t nbytes):
        '''gm_free twice on one block: the second must report GM_BAD_BLOCK.'''
        cdef gm_block* b
        cdef uint64_t serial
        cdef int rc, first = -1, second = -1
        with nogil:
            rc = gm_alloc(pool._p, nbytes, 0, &b)
            if rc == GM_OK:
                serial = b.serial
                first = gm_free(pool._p, b, serial)
                second = gm_free(pool._p, b, serial)
        return first, second

    def rounded(CachingPool pool, size_t nbytes):
        return gm_round(pool._p, nbytes)

    CODES = dict(GM_OK=GM_OK, GM_MISS=GM_MISS, GM_UNKNOWN_STREAM=GM_UNKNOWN_STREAM,
                 GM_BAD_BLOCK=GM_BAD_BLOCK)
""")

SETUP = textwrap.dedent("""
    import sys
    from Cython.Build import cythonize
    from setuptools import Extension, setup

    root = sys.argv.pop(1)
    ext = Extension("gm_downstream", ["gm_downstream.pyx"], language="c++",
                    include_dirs=[root], extra_compile_args=["-std=c++17", "-O1"])
    setup(name="gm_downstream", ext_modules=cythonize(
        [ext], include_path=[root], compiler_directives={"language_level": "3"}, quiet=True))
""")


@pytest.fixture(scope="module")
def downstream(tmp_path_factory):
    if os.name == "nt":
        pytest.skip("the test build uses a Unix C++ compiler flag")
    d = tmp_path_factory.mktemp("cython_api")
    (d / "gm_downstream.pyx").write_text(PYX)
    (d / "setup.py").write_text(SETUP)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "setup.py", str(REPO_ROOT), "build_ext", "--inplace"],
                          cwd=d, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"building the downstream extension failed:\n{proc.stdout}\n" \
                                 f"{proc.stderr}"
    (so,) = [p for p in d.iterdir() if p.name.startswith("gm_downstream") and
             p.suffix in (".so", ".pyd")]
    spec = importlib.util.spec_from_file_location("gm_downstream", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_nogil_hits_on_a_warmed_pool(downstream, manager):
    b = manager.malloc(4096)
    ptr = b.ptr
    b.free()                                            # one cached 2 MiB segment
    before = manager.pool.counters()
    ok, first = downstream.hit_pairs(manager.pool, 4096, 10_000)
    assert ok == 10_000
    assert first == ptr                                  # the same block the Python side had
    after = manager.pool.counters()
    assert after["hits"] - before["hits"] == 10_000
    assert after["num_allocs"] - before["num_allocs"] == 10_000
    assert after["num_frees"] - before["num_frees"] == 10_000
    assert after["misses"] == before["misses"] and after["reserved_bytes"] == 2 * MiB
    check(manager, [])
    # the Python side keeps working on the same pool
    c = manager.malloc(4096)
    assert c.ptr == ptr
    check(manager, [c])


@pytest.mark.slow
def test_return_codes(downstream, manager):
    codes = downstream.CODES
    assert codes == dict(GM_OK=0, GM_MISS=1, GM_UNKNOWN_STREAM=2, GM_BAD_BLOCK=3)
    assert downstream.alloc_code(manager.pool, 4096) == codes["GM_MISS"]       # empty pool
    manager.malloc(4096).free()
    assert downstream.alloc_code(manager.pool, 4096) == codes["GM_OK"]
    assert downstream.alloc_code(manager.pool, 4 * MiB) == codes["GM_MISS"]   # no large block
    assert downstream.alloc_code(manager.pool, 4096, 777) == codes["GM_UNKNOWN_STREAM"]
    assert downstream.double_free_code(manager.pool, 4096) == (codes["GM_OK"],
                                                               codes["GM_BAD_BLOCK"])
    for n in (0, 1, 512, 513, 1 << 40):
        assert downstream.rounded(manager.pool, n) == manager.pool.round_size(n)
    check(manager, [])


@pytest.mark.slow
def test_nogil_pairs_from_threads_with_python_traffic(downstream, manager):
    """Four threads hammer the pool without the GIL while the Python side allocates too."""
    dev = manager.device
    manager.malloc(4096).free()                          # one cached 2 MiB segment
    n = 20_000
    results: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(downstream.hit_pairs(manager.pool, 2048, n)[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    before = manager.pool.counters()
    for t in threads:
        t.start()
    py = [manager.malloc(8192) for _ in range(50)]       # concurrent Python-level traffic
    for b in py[::2]:
        b.free()
    for t in threads:
        t.join()
    assert not errors
    assert results == [n] * 4
    after = manager.pool.counters()
    assert after["num_allocs"] - before["num_allocs"] == 4 * n + 50
    assert after["num_frees"] - before["num_frees"] == 4 * n + 25
    check(manager, py[1::2])
    assert dev.live_bytes == manager.pool.reserved_bytes
