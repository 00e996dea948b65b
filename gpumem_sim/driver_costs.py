"""A model of what CUDA driver calls cost, so that speed on a GPU can be judged without one.

:class:`~gpumem_sim.SimDevice` charges each driver call it serves a modeled time from a
:class:`DriverCostModel` (by default :data:`CUDA_DRIVER_COSTS`) and adds it up in
``dev.modeled_driver_seconds``; a replay reports it beside wall time. The model never sleeps:
it only counts. Where every figure comes from is in ``docs/driver_costs.md``.

A cost is ``fixed + per_byte * nbytes`` seconds. A table entry is a number (a fixed cost) or a
pair ``(fixed, per_byte)``. Which calls grow with their size follows the measurement on an
H200: freeing (``cuMemFree``, ``cuMemRelease``) grows with the size, creating (``cuMemAlloc``,
``cuMemCreate``) barely does, and mapping, setting access and unmapping cost per mapping
whatever the handle's size (as PyTorch's expandable-segments notes say: mapping ten 2 MiB
handles takes ten times as long as mapping one 20 MiB handle). :data:`CUDA_DRIVER_COSTS_A100`,
the published figures used before, charges physical memory per page instead.

A call the driver refuses (out of memory, an injected fault) is charged its fixed part only:
the driver spent the call's overhead but did no per-byte work (and a refused map is not
followed by a set-access). A call rejected for invalid
arguments is a pool bug, not driver work, and is not charged.
"""
from __future__ import annotations

import math
import numbers
import threading
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Union

from gpumem.errors import InvalidInputError

__all__ = ["CALLS", "CUDA_DRIVER_COSTS", "CUDA_DRIVER_COSTS_A100", "SIM_OPS", "DriverCostModel",
           "DriverCostMeter", "ModeledDriverTime", "CostArg", "make_meter"]

#: The driver calls the model prices (see docs/driver_costs.md for the CUDA call behind each).
CALLS: tuple[str, ...] = (
    "segment_alloc", "segment_free", "vm_reserve", "vm_free", "vm_create", "vm_map",
    "vm_set_access", "vm_unmap", "vm_release", "synchronize", "event_record", "event_query",
    "stream_query", "mem_get_info",
)

_US = 1e-6
_MIB = 1 << 20
_PAGE = 2 << 20          # CUDA's VMM granularity on current GPUs; published figures are per page

#: The default table for CUDA: ``call -> (fixed seconds, seconds per byte)``, measured on an
#: NVIDIA H200 (driver 580.159.04, CUDA 13.0) on 2026-11-27 by
#: ``asv_benchmarks/driver_costs_gpu.py --repeats 30 --in-situ`` (level GPU; medians, sizes 2 to
#: 256 MiB; docs/driver_costs.md, where a second H200 of the same day is beside it). A
#: per-byte part only where the sweep showed one: freeing grows with the size freed, creating
#: barely does. cuMemSetAccess costs 17.9 us per call plus 21.2 us per mapping it covers (1 to
#: 20 mappings measured); every mapping gpumem or PyTorch makes is covered by exactly one such
#: call, so the per-mapping part is charged with each cuMemMap (1.65 us + 21.2 us) and
#: ``vm_set_access`` is the per-call part.
CUDA_DRIVER_COSTS: Mapping[str, tuple[float, float]] = MappingProxyType({
    "segment_alloc": (35.5 * _US, 0.077 * _US / _MIB),    # cuMemAlloc: 36 us at 2 MiB, 55 at 256
    "segment_free": (31.0 * _US, 0.3 * _US / _MIB),       # cuMemFree: 31 us at 2 MiB, 107 at 256
    "vm_reserve": (2.7 * _US, 0.0),                       # cuMemAddressReserve, 1 GiB
    "vm_free": (2.6 * _US, 0.0),                          # cuMemAddressFree, 1 GiB
    "vm_create": (9.3 * _US, 0.015 * _US / _MIB),         # cuMemCreate: 9.3 us at 2 MiB, 10.3 at 64
    "vm_map": ((1.65 + 21.2) * _US, 0.0),                 # cuMemMap + its mapping's access grant
    "vm_set_access": (17.9 * _US, 0.0),                   # cuMemSetAccess, per call
    "vm_unmap": (23.4 * _US, 0.0),                        # cuMemUnmap, per mapping
    "vm_release": (10.3 * _US, 0.3 * _US / _MIB),         # cuMemRelease: 11 us at 2 MiB, 29 at 64
    "synchronize": (1.3 * _US, 0.0),                      # cuCtxSynchronize, idle device
    "event_record": (1.2 * _US, 0.0),                     # cuEventRecord, timing disabled
    "event_query": (0.6 * _US, 0.0),                      # cuEventQuery, completed event
    "stream_query": (0.65 * _US, 0.0),                    # cuStreamQuery, idle stream
    "mem_get_info": (6.0 * _US, 0.0),                     # cuMemGetInfo
})

#: The table before the first GPU run: published figures, mostly for an A100 (VMM latencies
#: for 2 MiB pages from kvcached's bench_vmm; the rest as docs/driver_costs.md says, estimates
#: marked there). ``SimDevice(driver_costs=CUDA_DRIVER_COSTS_A100)`` prices calls with it.
CUDA_DRIVER_COSTS_A100: Mapping[str, tuple[float, float]] = MappingProxyType({
    "segment_alloc": (50.0 * _US, 193.32 * _US / _PAGE),   # cuMemAlloc: call + pages created
    "segment_free": (14.0 * _US, 0.0),                    # cuMemFree (synchronizes)
    "vm_reserve": (19.0 * _US, 0.0),                      # cuMemAddressReserve
    "vm_free": (19.0 * _US, 0.0),                         # cuMemAddressFree (estimate)
    "vm_create": (0.0, 193.32 * _US / _PAGE),             # cuMemCreate, per 2 MiB page
    "vm_map": (1.45 * _US, 0.0),                          # cuMemMap, per handle
    "vm_set_access": (35.99 * _US, 0.0),                  # cuMemSetAccess, per handle
    "vm_unmap": (25.63 * _US, 0.0),                       # cuMemUnmap, per handle
    "vm_release": (14.0 * _US, 0.0),                      # cuMemRelease (estimate)
    "synchronize": (10.0 * _US, 0.0),                     # cuCtxSynchronize, idle device
    "event_record": (0.25 * _US, 0.0),                    # cuEventRecord, timing disabled
    "event_query": (0.2 * _US, 0.0),                      # cuEventQuery (estimate)
    "stream_query": (0.2 * _US, 0.0),                     # cuStreamQuery (estimate: as above)
    "mem_get_info": (4.85 * _US, 0.0),                    # cuMemGetInfo
})

#: Which priced calls each entry of :attr:`SimDevice.calls` (its ``op``) stands for. The sim's
#: ``vm_map`` maps and sets access in one call, as gpumem's CUDA backend does with
#: cuMemMap + cuMemSetAccess, so it is charged both; ``vm_map_many`` logs one ``vm_map_many``
#: per handle (a cuMemMap each) and one ``vm_set_access`` for the whole range. ``event_record``,
#: ``event_query``, ``stream_query`` and ``mem_get_info`` are charged but not logged (queries
#: would flood the log; see SimDevice).
SIM_OPS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "alloc": ("segment_alloc",), "free": ("segment_free",), "synchronize": ("synchronize",),
    "vm_reserve": ("vm_reserve",), "vm_free": ("vm_free",), "vm_create": ("vm_create",),
    "vm_map": ("vm_map", "vm_set_access"), "vm_map_many": ("vm_map",),
    "vm_set_access": ("vm_set_access",), "vm_unmap": ("vm_unmap",),
    "vm_release": ("vm_release",), "event_record": ("event_record",),
    "event_query": ("event_query",), "stream_query": ("stream_query",),
    "mem_get_info": ("mem_get_info",),
})

CostArg = Union[float, "tuple[float, float]"]


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"{what} must be a number of seconds (a finite float >= 0), got "
                                f"{type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise InvalidInputError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return v


def _entry(key: str, value: Any) -> tuple[float, float]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise InvalidInputError(
                f"driver_costs[{key!r}] must be seconds or a pair (fixed seconds, seconds per "
                f"byte), got a sequence of {len(value)}: {value!r}")
        return (_seconds(value[0], f"driver_costs[{key!r}][0] (fixed)"),
                _seconds(value[1], f"driver_costs[{key!r}][1] (per byte)"))
    return _seconds(value, f"driver_costs[{key!r}]"), 0.0


class DriverCostModel:
    """The default CUDA table merged with ``costs`` (``call -> seconds`` or ``call -> (fixed
    seconds, seconds per byte)``); an overridden call takes exactly the given entry.

    Raises :class:`~gpumem.errors.InvalidInputError` naming the key for an unknown call name,
    a negative, non-finite or non-numeric value, or a mapping of the wrong type.
    """

    __slots__ = ("_table",)

    def __init__(self, costs: Mapping[str, CostArg] | None = None) -> None:
        table = dict(CUDA_DRIVER_COSTS)
        if costs is not None:
            if not isinstance(costs, Mapping):
                raise InvalidInputError(
                    f"driver_costs must be a mapping of call name to seconds or (fixed, per "
                    f"byte), got {type(costs).__name__} {costs!r}")
            for key, value in costs.items():
                if key not in table:
                    raise InvalidInputError(f"driver_costs has an unknown call {key!r}; the "
                                            f"calls are {', '.join(CALLS)}")
                table[key] = _entry(key, value)
        self._table: Mapping[str, tuple[float, float]] = MappingProxyType(table)

    @property
    def table(self) -> Mapping[str, tuple[float, float]]:
        """``call -> (fixed seconds, seconds per byte)`` for every call in :data:`CALLS`."""
        return self._table

    def cost(self, call: str, nbytes: int = 0) -> float:
        """Seconds that ``call`` on ``nbytes`` bytes is modeled to take."""
        entry = self._table.get(call) if isinstance(call, str) else None
        if entry is None:
            raise InvalidInputError(f"unknown driver call {call!r}; the calls are "
                                    f"{', '.join(CALLS)}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise InvalidInputError(f"nbytes must be an int >= 0, got {nbytes!r}")
        fixed, per_byte = entry
        return fixed + per_byte * int(nbytes)

    def cost_of(self, op: str, nbytes: int = 0, ok: bool = True) -> float:
        """Seconds charged for one logged sim call (``SimCall.op``, see :data:`SIM_OPS`): every
        priced call it stands for; when it failed (not ``ok``), only the first one's fixed
        part (a refused cuMemMap is not followed by cuMemSetAccess)."""
        calls = SIM_OPS.get(op)
        if calls is None:
            raise InvalidInputError(f"unknown sim call {op!r}; the sim logs "
                                    f"{', '.join(SIM_OPS)}")
        if not ok:
            return self._table[calls[0]][0]
        total = 0.0
        for call in calls:
            fixed, per_byte = self._table[call]
            total += fixed + per_byte * nbytes
        return total

    def log_cost(self, calls: Iterable[Any]) -> float:
        """Seconds charged for a sequence of :class:`~gpumem_sim.SimCall` (``dev.calls``)."""
        return sum(self.cost_of(c.op, c.nbytes, c.outcome == "ok") for c in calls)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DriverCostModel) and dict(self._table) == dict(other._table)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._table.items() if CUDA_DRIVER_COSTS[k] != v}
        return f"DriverCostModel({changed or ''})"


class DriverCostMeter:
    """Adds up the modeled time of the calls a device makes (one per SimDevice). ``charge`` is
    called with the device's lock held; the meter's own lock makes reads consistent."""

    __slots__ = ("model", "_plan", "_counts", "_seconds", "_total", "_lock")

    def __init__(self, model: DriverCostModel) -> None:
        self.model = model
        index = {c: i for i, c in enumerate(CALLS)}
        # op -> ((call index, fixed, per_byte), ...): one dict lookup per charged call
        self._plan = {op: tuple((index[c], *model.table[c]) for c in calls)
                      for op, calls in SIM_OPS.items()}
        self._counts = [0] * len(CALLS)
        self._seconds = [0.0] * len(CALLS)
        self._total = 0.0
        self._lock = threading.Lock()

    def charge(self, op: str, nbytes: int = 0, ok: bool = True) -> None:
        """Charge one sim call (``op`` as logged); a failed one pays only the fixed part of
        its first priced call, as :meth:`DriverCostModel.cost_of` says."""
        plan = self._plan[op]
        with self._lock:
            if not ok:
                i, fixed, _ = plan[0]
                self._counts[i] += 1
                self._seconds[i] += fixed
                self._total += fixed
                return
            for i, fixed, per_byte in plan:
                s = fixed + per_byte * nbytes
                self._counts[i] += 1
                self._seconds[i] += s
                self._total += s

    @property
    def seconds(self) -> float:
        return self._total

    def breakdown(self) -> dict[str, tuple[int, float]]:
        """``call -> (count, seconds)`` for the calls charged so far, in :data:`CALLS` order."""
        with self._lock:
            return {c: (n, s) for c, n, s in zip(CALLS, self._counts, self._seconds) if n}

    def reset(self) -> None:
        with self._lock:
            self._counts = [0] * len(CALLS)
            self._seconds = [0.0] * len(CALLS)
            self._total = 0.0


def make_meter(driver_costs: Any) -> DriverCostMeter | None:
    """The meter for ``SimDevice(driver_costs=...)``: None or True -> the CUDA table, False ->
    no model, a mapping -> the table with those overrides, a DriverCostModel -> that model."""
    if driver_costs is False:
        return None
    if driver_costs is None or driver_costs is True:
        return DriverCostMeter(DriverCostModel())
    if isinstance(driver_costs, DriverCostModel):
        return DriverCostMeter(driver_costs)
    if isinstance(driver_costs, Mapping):
        return DriverCostMeter(DriverCostModel(driver_costs))
    raise InvalidInputError(
        f"driver_costs must be None (the CUDA table), False (off), a mapping of overrides "
        f"(call -> seconds or (fixed, per byte)) or a DriverCostModel, got "
        f"{type(driver_costs).__name__} {driver_costs!r}")


class ModeledDriverTime:
    """The modeled-time properties of :class:`~gpumem_sim.SimDevice` (a mixin; the device sets
    ``_meter`` from its ``driver_costs`` argument and charges it as it logs calls)."""

    _meter: DriverCostMeter | None

    @property
    def driver_costs(self) -> DriverCostModel | None:
        """The cost model charging this device's calls (None when the model is off)."""
        return self._meter.model if self._meter is not None else None

    @property
    def modeled_driver_seconds(self) -> float:
        """Seconds the driver calls so far would have taken on a GPU (0.0 with
        ``driver_costs=False``). Failed calls are charged their fixed part; zeroed by
        ``reset_counters()``."""
        return self._meter.seconds if self._meter is not None else 0.0

    @property
    def modeled_driver_breakdown(self) -> dict[str, tuple[int, float]]:
        """``call -> (count, seconds)`` of the priced calls made so far (names from
        :data:`CALLS`; a sim ``vm_map`` counts as vm_map and vm_set_access)."""
        return self._meter.breakdown() if self._meter is not None else {}
