"""gpumem asv benchmarks: one module per area (pool, manager, traces, opencl).

Shared helpers live here (asv only collects names starting with time_/track_/mem_/peakmem_/
timeraw_, so none of these is mistaken for a benchmark). ``asv_benchmarks/compare.py`` imports
them too.

With ``environment_type: existing`` asv runs the benchmarks in the current interpreter without
installing the project, so the repo root is put first on sys.path when its extensions are built
in place (``python setup.py build_ext --inplace``) or when gpumem is not importable otherwise.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import os
import random
import sys
from pathlib import Path

ASV_DIR = Path(__file__).resolve().parents[1]
REPO = ASV_DIR.parent

if any((REPO / "gpumem" / "_core").glob("pool*.so")):
    sys.path.insert(0, str(REPO))   # the checkout, built in place, not an older installed copy
try:
    import gpumem  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))
    import gpumem  # noqa: F401

#: operations per timed call of a time_* benchmark that times one cheap operation (a hit pair
#: is ~100 ns): asv times whole calls, so one pair per call measured asv's call overhead and
#: the timer (0.5-2.4 us) instead of the pair. The loops are written as compare.py's (bound
#: methods in locals), so asv's figure / OPS_PER_CALL is what compare.py reports.
OPS_PER_CALL = 1000

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: capacity of the simulated device the sim benchmarks run on: large enough for every trace
SIM_CAPACITY = "1TiB"


def traces_dir() -> Path:
    """``$GPUMEM_TRACES`` or the traces shipped in the repository (gpumem/data/traces)."""
    env = os.environ.get("GPUMEM_TRACES")
    return Path(env) if env else REPO / "gpumem" / "data" / "traces"


def trace_names() -> list[str]:
    d = traces_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[:-len(".csv.gz")] for p in d.glob("*.csv.gz"))


def trace_meta(name: str) -> dict:
    path = traces_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


_trace_cache: dict[str, "Trace"] = {}


class Trace:
    """Events of one trace: parallel lists ``alloc`` (bool), ``ids``, ``sizes``, plus the
    number of ids and the peak of live requested bytes (computed here from the events)."""

    __slots__ = ("name", "alloc", "ids", "sizes", "n_ids", "peak_live", "n_events", "scale")

    def __init__(self, name, alloc, ids, sizes, scale=1.0):
        self.name = name
        self.alloc = alloc
        self.ids = ids
        self.sizes = sizes
        self.scale = scale
        self.n_events = len(alloc)
        self.n_ids = (max(ids) + 1) if ids else 0
        live = peak = 0
        for a, n in zip(alloc, sizes):
            if a:
                live += n
                if live > peak:
                    peak = live
            else:
                live -= n
        self.peak_live = peak

    def events(self):
        return list(zip(self.alloc, self.ids, self.sizes))

    def scaled(self, factor: float) -> "Trace":
        """The same events with every size multiplied by factor (for devices too small)."""
        if factor == 1.0:
            return self
        sizes = [max(1, int(n * factor)) if n else 0 for n in self.sizes]
        return Trace(self.name, self.alloc, self.ids, sizes, scale=self.scale * factor)


def read_trace(name_or_path) -> Trace:
    """Read a ``t_ns,op,id,size`` CSV (.gz or plain): our own reader, independent of
    gpumem.observe.trace. A free repeats the size of its allocation."""
    path = Path(name_or_path)
    if not path.suffix:
        path = traces_dir() / f"{name_or_path}.csv.gz"
    key = str(path)
    if key in _trace_cache:
        return _trace_cache[key]
    opener = gzip.open if path.name.endswith(".gz") else open
    alloc: list[bool] = []
    ids: list[int] = []
    sizes: list[int] = []
    with opener(path, "rt", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        col = {h.strip(): i for i, h in enumerate(header)}
        io, ii, isz = col["op"], col["id"], col["size"]
        for row in reader:
            if not row:
                continue
            op = row[io]
            if op not in ("a", "f"):
                raise ValueError(f"{path}: unknown op {op!r}")
            alloc.append(op == "a")
            ids.append(int(row[ii]))
            sizes.append(int(row[isz]))
    name = path.name.split(".")[0]
    trace = Trace(name, alloc, ids, sizes)
    _trace_cache[key] = trace
    return trace


def replay(trace: Trace, alloc, free=None, after_alloc=None) -> None:
    """Replay: on 'a' ``handles[id] = alloc(size)``; on 'f' ``free(handles[id])`` (free=None:
    drop the reference, for allocators that free on deallocation). ``after_alloc()`` is called
    after every allocation when given (to poll a peak)."""
    handles = [None] * trace.n_ids
    if after_alloc is None and free is not None:
        for a, i, n in zip(trace.alloc, trace.ids, trace.sizes):
            if a:
                handles[i] = alloc(n)
            else:
                free(handles[i])
                handles[i] = None
        return
    for a, i, n in zip(trace.alloc, trace.ids, trace.sizes):
        if a:
            handles[i] = alloc(n)
            if after_alloc is not None:
                after_alloc()
        else:
            if free is not None:
                free(handles[i])
            handles[i] = None


# --- random sizes -------------------------------------------------------------------------------
def log_uniform_sizes(rng: random.Random, count: int, lo: int, hi: int) -> list[int]:
    a, b = math.log(lo), math.log(hi)
    return [int(math.exp(rng.uniform(a, b))) for _ in range(count)]


def log_uniform_mean(lo: int, hi: int) -> float:
    return (hi - lo) / math.log(hi / lo)


class MixedWorkload:
    """A fixed random stream of (slot, size) steps over `live` slots: each step frees the
    buffer in the slot and allocates a new one of the given size (log-uniform in [lo, hi])."""

    def __init__(self, live: int = 10_000, lo: int = 1 * KiB, hi: int = 4 * MiB,
                 steps: int = 100_000, seed: int = 2026):
        rng = random.Random(seed)
        self.live = live
        self.lo, self.hi = lo, hi
        self.initial = log_uniform_sizes(rng, live, lo, hi)
        self.slots = [rng.randrange(live) for _ in range(steps)]
        self.sizes = log_uniform_sizes(rng, steps, lo, hi)

    def start(self, alloc) -> list:
        return [alloc(n) for n in self.initial]

    def runner(self, alloc, free, handles: list):
        """run(n): n steps, continuing where the previous call stopped."""
        slots, sizes, m = self.slots, self.sizes, len(self.slots)
        pos = [0]

        if free is None:
            def run(n):
                p = pos[0]
                for k in range(n):
                    j = slots[p]
                    handles[j] = None
                    handles[j] = alloc(sizes[p])
                    p += 1
                    if p == m:
                        p = 0
                pos[0] = p
        else:
            def run(n):
                p = pos[0]
                for k in range(n):
                    j = slots[p]
                    free(handles[j])
                    handles[j] = alloc(sizes[p])
                    p += 1
                    if p == m:
                        p = 0
                pos[0] = p
        return run


def device_budget(manager) -> int:
    """Bytes a manager may take from its device: usable memory, and never below the
    configured min_free_bytes of the driver's total."""
    _, total = manager.memory_info()
    return max(0, min(manager.usable_memory, total - manager.config.min_free_bytes))


def fitting_live_count(usable_bytes: int, lo: int = 1 * KiB, hi: int = 4 * MiB,
                       wanted: int = 10_000, fraction: float = 0.5) -> int:
    """How many live buffers of log-uniform sizes fit in `fraction` of a device."""
    return max(1, min(wanted, int(fraction * usable_bytes / log_uniform_mean(lo, hi))))


# --- devices ------------------------------------------------------------------------------------
_sim = None


def sim_device_string() -> str:
    """Install (once per process) a big simulated device as sim:0 and return "sim:0"."""
    global _sim
    import gpumem_sim
    if _sim is None:
        _sim = gpumem_sim.SimDevice(SIM_CAPACITY)
    gpumem_sim.install(_sim)
    return "sim:0"


def sim_manager(track: bool = False, **config):
    """A MemoryManager on the big simulated device. With track=True the tracker module must
    exist (NotImplementedError otherwise: asv skips the benchmark)."""
    from gpumem import MemoryConfig, MemoryManager
    cfg = MemoryConfig(track_allocations=track, **config)
    try:
        return MemoryManager(sim_device_string(), cfg)
    except ImportError as exc:          # gpumem.observe.tracking not there (yet)
        raise NotImplementedError(f"tracking unavailable: {exc}") from exc


def opencl_available() -> tuple[bool, str]:
    try:
        from gpumem.backends import get_backend
        ok, reason = get_backend("opencl").availability()
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return ok, reason


def pyopencl_pool_for(manager):
    """``(pool, queue)``: a pyopencl ``MemoryPool(ImmediateAllocator(queue))`` in the same
    context, on the same device, as an "opencl:N" manager."""
    import pyopencl.tools as cl_tools
    queue = manager.device.queue(0)
    return cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue)), queue


def load_cbench():
    """The compiled C-level benchmark module; NotImplementedError when it cannot be built
    (no compiler / Cython): asv then skips the C-level benchmarks."""
    if str(ASV_DIR) not in sys.path:
        sys.path.insert(0, str(ASV_DIR))
    try:
        import build_cbench
        return build_cbench.load()
    except Exception as exc:
        raise NotImplementedError(f"cannot build _cbench: {type(exc).__name__}: {exc}") from exc
