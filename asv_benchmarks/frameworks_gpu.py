"""CuPy, Numba and PyTorch allocating through gpumem, for real, on a GPU (run by ci/gpu.sh).

    python asv_benchmarks/frameworks_gpu.py                 # all three
    python asv_benchmarks/frameworks_gpu.py --only torch    # one

For each framework two child processes run (a framework's allocator is chosen once per
process): one with the framework's own allocator, one through gpumem. Each child first checks
real work (CuPy: array arithmetic, an ElementwiseKernel and reductions whose values must be the
same through both, and through gpumem a block filed under CuPy's current stream; Numba: a
kernel; torch: a training step with gpumem as CUDAPluggableAllocator, whose loss must fall),
then times a hit: ``ITER`` allocations of ``NBYTES`` that are dropped at once (CuPy
``cupy.cuda.alloc``, through gpumem the C allocator of gpumem/integrations/_cupy_alloc.pyx;
Numba ``context.memalloc``; torch ``torch.empty``), median ns per alloc+free over ``REPEATS``.
The table gives both and the ratio own / gpumem (above 1: gpumem is faster); CuPy's row fails
when the values of its checks differ between the two. A framework that is not installed, or
a run without a GPU, is reported as skipped with the reason; the exit status is 1 only when a
check fails.
Numba has no pool of its own: its default is cuMemAlloc with deferred cuMemFree.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NBYTES = 1 << 16
ITER = 20_000
REPEATS = 7
FRAMEWORKS = ("cupy", "numba", "torch")


def per_pair_ns(fn) -> float:
    fn(1000)                                    # warm: the first call makes the segment
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter_ns()
        fn(ITER)
        samples.append((time.perf_counter_ns() - t0) / ITER)
    return statistics.median(samples)


def the_manager():
    import gpumem
    return gpumem.get_manager("cuda:0")


# --- children ---------------------------------------------------------------------------------
def child_cupy(mode: str) -> dict:
    import cupy
    import numpy as np
    mm = None
    if mode == "gpumem":
        from gpumem.integrations import cupy as gm_cupy
        mm = the_manager()
        gm_cupy.use_gpumem(mm)
    else:
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    x = cupy.arange(1 << 20, dtype=cupy.float64)
    total = float((x * 2).sum())
    assert total == float((1 << 20) * ((1 << 20) - 1)), total
    square_plus_one = cupy.ElementwiseKernel("float64 x", "float64 y", "y = x * x + 1",
                                             "gpumem_check_square_plus_one")
    y = square_plus_one(x[:4096])
    expected = np.arange(4096, dtype=np.float64) ** 2 + 1
    assert (cupy.asnumpy(y) == expected).all()
    results = {"2x sum": total, "kernel sum": float(y.sum()), "norm": float(cupy.linalg.norm(y)),
               "max": float(x.max())}
    if mm is not None:
        assert mm.stats().in_use_bytes >= x.nbytes
        with cupy.cuda.Stream() as stream:       # gpumem files the block under CuPy's stream
            p = cupy.cuda.alloc(1 << 16)
            assert p.mem._owner.stream == stream.ptr, (p.mem._owner.stream, stream.ptr)
            in_use = mm.stats().in_use_bytes
            del p
            assert mm.stats().in_use_bytes == in_use - (1 << 16)
    del x, y

    def loop(k: int) -> None:
        for _ in range(k):
            cupy.cuda.alloc(NBYTES)
    return {"check": "arange * 2, sum, an ElementwiseKernel, norm, max", "results": results,
            "hit_pair_ns": per_pair_ns(loop)}


def child_numba(mode: str) -> dict:
    import numpy as np
    mm = None
    if mode == "gpumem":
        from gpumem.integrations import numba as gm_numba
        mm = the_manager()
        gm_numba.use_gpumem(mm)
    from numba import cuda

    @cuda.jit
    def inc(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1

    d = cuda.to_device(np.zeros(4096, dtype=np.float32))
    inc[16, 256](d)
    assert (d.copy_to_host() == 1).all()
    if mm is not None:
        assert mm.stats().in_use_bytes >= 4096 * 4
    ctx = cuda.current_context()

    def loop(k: int) -> None:
        for _ in range(k):
            ctx.memalloc(NBYTES)
    return {"check": "kernel a[i] += 1", "hit_pair_ns": per_pair_ns(loop)}


def child_torch(mode: str) -> dict:
    import torch
    if mode == "gpumem":
        from gpumem.integrations import torch as gm_torch
        gm_torch.use_gpumem(the_manager())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 256, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    losses = []
    for _ in range(50):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    out = {"check": f"50 SGD steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"}
    if mode == "gpumem":
        c = gm_torch.counters()
        assert c["nogil_allocs"] > 0 and c["through_python"] > 0, c
        out["counters"] = c

    def loop(k: int) -> None:
        for _ in range(k):
            torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    out["hit_pair_ns"] = per_pair_ns(loop)
    return out


def run_child(framework: str, mode: str) -> dict:
    try:
        __import__(framework)
    except Exception as exc:
        return {"skipped": f"{framework} not importable: {type(exc).__name__}: {exc}"}
    try:
        return globals()[f"child_{framework}"](mode)
    except Exception as exc:
        return {"failed": f"{type(exc).__name__}: {exc}"}


# --- parent -----------------------------------------------------------------------------------
def spawn(framework: str, mode: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", framework, mode],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"failed": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}


def why_no_gpu() -> str | None:
    """None on a machine with a real NVIDIA driver and device, else why not."""
    import ctypes
    from gpumem.backends.cuda import BACKEND
    ok, reason = BACKEND.availability()
    if not ok:
        return f"no usable GPU: {reason}"
    if hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_live_allocations"):
        return "libcuda.so.1 is tests/fake_cuda, not a GPU driver"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(FRAMEWORKS))
    ap.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))
        print(json.dumps(run_child(*args.child)), flush=True)
        return 0
    sys.path.insert(0, str(REPO))
    no_gpu = why_no_gpu()
    if no_gpu:
        print(f"skipped: {no_gpu}")
        return 0
    failed = False
    print(f"{'framework':<8} {'own pool ns':>12} {'gpumem ns':>10} {'own/gpumem':>10}  checks")
    for fw in [f.strip() for f in args.only.split(",") if f.strip()]:
        own, gm = spawn(fw, "own"), spawn(fw, "gpumem")
        if "skipped" in own or "skipped" in gm:
            print(f"{fw:<8} skipped: {own.get('skipped') or gm.get('skipped')}")
            continue
        if "failed" in own or "failed" in gm:
            failed = failed or "failed" in gm
            print(f"{fw:<8} FAILED  own: {own.get('failed', 'ok')}  gpumem: {gm.get('failed', 'ok')}")
            continue
        if own.get("results") != gm.get("results"):     # the same work must give the same values
            failed = True
            print(f"{fw:<8} FAILED  results differ: own {own.get('results')}, "
                  f"gpumem {gm.get('results')}")
            continue
        ratio = own["hit_pair_ns"] / gm["hit_pair_ns"]
        print(f"{fw:<8} {own['hit_pair_ns']:>12.0f} {gm['hit_pair_ns']:>10.0f} {ratio:>10.2f}  "
              f"own: {own['check']}; gpumem: {gm['check']}")
        if "counters" in gm:
            print(f"{'':<8} gpumem torch entry points: {gm['counters']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
