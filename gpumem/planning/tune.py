"""Which allocator settings fit a recorded workload on which card: ``gpumem.tune``.

A trace (gpumem's ``t_ns,op,id,size`` CSV, or a PyTorch memory snapshot pickle) is replayed
under a small grid of candidates: gpumem configurations through the real pool on a simulated
device (:func:`gpumem.replay`), and PyTorch allocator settings through
:class:`~gpumem.planning.torch_model.TorchAllocatorModel`.

The card. A card of N bytes means what each allocator has on such a card by default
(:class:`~gpumem.planning.card.Card`: on CUDA, for both, the card less the driver and one
context), and each row is replayed on a simulated device of exactly that size. A gpumem row
runs with the settings a user pastes (its preset's CPU fallback, ``min_free_bytes`` and
``gpu_memory_fraction`` included, soft or hard as the preset has them), except that the CPU
fallback is switched off in the replay so that a request the device refused is counted (an OOM
here is a CPU fallback there).

The objective, in this order: fits with margin (no OOM even on a device smaller by the
headroom: one more of the trace's largest request, or ``headroom_fraction`` of its peak live
bytes, whichever is larger), then least modeled driver time (the sim's driver cost model), then
least peak reserved bytes.

The smallest card of a row is found by bisection over the card's size (of the same kind),
between the trace's peak live bytes (no allocator fits below) and a size known to fit, to
within 1/128 of it; fitting is taken as monotone in the size.

Work is spread over processes by one :class:`concurrent.futures.ProcessPoolExecutor` that
:func:`tune` creates and shuts down itself (``jobs=1`` runs in this process); each worker
receives the trace once. Thread safety: :func:`tune` shares nothing between calls.
"""
from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from gpumem.config import SEGMENT_POLICIES as CONFIG_SEGMENT_POLICIES, MemoryConfig
from gpumem.errors import InvalidInputError, TraceFormatError
from gpumem.planning.card import Card, card_size
from gpumem.units import MiB, format_bytes

__all__ = ["tune", "TuneResult", "Candidate", "gpumem_grid", "torch_grid", "card_size",
           "device_capacity", "load_workload", "SEGMENT_POLICIES"]

#: presets of the gpumem grid, each as a user has it (CPU fallback, min_free_bytes included)
PRESETS = ("default", "inference", "constrained")
#: the segment policies tried with each preset: name -> the MemoryConfig fields that select it
#: (auto, the default, needs none: the line to paste then names no segment setting)
SEGMENT_POLICIES: dict[str, dict[str, Any]] = {
    name: ({} if name == "auto" else {"segments": name}) for name in CONFIG_SEGMENT_POLICIES}
#: max_split_size values tried with plain segments besides the preset's own (an expandable
#: segment ignores it); none by default: on the shipped traces 64 and 256 MiB changed no
#: figure of the default and inference presets, only rows that tie
PLAIN_SPLIT_SIZES: tuple[int, ...] = ()
#: PyTorch settings tried (PYTORCH_CUDA_ALLOC_CONF values; "" is torch's default)
TORCH_CONFS = ("", "expandable_segments:True", "max_split_size_mb:128",
               "roundup_power2_divisions:4")
#: fraction of the trace's peak live bytes in the headroom (see the module docstring)
HEADROOM_FRACTION = 0.05
_PRESET_CALL = {"default": "default", "inference": "for_inference",
                "constrained": "for_constrained"}
#: smallest-card bisection stops within 1/2**_CARD_PRECISION_BITS of the size
_CARD_PRECISION_BITS = 7


def _preset_config(preset: str) -> MemoryConfig:
    if preset not in _PRESET_CALL:
        raise InvalidInputError(f"unknown gpumem preset {preset!r}; the presets are "
                                f"{', '.join(PRESETS)}")
    return getattr(MemoryConfig, _PRESET_CALL[preset])()


@dataclass(frozen=True)
class Candidate:
    """One setting to replay: ``allocator`` "gpumem" (``preset`` + ``changes``, MemoryConfig
    fields over the preset) or "torch" (``conf``, a PYTORCH_CUDA_ALLOC_CONF value)."""

    allocator: str
    preset: str = "default"
    changes: tuple[tuple[str, Any], ...] = ()
    conf: str = ""

    def _user_changes(self) -> list[tuple[str, Any]]:
        """The changes that differ from the preset: what the user has to write."""
        base = _preset_config(self.preset)
        return [(k, v) for k, v in self.changes if getattr(base, k) != v]

    @property
    def config(self) -> str:
        """What a user pastes: a MemoryConfig expression (user settings only), or a
        PYTORCH_CUDA_ALLOC_CONF value."""
        if self.allocator == "torch":
            return self.conf
        kw = self._user_changes()
        call = f"MemoryConfig.{_PRESET_CALL[self.preset]}()"
        if not kw:
            return call
        return f"{call}.replace({', '.join(f'{k}={_literal(v)}' for k, v in kw)})"

    @property
    def label(self) -> str:
        """A full, short name for tables: ``"default, plain, max_split_size=256MiB"``."""
        if self.allocator == "torch":
            return self.conf or "(torch default)"
        cfg = self.memory_config()
        policy = _policy_name(cfg)
        seg_fields = {"expandable_segments", "expandable_handle_size", "segments"}
        extra = [f"{k}={_short(v)}" for k, v in self._user_changes() if k not in seg_fields]
        return ", ".join([self.preset, policy] + extra)

    def user_config(self) -> MemoryConfig:
        """The configuration the pasted line builds."""
        return _preset_config(self.preset).replace(**dict(self.changes))

    def memory_config(self) -> MemoryConfig:
        """What the replay runs: :meth:`user_config` with the CPU fallback off (a request the
        device refuses is counted, not served from host memory) and tracking off."""
        return self.user_config().replace(cpu_fallback_enabled=False, track_allocations=False,
                                          track_stacks=False)


def _policy_name(cfg: MemoryConfig) -> str:
    name = cfg.segment_policy
    if name == "tight" and cfg.tight_handle_size:
        return f"handles {_short(cfg.tight_handle_size)}"
    return name


def _literal(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= MiB and v % MiB == 0:
        return f"{v // MiB} << 20"
    return repr(v)


def _short(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v >= MiB:
        return format_bytes(v).replace(".00 ", "").replace(" ", "")
    return str(v)


def gpumem_grid(presets: Iterable[str] = PRESETS,
                policies: Iterable[str] | None = None,
                plain_split_sizes: Iterable[int] = PLAIN_SPLIT_SIZES) -> list[Candidate]:
    """Each preset with each segment policy (:data:`SEGMENT_POLICIES`), and with plain
    segments and each of ``plain_split_sizes`` as its ``max_split_size`` (when not already
    the preset's own)."""
    names = list(SEGMENT_POLICIES if policies is None else policies)
    for name in names:
        if name not in SEGMENT_POLICIES:
            raise InvalidInputError(f"unknown segment policy {name!r}; the policies are "
                                    f"{', '.join(SEGMENT_POLICIES)}")
    out = []
    for preset in presets:
        base = _preset_config(preset)
        for name in names:
            out.append(Candidate("gpumem", preset, tuple(SEGMENT_POLICIES[name].items())))
        if "plain" in names:
            for mss in plain_split_sizes:
                if mss != base.max_split_size:
                    out.append(Candidate("gpumem", preset,
                                         tuple(SEGMENT_POLICIES["plain"].items())
                                         + (("max_split_size", mss),)))
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
    """Bytes of the card to plan for (kept for callers of the old name; see card_size)."""
    return card_size(device)


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


def headroom_bytes(data: Any, fraction: float = HEADROOM_FRACTION) -> int:
    """The margin a row must keep: one more of the trace's largest request at its peak, or
    ``fraction`` of its peak live bytes (what a next run with other inputs may add), whichever
    is larger."""
    from gpumem.observe.trace import OP_ALLOC
    sizes = data.sizes[data.ops == OP_ALLOC]
    largest = int(sizes.max()) if len(sizes) else 0
    return max(largest, int(fraction * data.peak_live_bytes))


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


def _run(cand: Candidate, capacity: int, series: bool = False,
         config: MemoryConfig | None = None) -> Any:
    if cand.allocator == "torch":
        from gpumem.planning.torch_replay import replay_torch_model
        return replay_torch_model(_TRACE, capacity=capacity, conf=cand.conf,
                                  record_series=series)
    from gpumem.observe.replay import replay
    from gpumem.planning.card import sim_device
    return replay(_TRACE, sim_device(capacity), config or cand.memory_config(),
                  record_series=series)


def _fits(res: Any) -> bool:
    return res.num_ooms == 0 and getattr(res, "cpu_fallbacks", 0) == 0


def _fits_on(cand: Candidate, capacity: int) -> bool:
    """Whether ``cand`` replays without OOM on ``capacity`` bytes: the replay stops at the
    first refusal (the rest of it cannot change the answer; the margin and smallest-card
    checks ask only this, and a failing one used to replay every remaining event)."""
    from gpumem.errors import OutOfMemoryError
    if cand.allocator == "torch":
        from gpumem.planning.torch_replay import replay_torch_model
        try:
            return _fits(replay_torch_model(_TRACE, capacity=capacity, conf=cand.conf,
                                            stop_on_oom=True))
        except OutOfMemoryError:
            return False
    from gpumem.observe.replay import replay
    from gpumem.planning.card import sim_device
    try:
        return _fits(replay(_TRACE, sim_device(capacity), cand.memory_config(),
                            stop_on_oom=True))
    except OutOfMemoryError:
        return False


def _smallest_card(cand: Candidate, card: Card, fits_here: bool, floor: int) -> int | None:
    """Smallest card size (bytes, of ``card``'s kind, to 1/128) on which ``cand`` replays
    without OOM; None when even 256 times the card does not do."""
    def fits_on(total: int) -> bool:
        cap = card.resized(total).capacity_for(cand.allocator)
        return cap > 0 and _fits_on(cand, cap)
    hi = card.total
    if not fits_here:
        for _ in range(8):                      # grow until it fits (up to 256x)
            hi *= 2
            if fits_on(hi):
                break
        else:
            return None
    lo = min(floor, hi)                         # below the peak live bytes nothing fits
    while hi - lo > max(hi >> _CARD_PRECISION_BITS, 2 * MiB):
        mid = (lo + hi) // 2
        if fits_on(mid):
            hi = mid
        else:
            lo = mid
    return -(-hi // MiB) * MiB


def _limit(cand: Candidate, capacity: int, peak_live: int) -> str:
    """What bounds a row on this card: the tightest of its settings' limits (the memory
    fraction, the free-memory margin, a fixed reserve) or the card itself. (A cache cap,
    ``max_pool_size``, only ever returns memory: it costs driver calls, never a fit.)"""
    fb = format_bytes
    if cand.allocator == "torch":
        text, bound = f"the card: {fb(capacity)} for PyTorch", capacity
    else:
        cfg = cand.memory_config()
        terms = [(capacity, "the card")]
        # only hard limits bound a row: the soft ones (the defaults) trim the cache
        if cfg.is_hard("gpu_memory_fraction") and cfg.gpu_memory_fraction < 1.0:
            terms.append((int(capacity * cfg.gpu_memory_fraction),
                          f"gpu_memory_fraction={cfg.gpu_memory_fraction:g}"))
        if cfg.is_hard("min_free_bytes") and cfg.min_free_bytes:
            terms.append((capacity - cfg.min_free_bytes,
                          f"min_free_bytes={_short(cfg.min_free_bytes)}"))
        if cfg.is_hard("reserve_bytes") and cfg.reserve_bytes:
            terms.append((capacity - cfg.reserve_bytes,
                          f"reserve_bytes={_short(cfg.reserve_bytes)}"))
        bound, name = min(terms, key=lambda t: t[0])
        text = f"{name}: pool <= {fb(max(bound, 0))}"
    if peak_live > bound:
        text += f", below the trace's {fb(peak_live)} live at its peak"
    return text


def _evaluate(cand: Candidate, card: Card, floor: int, headroom: int,
              find_min: bool) -> dict[str, Any]:
    capacity = card.capacity_for(cand.allocator)
    with _quiet():
        res = _run(cand, capacity)
        fits = _fits(res)
        margin = fits and capacity > headroom and _fits_on(cand, capacity - headroom)
        smallest = _smallest_card(cand, card, fits, floor) if find_min or not fits else None
        limit = None if fits else _limit(cand, capacity, floor)
    return {
        "allocator": cand.allocator, "config": cand.config, "label": cand.label,
        "capacity": capacity,
        "peak_reserved_bytes": res.peak_reserved_bytes, "peak_live_bytes": res.peak_live_bytes,
        "fits": fits, "fits_with_margin": margin, "num_ooms": res.num_ooms,
        "driver_calls": res.driver_calls,
        "modeled_driver_seconds": getattr(res, "modeled_driver_seconds", None),
        "min_capacity_bytes": smallest, "limit": limit,
    }


def objective(row: dict[str, Any]) -> tuple:
    """Sort key, best first: fits with margin, fits, least modeled driver time, least peak
    reserved (rows that do not fit: by the smallest card they need)."""
    ms = row["modeled_driver_seconds"]
    if not row["fits"]:
        card = row["min_capacity_bytes"]
        return (2, math.inf if card is None else card, row["peak_reserved_bytes"],
                len(row["config"]))
    return (0 if row["fits_with_margin"] else 1, math.inf if ms is None else ms,
            row["peak_reserved_bytes"], row["driver_calls"], len(row["config"]))


# --- the result -------------------------------------------------------------------------------
@dataclass
class TuneResult:
    """One row per candidate (dicts with ``id``, ``allocator``, ``config`` (the line to
    paste), ``label``, ``capacity`` (the bytes replayed on), ``peak_reserved_bytes``,
    ``peak_live_bytes``, ``fits``, ``fits_with_margin``, ``num_ooms``, ``driver_calls``,
    ``modeled_driver_seconds``, ``min_capacity_bytes`` (the smallest card, of the same kind),
    ``limit`` (what bounds a row that does not fit)), best first by :func:`objective`.
    ``recommended`` is the best row of the primary allocator (gpumem when it was tried) when
    it fits, else None."""

    trace: str
    card: Card
    headroom: int
    rows: list[dict[str, Any]]
    recommended: dict[str, Any] | None
    duration_s: float
    jobs: int
    #: label -> ``{"live", "reserved"}`` arrays of the best gpumem and best torch rows
    series: dict[str, dict] = field(default_factory=dict, repr=False)

    @property
    def capacity(self) -> int:
        """The card's size in bytes."""
        return self.card.total

    def best(self, allocator: str) -> dict[str, Any] | None:
        """The first (best) row of ``allocator``."""
        return next((r for r in self.rows if r["allocator"] == allocator), None)

    def smallest_card(self, allocator: str | None = None) -> dict[str, Any] | None:
        """The row (of ``allocator``, or of either) that needs the smallest card; None when
        no row has one."""
        rows = [r for r in self.rows if r["min_capacity_bytes"] is not None
                and allocator in (None, r["allocator"])]
        return min(rows, key=lambda r: (r["min_capacity_bytes"], objective(r)), default=None)

    def as_dict(self) -> dict[str, Any]:
        from gpumem.planning.tune_report import OBJECTIVE, margin_text
        return {"trace": self.trace, "capacity": self.card.total, "card_kind": self.card.kind,
                "gpumem_capacity": self.card.gpumem_bytes,
                "torch_capacity": self.card.torch_bytes, "assumed": self.card.explain(),
                "headroom_bytes": self.headroom, "margin": margin_text(self.headroom),
                "objective": OBJECTIVE, "rows": self.rows, "recommended": self.recommended,
                "duration_s": self.duration_s, "jobs": self.jobs,
                "min_capacity_method": MIN_CAPACITY_METHOD}

    def table(self) -> str:
        from gpumem.planning.tune_report import render
        return render(self)


MIN_CAPACITY_METHOD = ("bisection over the card's size between peak live bytes and a size "
                       "that fits, to within 1/128 (docs/torch_model.md)")


def tune(trace: Any, device: str | int = "24GiB", *, card_kind: str = "cuda",
         gpumem_configs: Sequence[Candidate] | None = None,
         torch_confs: Sequence[str] | None = None, jobs: int | None = None,
         find_min_capacity: bool = True, record_series: bool = False,
         headroom_fraction: float = HEADROOM_FRACTION,
         progress: bool | Callable[[int, int], Any] = False) -> TuneResult:
    """Replay ``trace`` (a path to a gpumem trace or a PyTorch snapshot pickle, or a
    TraceData) under every candidate on a card of ``device`` bytes (``"24GiB"``,
    ``"sim:24GiB"`` or an int) of kind ``card_kind`` (``"cuda"``: gpumem has what CUDA's
    usable-memory reserve leaves; ``"sim"``: the whole card).

    ``gpumem_configs`` defaults to :func:`gpumem_grid`, ``torch_confs`` to
    :data:`TORCH_CONFS`; pass ``[]`` to leave one allocator out (both empty is an error).
    ``jobs`` processes (default: the CPU count, at most one per candidate; 1: this process).
    ``find_min_capacity``: the smallest card of every row (rows that do not fit get it
    always). ``headroom_fraction``: see :func:`headroom_bytes`. ``record_series`` also
    replays the best gpumem and best torch rows again to keep their live and reserved bytes
    over time (``result.series``, for :func:`gpumem.observe.plot.plot_reserved_comparison`). ``progress``: True for a tqdm bar
    (when tqdm is installed), or ``f(done, total)``.
    """
    import time
    card = Card(card_size(device), card_kind)
    if isinstance(headroom_fraction, bool) or not isinstance(headroom_fraction, (int, float)) \
            or not 0.0 <= headroom_fraction < 1.0:
        raise InvalidInputError(f"headroom_fraction must be a number in [0, 1), got "
                                f"{headroom_fraction!r}")
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
    floor, headroom = data.peak_live_bytes, headroom_bytes(data, headroom_fraction)
    tick = _progress(progress, len(cands))
    t0 = time.perf_counter()
    by_index: dict[int, dict[str, Any]] = {}
    args = (card, floor, headroom, find_min_capacity)
    if jobs == 1:
        _init_worker(data)
        for i, c in enumerate(cands):
            by_index[i] = _evaluate(c, *args)
            tick(len(by_index))
    else:
        # the costliest first (the PyTorch model replays in Python, several times slower
        # than the pool), so that no long candidate starts last and runs alone
        order = sorted(range(len(cands)), key=lambda i: cands[i].allocator != "torch")
        with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(data,)) as pool:
            futures = {pool.submit(_evaluate, cands[i], *args): i for i in order}
            for fut in as_completed(futures):
                by_index[futures[fut]] = fut.result()
                tick(len(by_index))
    tick(None)
    counters = {"gpumem": 0, "torch": 0}
    rows = []
    for i in range(len(cands)):                 # ids follow the grid's order: stable
        r = by_index[i]
        counters[r["allocator"]] += 1
        rows.append({"id": f"{r['allocator'][0]}{counters[r['allocator']]}", **r})
    rows.sort(key=objective)
    primary = "gpumem" if counters["gpumem"] else "torch"
    best = next(r for r in rows if r["allocator"] == primary)
    result = TuneResult(trace=data.name, card=card, headroom=headroom, rows=rows,
                        recommended=best if best["fits"] else None,
                        duration_s=time.perf_counter() - t0, jobs=jobs)
    if record_series:
        _init_worker(data)
        by_config = {(c.allocator, c.config): c for c in cands}
        for alloc in ("gpumem", "torch"):
            row = result.best(alloc)
            if row is not None:
                with _quiet():
                    res = _run(by_config[(alloc, row["config"])], row["capacity"], series=True)
                result.series[f"{alloc}: {row['label']}"] = res.series
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
