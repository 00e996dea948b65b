"""CuPy allocating through gpumem on tests/fake_cuda (no GPU): ns per ``cupy.cuda.alloc(64 KiB)``
plus drop, beside what the same process pays for the parts of it.

    LD_LIBRARY_PATH=build/fake_cuda python asv_benchmarks/cupy_fake_driver.py [--repeats 41]
        [--against REV]     # also REV's gpumem/integrations/cupy.py (git show), same process

CuPy's runtime cannot start on the fake driver (the CUDA runtime needs driver internals,
``cuGetExportTable``), so CuPy's two queries are replaced by C callables, as cheap as CuPy's
own: ``runtime.getDevice`` returns 0 and ``get_current_stream(0)`` an object whose ``.ptr``
(kept in its ``__dict__``, as on CuPy's ``Stream``) is a stream made by gpumem's backend. CuPy's
own pool cannot run here at all (each of its requests asks the runtime for the device): that
comparison is ``frameworks_gpu.py --only cupy``, on a GPU. Rows, timed interleaved (the order
alternates every repeat) by this thread's CPU time, medians of ``repeats`` runs of ``ITER``:

- ``gpumem``: ``cupy.cuda.alloc(n)`` with gpumem's allocator installed, dropped at once;
- ``cupy alloc() floor``: ``cupy.cuda.alloc(n)`` with an allocator that returns one prebuilt
  ``MemoryPointer``: what CuPy's ``alloc`` and the call of any allocator cost;
- ``cupy objects``: ``MemoryPointer(UnownedMemory(ptr, n, owner, 0), 0)`` built and dropped, the
  CuPy objects an outside allocator hands back;
- ``gpumem malloc``: ``mm.malloc(n, stream=s)`` and drop, gpumem's own Python-level pair;
- with ``--against REV``: ``gpumem at REV``, the first row through the allocator of REV's
  ``cupy.py`` run on this checkout's core (an allocator written in Python against the public
  API, as before the C one, runs there unchanged), and the paired ratio of the two rows.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gpumem

NBYTES = 1 << 16
ITER = 20_000
_clock = time.thread_time_ns


def allocator_module_at(rev: str):
    """gpumem/integrations/cupy.py as of git revision `rev`, imported under another name."""
    repo = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:gpumem/integrations/cupy.py"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("gpumem_cupy_at_rev", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    Path(f.name).unlink()
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--against", metavar="REV", help="also time REV's allocator")
    args = ap.parse_args()
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1").fake_cuda_live_allocations
    except (OSError, AttributeError):
        print("skipped: libcuda.so.1 is not tests/fake_cuda (LD_LIBRARY_PATH=build/fake_cuda)")
        return 0
    try:
        import cupy
    except ImportError as exc:
        print(f"skipped: CuPy is not installed ({exc})")
        return 0
    from gpumem import MemoryConfig, MemoryManager
    from gpumem.integrations import cupy as gm_cupy

    mm = MemoryManager("cuda:0", MemoryConfig())
    stream = mm.device.create_stream()
    cupy.cuda.runtime.getDevice = itertools.repeat(0).__next__
    cupy.cuda.get_current_stream = [SimpleNamespace(ptr=stream)].__getitem__
    alloc = cupy.cuda.alloc
    gpumem_allocator = gm_cupy.allocator(mm)
    owner = mm.malloc(NBYTES, stream=stream)
    prebuilt = cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(owner.ptr, NBYTES, owner, 0), 0)
    constant_allocator = {NBYTES: prebuilt}.__getitem__
    unowned, pointer, ptr = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer, owner.ptr

    def timed_alloc(allocator) -> int:
        cupy.cuda.set_allocator(allocator)
        t0 = _clock()
        for _ in range(ITER):
            alloc(NBYTES)
        return _clock() - t0

    def through_gpumem() -> int:
        return timed_alloc(gpumem_allocator)

    def alloc_floor() -> int:
        return timed_alloc(constant_allocator)

    def cupy_objects() -> int:
        t0 = _clock()
        for _ in range(ITER):
            pointer(unowned(ptr, NBYTES, owner, 0), 0)
        return _clock() - t0

    def gpumem_malloc() -> int:
        malloc = mm.malloc
        t0 = _clock()
        for _ in range(ITER):
            malloc(NBYTES, stream=stream)
        return _clock() - t0

    rows = {"gpumem": through_gpumem, "cupy alloc() floor": alloc_floor,
            "cupy objects": cupy_objects, "gpumem malloc": gpumem_malloc}
    if args.against:
        old_allocator = allocator_module_at(args.against).allocator(mm)
        rows[f"gpumem at {args.against}"] = lambda: timed_alloc(old_allocator)
    through_gpumem()                                  # warm: the first call makes the segment
    samples: dict[str, list[float]] = {name: [] for name in rows}
    order = list(rows)
    for i in range(args.repeats):
        for name in (order if i % 2 == 0 else reversed(order)):
            samples[name].append(rows[name]() / ITER)
    cupy.cuda.set_allocator(None)
    assert mm.stats().in_use_bytes == NBYTES, mm.stats()   # only `owner` is live
    print(f"cupy {cupy.__version__}, {args.repeats} repeats of {ITER}, ns per pair "
          f"(median [quartiles])")
    for name, xs in samples.items():
        q = statistics.quantiles(xs, n=4)
        print(f"  {name:<20} {statistics.median(xs):7.0f}  [{q[0]:.0f}, {q[2]:.0f}]")
    if args.against:
        ratios = [b / a for a, b in zip(samples["gpumem"], samples[f"gpumem at {args.against}"])]
        q = statistics.quantiles(ratios, n=4)
        print(f"  {args.against} / now, paired: {statistics.median(ratios):.2f} "
              f"[{q[0]:.2f}, {q[2]:.2f}]")
    del prebuilt, owner
    mm.device.destroy_stream(stream)
    mm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
