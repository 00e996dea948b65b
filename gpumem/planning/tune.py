"""Which allocator settings fit a recorded workload on which card: ``gpumem.tune``.

A trace (gpumem's ``t_ns,op,id,size`` CSV, or a PyTorch memory snapshot pickle) is replayed
under a grid of candidates: gpumem configurations through the real pool on a simulated device
(:func:`gpumem.replay`), and PyTorch allocator settings through
:class:`~gpumem.planning.torch_model.TorchAllocatorModel`. Each candidate gives one row: its
peak reserved bytes on the device, whether it fits there, its driver calls and their modeled
time, and the smallest card it fits on.

The smallest card is found by bisection over the device capacity, between the trace's peak live
bytes (no allocator fits below) and a capacity known to fit, to within 1/256 of it. The upper
end is the candidate's own peak reserved bytes on the device for the torch model (with that much
memory no cudaMalloc fails, so the replay is the same one) and for gpumem that peak divided by
``gpu_memory_fraction`` (gpumem keeps its pool under that share), checked by a replay and
doubled until it fits. Fitting is taken as monotone in capacity; on a smaller card both
allocators only release cached memory earlier, which is what lets them fit below their
unconstrained peak.

Work is spread over processes by one :class:`concurrent.futures.ProcessPoolExecutor` that
:func:`tune` creates and shuts down itself (``jobs=1`` runs in this process); each worker
receives the trace once. Thread safety: :func:`tune` shares nothing between calls.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from gpumem.config import HANDLE_PER_GROWTH, MemoryConfig
from gpumem.errors import InvalidInputError, TraceFormatError
from gpumem.units import MiB, format_bytes, parse_size

__all__ = ["tune", "TuneResult", "Candidate", "gpumem_grid", "torch_grid", "device_capacity",
           "load_workload"]

#: presets of the gpumem grid (gpumem.observe.replay.replay_config: no CPU fallback, no margin)
PRESETS = ("default", "inference", "constrained")
#: max_split_size values tried besides each preset's own
GRID_MAX_SPLITS = (64 * MiB, 256 * MiB)
#: expandable_handle_size tried besides one page (with expandable segments on): larger physical
#: handles, fewer driver calls, less tight; "growth" is one handle per growth
#: (docs/expandable_segments.md, "Handle size")
GRID_HANDLE_SIZES: tuple[int | str, ...] = (20 * MiB, HANDLE_PER_GROWTH)
#: PyTorch settings tried (PYTORCH_CUDA_ALLOC_CONF values; "" is torch's default)
TORCH_CONFS = ("", "expandable_segments:True", "max_split_size_mb:128", "max_split_size_mb:512",
               "roundup_power2_divisions:4", "roundup_power2_divisions:8",
               "expandable_segments:True,max_split_size_mb:128",
               "expandable_segments:True,roundup_power2_divisions:4")
_PRESET_CALL = {"default": "default", "inference": "for_inference",
                "constrained": "for_constrained"}


@dataclass(frozen=True)
class Candidate:
    """One setting to replay: ``allocator`` "gpumem" (``preset`` + ``changes`` to MemoryConfig)
    or "torch" (``conf``, a PYTORCH_CUDA_ALLOC_CONF value)."""

    allocator: str
    preset: str = "default"
    changes: tuple[tuple[str, Any], ...] = ()
    conf: str = ""

    @property
    def config(self) -> str:
        """What a user pastes: a MemoryConfig expression, or a PYTORCH_CUDA_ALLOC_CONF value."""
        if self.allocator == "torch":
            return self.conf
        kw = [("cpu_fallback_enabled", False), ("min_free_bytes", 0), *self.changes]
        args = ", ".join(f"{k}={_literal(v)}" for k, v in kw)
        return f"MemoryConfig.{_PRESET_CALL[self.preset]}().replace({args})"

    @property
    def label(self) -> str:
        """A short name for tables."""
        if self.allocator == "torch":
            return self.conf or "(torch default)"
        return " ".join([self.preset] + [f"{k}={_short(v)}" for k, v in self.changes])

    def memory_config(self) -> MemoryConfig:
        from gpumem.observe.replay import replay_config
        return replay_config(self.preset).replace(**dict(self.changes))


def _literal(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= MiB and v % MiB == 0:
        return f"{v // MiB} << 20"
    return repr(v)


def _short(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= MiB:
        return format_bytes(v).replace(".00 ", "").replace(" ", "")
    return str(v)


def gpumem_grid(presets: Iterable[str] = PRESETS,
                max_split_sizes: Iterable[int | None] = GRID_MAX_SPLITS) -> list[Candidate]:
    """Each preset with expandable segments off/on, its own max_split_size and each of
    ``max_split_sizes``, release_before_grow on/off; and each preset with expandable segments
    on and each of GRID_HANDLE_SIZES."""
    out = []
    for preset in presets:
        if preset not in _PRESET_CALL:
            raise InvalidInputError(f"unknown gpumem preset {preset!r}; the presets are "
                                    f"{', '.join(PRESETS)}")
        base = Candidate("gpumem", preset).memory_config()
        own, default_exp = base.max_split_size, base.expandable_segments
        splits: list[Any] = [None] + [m for m in max_split_sizes if m != own]
        for exp in (False, True):
            for mss in splits:
                for rbg in (True, False):
                    ch: list[tuple[str, Any]] = []
                    if exp != default_exp:      # name only the change from the default
                        ch.append(("expandable_segments", exp))
                    if mss is not None:
                        ch.append(("max_split_size", mss))
                    if not rbg:
                        ch.append(("release_before_grow", False))
                    out.append(Candidate("gpumem", preset, tuple(ch)))
        for size in GRID_HANDLE_SIZES:
            ch = [] if default_exp else [("expandable_segments", True)]
            out.append(Candidate("gpumem", preset,
                                 tuple(ch + [("expandable_handle_size", size)])))
    return out


def torch_grid(confs: Iterable[str] = TORCH_CONFS) -> list[Candidate]:
    """The PyTorch settings, each checked now (a bad one fails before any replay)."""
    from gpumem.planning.torch_conf import parse_torch_conf
    out = []
    for conf in confs:
        parse_torch_conf(conf)
        out.append(Candidate("torch", conf=conf))
    return out


def device_capacity(device: str | int) -> int:
    """Bytes of the card to plan for: ``"sim:24GiB"`` (or a size, or an int)."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device <= 0:
            raise InvalidInputError(f"device capacity must be > 0 bytes, got {device}")
        return device
    if not isinstance(device, str):
        raise InvalidInputError(f"device must be a string such as 'sim:24GiB', got "
                                f"{type(device).__name__} {device!r}")
    from gpumem.backends import private_device_size
    spec = device.strip()
    if ":" in spec:                       # "sim:24GiB"; any other device string names no size
        spec = private_device_size(spec) or ""
    if not spec or spec.isdigit() or ":" in spec:
        raise InvalidInputError(f"device {device!r} has no size: tune plans for a card of a "
                                f"given capacity, e.g. --device sim:24GiB")
    cap = parse_size(spec, what=f"device {device!r} capacity")
    if cap <= 0:
        raise InvalidInputError(f"device {device!r}: the capacity must be > 0 bytes")
    return cap


def load_workload(source: Any) -> Any:
    """A TraceData from a gpumem trace, a PyTorch snapshot pickle, or a TraceData."""
    from gpumem.observe.trace import TraceData, read_trace
    if isinstance(source, TraceData):
        return source
    path = os.fspath(source)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    if head[:1] == b"\x80":                     # a pickle: PyTorch's _dump_snapshot()
        from gpumem.observe.torch_snapshot import read_torch_snapshot
        return read_torch_snapshot(path)
    return read_trace(path)


# --- evaluating one candidate (runs in a worker) ---------------------------------------------
_TRACE: Any = None


def _init_worker(trace: Any) -> None:
    """Runs once in each worker process (and in this one with ``jobs=1``)."""
    global _TRACE
    _TRACE = trace


@contextmanager
def _quiet() -> Iterator[None]:
    """The bisection runs out of memory on purpose: the pool's OOM and fragmentation
    warnings would be noise, so the gpumem logger shows errors only while candidates run."""
    logger = logging.getLogger("gpumem")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _run(cand: Candidate, capacity: int, series: bool = False) -> Any:
    if cand.allocator == "torch":
        from gpumem.planning.torch_replay import replay_torch_model
        return replay_torch_model(_TRACE, capacity=capacity, conf=cand.conf,
                                  record_series=series)
    from gpumem.observe.replay import replay
    return replay(_TRACE, f"sim:{capacity}B", cand.memory_config(), record_series=series)


def _fits(res: Any, capacity: int) -> bool:
    return res.num_ooms == 0 and res.peak_reserved_bytes <= capacity


def _min_capacity(cand: Candidate, res: Any, capacity: int, floor: int) -> int | None:
    """Smallest capacity (bytes, to 1/256) on which ``cand`` replays without OOM."""
    if cand.allocator == "torch":
        hi = res.peak_reserved_bytes if _fits(res, capacity) else capacity
    else:
        frac = cand.memory_config().gpu_memory_fraction
        hi = -(-int(res.peak_reserved_bytes / frac) // MiB) * MiB
    hi = max(hi, floor)
    for _ in range(8):                          # grow until something fits (up to 256x)
        if _fits(_run(cand, hi), hi):
            break
        hi *= 2
    else:
        return None
    lo = floor
    while hi - lo > max(hi >> 8, 2 * MiB):
        mid = (lo + hi) // 2
        if _fits(_run(cand, mid), mid):
            hi = mid
        else:
            lo = mid
    return hi


def _evaluate(cand: Candidate, capacity: int, floor: int, find_min: bool) -> dict[str, Any]:
    with _quiet():
        res = _run(cand, capacity)
        smallest = _min_capacity(cand, res, capacity, floor) if find_min else None
    return {
        "allocator": cand.allocator, "config": cand.config, "label": cand.label,
        "peak_reserved_bytes": res.peak_reserved_bytes, "peak_live_bytes": res.peak_live_bytes,
        "fits": _fits(res, capacity), "num_ooms": res.num_ooms,
        "driver_calls": res.driver_calls,
        "modeled_driver_seconds": getattr(res, "modeled_driver_seconds", None),
        "min_capacity_bytes": smallest,
    }


# --- the result -------------------------------------------------------------------------------
@dataclass
class TuneResult:
    """One row per candidate (dicts with ``allocator``, ``config``, ``label``,
    ``peak_reserved_bytes``, ``peak_live_bytes``, ``fits``, ``num_ooms``, ``driver_calls``,
    ``modeled_driver_seconds``, ``min_capacity_bytes``), best first; ``recommended`` is the
    fitting row with the least peak reserved bytes (None when nothing fits)."""

    trace: str
    capacity: int
    rows: list[dict[str, Any]]
    recommended: dict[str, Any] | None
    duration_s: float
    jobs: int
    #: label -> ``{"live", "reserved"}`` arrays of the best gpumem and best torch rows
    series: dict[str, dict] = field(default_factory=dict, repr=False)

    def best(self, allocator: str) -> dict[str, Any] | None:
        """The first (best) row of ``allocator``: fitting rows come first."""
        return next((r for r in self.rows if r["allocator"] == allocator), None)

    def as_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "capacity": self.capacity, "rows": self.rows,
                "recommended": self.recommended, "duration_s": self.duration_s,
                "jobs": self.jobs, "min_capacity_method": MIN_CAPACITY_METHOD}

    def table(self) -> str:
        fb = format_bytes
        head = (f"{'allocator':<9} {'config':<58} {'peak reserved':>13} {'fits':>4} "
                f"{'OOMs':>5} {'driver calls':>12} {'driver ms':>9} {'smallest card':>13}")
        lines = [f"tune {self.trace} on {fb(self.capacity)}: {len(self.rows)} candidates in "
                 f"{self.duration_s:.1f} s ({self.jobs} process(es))", head, "-" * len(head)]
        for r in self.rows:
            ms = r["modeled_driver_seconds"]
            card = r["min_capacity_bytes"]
            label = r["label"] if len(r["label"]) <= 58 else r["label"][:55] + "..."
            lines.append(
                f"{r['allocator']:<9} {label:<58} {fb(r['peak_reserved_bytes']):>13} "
                f"{'yes' if r['fits'] else 'NO':>4} {r['num_ooms']:>5,} {r['driver_calls']:>12,} "
                f"{'-' if ms is None else f'{ms * 1e3:.1f}':>9} "
                f"{'-' if card is None else fb(card):>13}")
        rec = self.recommended
        lines.append("")
        if rec is None:
            lines.append(f"nothing fits on {fb(self.capacity)}; see 'smallest card' for what "
                         f"each candidate needs")
        else:
            lines.append(f"recommended ({rec['allocator']}, least peak reserved that fits): "
                         f"{rec['config'] or '(PyTorch default: no PYTORCH_CUDA_ALLOC_CONF)'}")
        lines.append(f"smallest card: {MIN_CAPACITY_METHOD}")
        return "\n".join(lines)


MIN_CAPACITY_METHOD = ("bisection over the capacity between peak live bytes and a capacity "
                       "that fits, to within 1/256 (docs/torch_model.md)")


def _sort_key(r: dict[str, Any]) -> tuple:
    return (not r["fits"], r["peak_reserved_bytes"], r["driver_calls"])


def tune(trace: Any, device: str | int = "sim:24GiB", *,
         gpumem_configs: Sequence[Candidate] | None = None,
         torch_confs: Sequence[str] | None = None, jobs: int | None = None,
         find_min_capacity: bool = True, record_series: bool = False,
         progress: bool | Callable[[int, int], Any] = False) -> TuneResult:
    """Replay ``trace`` (a path to a gpumem trace or a PyTorch snapshot pickle, or a
    TraceData) under every candidate on ``device`` (``"sim:24GiB"``, a size, or bytes).

    ``gpumem_configs`` defaults to :func:`gpumem_grid`, ``torch_confs`` to
    :data:`TORCH_CONFS`; pass ``[]`` to leave one allocator out (both empty is an error).
    ``jobs`` processes (default: the CPU count, at most one per candidate; 1: this process).
    ``record_series`` also replays the best gpumem and best torch rows again to keep their
    live and reserved bytes over time (``result.series``, for :func:`plot_tune`).
    ``progress``: True for a tqdm bar (when tqdm is installed), or ``f(done, total)``.
    """
    import time
    capacity = device_capacity(device)
    data = load_workload(trace)
    if len(data) == 0:
        raise TraceFormatError(f"{data.name}: the trace has no events to replay")
    cands = list(gpumem_grid() if gpumem_configs is None else gpumem_configs)
    if any(not isinstance(c, Candidate) or c.allocator != "gpumem" for c in cands):
        raise InvalidInputError("gpumem_configs must be Candidate('gpumem', ...) items")
    cands += torch_grid(TORCH_CONFS if torch_confs is None else torch_confs)
    if not cands:
        raise InvalidInputError("the grid is empty: give at least one gpumem configuration "
                                "or one PyTorch setting")
    if jobs is None:
        jobs = os.cpu_count() or 1
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidInputError(f"jobs must be an int >= 1, got {jobs!r}")
    jobs = min(jobs, len(cands))
    floor = data.peak_live_bytes
    tick = _progress(progress, len(cands))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if jobs == 1:
        _init_worker(data)
        for c in cands:
            rows.append(_evaluate(c, capacity, floor, find_min_capacity))
            tick(len(rows))
    else:
        with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(data,)) as pool:
            futures = [pool.submit(_evaluate, c, capacity, floor, find_min_capacity)
                       for c in cands]
            for fut in as_completed(futures):
                rows.append(fut.result())
                tick(len(rows))
    tick(None)
    rows.sort(key=_sort_key)
    rec = next((r for r in rows if r["fits"]), None)
    result = TuneResult(trace=data.name, capacity=capacity, rows=rows, recommended=rec,
                        duration_s=time.perf_counter() - t0, jobs=jobs)
    if record_series:
        _init_worker(data)
        by_config = {(c.allocator, c.config): c for c in cands}
        for alloc in ("gpumem", "torch"):
            best = result.best(alloc)
            if best is not None:
                with _quiet():
                    res = _run(by_config[(alloc, best["config"])], capacity, series=True)
                result.series[f"{alloc}: {best['label']}"] = res.series
    return result


def _progress(progress: Any, total: int) -> Callable[[int | None], None]:
    """A ``tick(done)`` (``tick(None)`` closes): tqdm, a user callable, or nothing."""
    if callable(progress) and not isinstance(progress, bool):
        return lambda done: None if done is None else progress(done, total)
    if not progress:
        return lambda done: None
    try:
        from tqdm import tqdm
    except ImportError:                 # the `cli` extra is absent: no bar
        return lambda done: None
    import sys
    bar = tqdm(total=total, desc="tune", unit="candidate", leave=False, file=sys.stderr)

    def tick(done: int | None) -> None:
        if done is None:
            bar.close()
        else:
            bar.update(done - bar.n)
    return tick
