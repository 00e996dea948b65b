"""The simulated device's driver cost model (gpumem_sim.driver_costs), level **real**: the sim is
the device every replay and benchmark runs on, and its modeled driver time is the figure that
judges on this machine what a pool would cost on a GPU. These tests pin down that the time
charged is exactly the table applied to the calls the device served, and that bad tables are
refused before anything changes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import gpumem
import gpumem_sim
from gpumem.backends.host import HostDevice
from gpumem.errors import DriverOutOfMemory, InvalidInputError
from gpumem.observe.replay import replay, replay_config
from gpumem.observe.trace import read_trace
from gpumem.units import MiB
from gpumem_sim import (CALLS, CUDA_DRIVER_COSTS, CUDA_DRIVER_COSTS_A100, DriverCostModel,
                        SimDevice)
from gpumem_sim.driver_costs import SIM_OPS

G = 2 * MiB
#: a real PyTorch trace shipped inside the package (found beside an installed wheel too)
TRACE = Path(gpumem.__file__).parent / "data" / "resnet50_train_step1.csv.gz"


@pytest.fixture(scope="module")
def trace():
    return read_trace(TRACE).head(3000)


def test_table_prices_exactly_the_calls():
    """The default table has one (fixed, per-byte) entry per call name, all finite and >= 0,
    and every priced call is one the sim can make (no entry that nothing charges)."""
    assert tuple(CUDA_DRIVER_COSTS) == CALLS
    assert tuple(DriverCostModel().table) == CALLS
    for call, (fixed, per_byte) in CUDA_DRIVER_COSTS.items():
        assert math.isfinite(fixed) and fixed >= 0 and math.isfinite(per_byte) and per_byte >= 0
    charged = {c for calls in SIM_OPS.values() for c in calls}
    assert charged == set(CALLS)


def test_cost_is_fixed_plus_per_byte():
    """A cost is its fixed part plus its per-byte part times the size; mapping costs per call,
    whatever the handle's size (what the H200 sweep of 2026-11-27 showed and the table
    encodes), freeing grows with the size freed."""
    m = DriverCostModel()
    fixed, per_byte = CUDA_DRIVER_COSTS["vm_create"]
    assert m.cost("vm_create", 4 * G) == pytest.approx(fixed + per_byte * 4 * G)
    assert m.cost("segment_free", 4 * G) > m.cost("segment_free", G)
    a100 = DriverCostModel(CUDA_DRIVER_COSTS_A100)       # the published table: per page
    assert a100.cost("vm_create", 4 * G) == pytest.approx(4 * a100.cost("vm_create", G))
    assert m.cost("vm_map", 64 * G) == m.cost("vm_map", G) == CUDA_DRIVER_COSTS["vm_map"][0]
    fixed, per_byte = CUDA_DRIVER_COSTS["segment_alloc"]
    assert m.cost("segment_alloc", 10 * G) == pytest.approx(fixed + per_byte * 10 * G)
    assert m.cost("synchronize") == CUDA_DRIVER_COSTS["synchronize"][0]


@pytest.mark.parametrize("expandable", [False, True])
def test_replay_time_is_the_log_priced_by_the_model(trace, expandable):
    """A replay's modeled driver time equals the model's price of the sim's call log up to the
    end of the replay (before the manager closes), plus its mem_get_info and stream queries
    (counted, not logged); and the
    device's total after close is the price of the whole log. Both modes, so expandable
    segments' vm_* calls are priced too (a vm_map also pays set-access; a vm_map_many
    pays one set-access for its range)."""
    dev = SimDevice("80GiB")
    marks = []

    def progress(done, total):
        if done == total:
            marks.append((len(dev.calls), dev.mem_get_info_calls, dev.stream_query_calls))

    # tight: one-page handles, so a miss maps several handles with one access call
    cfg = replay_config("default").replace(segments="tight" if expandable else "plain")
    res = replay(trace, dev, cfg, progress=progress)
    n_log, n_info, n_query = marks[-1]
    model = dev.driver_costs
    log = dev.calls
    assert len(log) < gpumem_sim.CALL_LOG_LIMIT          # nothing dropped from the log
    expect = (model.log_cost(log[:n_log]) + n_info * model.cost("mem_get_info")
              + n_query * model.cost("stream_query"))
    assert res.modeled_driver_seconds > 0
    assert res.modeled_driver_seconds == pytest.approx(expect, rel=1e-12)
    assert dev.modeled_driver_seconds == pytest.approx(
        model.log_cost(log) + dev.mem_get_info_calls * model.cost("mem_get_info")
        + dev.stream_query_calls * model.cost("stream_query"), rel=1e-12)
    counts = {c: n for c, (n, _) in res.modeled_driver_breakdown.items()}
    ops = [c.op for c in log[:n_log]]
    if expandable:
        # a miss maps its pages with one vm_map_many: a cuMemMap each, one access call
        maps = ops.count("vm_map") + ops.count("vm_map_many")
        assert counts["vm_map"] == maps > 0
        assert counts["vm_set_access"] == ops.count("vm_map") + ops.count("vm_set_access") > 0
        assert counts["vm_set_access"] < maps
    else:
        assert counts["segment_alloc"] == ops.count("alloc") > 0
    assert sum(s for _, s in res.modeled_driver_breakdown.values()) == pytest.approx(
        res.modeled_driver_seconds, rel=1e-12)


def test_result_reports_modeled_time_beside_wall_time(trace):
    """str(result) (what `gpumem replay` prints) shows the modeled time on the events line, and
    as_dict() (its --json) carries it, JSON-serializable."""
    res = replay(trace, "sim:80GiB")
    line = next(ln for ln in str(res).splitlines() if ln.strip().startswith("events"))
    assert "events/s" in line and "modeled" in line
    d = json.loads(json.dumps(res.as_dict()))
    assert d["modeled_driver_seconds"] == res.modeled_driver_seconds > 0
    assert set(d["modeled_driver_breakdown"]) <= set(CALLS)


def test_overrides_apply_and_the_rest_stays_default():
    """A mapping overrides exactly its keys: a segment alloc then costs the given fixed part, a
    free the given (fixed, per byte); the other calls keep the CUDA figures."""
    dev = SimDevice("1GiB", driver_costs={"segment_alloc": 1.0, "segment_free": (0.5, 1e-9)})
    h, _ = dev.alloc_segment(100 * MiB)
    dev.free_segment(h)
    assert dev.modeled_driver_seconds == pytest.approx(1.0 + 0.5 + 1e-9 * 100 * MiB)
    assert dev.driver_costs.table["vm_map"] == CUDA_DRIVER_COSTS["vm_map"]
    assert dev.modeled_driver_breakdown == {
        "segment_alloc": (1, 1.0), "segment_free": (1, pytest.approx(0.5 + 1e-9 * 100 * MiB))}
    model = DriverCostModel({"vm_map": 2e-6})
    assert SimDevice("1GiB", driver_costs=model).driver_costs is model


def test_failed_calls_pay_their_fixed_part_only():
    """A refused allocation (injected or genuine OOM) and a refused page creation are charged
    the call's fixed cost, not the per-byte work that never happened; a refused map pays the
    map's fixed cost and no set-access."""
    costs = {"segment_alloc": (1.0, 1.0), "vm_create": (2.0, 1.0), "vm_map": 8.0,
             "vm_set_access": 16.0, "vm_reserve": 0.0}
    dev = SimDevice("64MiB", driver_costs=costs, fail_after=0)
    with pytest.raises(DriverOutOfMemory):
        dev.alloc_segment(MiB)
    dev.clear_faults()
    with pytest.raises(DriverOutOfMemory):
        dev.alloc_segment(128 * MiB)                 # genuine: larger than the device
    with pytest.raises(DriverOutOfMemory):
        dev.vm_create(64 * G)
    assert dev.modeled_driver_seconds == 1.0 + 1.0 + 2.0
    assert dev.modeled_driver_breakdown == {"segment_alloc": (2, 2.0), "vm_create": (1, 2.0)}
    va, page = dev.vm_reserve(4 * G), dev.vm_create(G)
    dev.inject_vm(map_after=0)
    with pytest.raises(DriverOutOfMemory):
        dev.vm_map(va, G, page)
    assert dev.modeled_driver_breakdown["vm_map"] == (1, 8.0)
    assert "vm_set_access" not in dev.modeled_driver_breakdown
    assert dev.modeled_driver_seconds == pytest.approx(4.0 + 2.0 + G + 8.0)
    assert dev.modeled_driver_seconds == pytest.approx(dev.driver_costs.log_cost(dev.calls))


def test_events_and_queries_are_charged_and_reset_zeroes():
    """Event record and query, and mem_get_info, are priced though not logged; reset_counters()
    zeroes the modeled time with the other counters."""
    dev = SimDevice("1GiB", driver_costs={"event_record": 1.0, "event_query": 2.0,
                                          "mem_get_info": 4.0})
    e = dev.record_event(0)
    dev.event_done(e)
    dev.event_done(e)
    dev.mem_get_info()
    assert dev.modeled_driver_seconds == 1.0 + 2 * 2.0 + 4.0 and dev.calls == []
    dev.reset_counters()
    assert dev.modeled_driver_seconds == 0.0 and dev.modeled_driver_breakdown == {}


def test_model_off_and_backends_without_one_report_zero(trace):
    """driver_costs=False turns the model off (0.0 and an empty breakdown after real traffic);
    a replay on a backend with no model (the host) reports 0.0."""
    dev = SimDevice("80GiB", driver_costs=False)
    res = replay(trace, dev)
    assert dev.driver_costs is None and dev.alloc_calls > 0
    assert res.modeled_driver_seconds == dev.modeled_driver_seconds == 0.0
    assert res.modeled_driver_breakdown == {} and dev.modeled_driver_breakdown == {}
    assert "modeled" not in str(res)
    assert replay(trace.head(500), HostDevice()).modeled_driver_seconds == 0.0


@pytest.mark.parametrize("costs, key", [
    ({"vm_mapp": 1e-6}, "vm_mapp"),
    ({"vm_map": -1e-6}, "vm_map"),
    ({"vm_map": float("nan")}, "vm_map"),
    ({"vm_map": float("inf")}, "vm_map"),
    ({"vm_map": "1us"}, "vm_map"),
    ({"vm_map": True}, "vm_map"),
    ({"vm_create": (1e-6, -1.0)}, "vm_create"),
    ({"vm_create": (1e-6,)}, "vm_create"),
    ({"vm_create": (1e-6, 1e-9, 0.0)}, "vm_create"),
    ({"vm_create": None}, "vm_create"),
])
def test_bad_tables_raise_naming_the_key(costs, key):
    """An unknown call, a negative, non-finite or non-numeric figure, or a malformed pair is
    refused with InvalidInputError naming the key; the device is not created."""
    with pytest.raises(InvalidInputError, match=f"'{key}'"):
        SimDevice("1GiB", driver_costs=costs)
    with pytest.raises(InvalidInputError, match=f"'{key}'"):
        DriverCostModel(costs)


def test_bad_arguments_raise():
    """driver_costs of the wrong type, cost() of an unknown call or a negative size: a clear
    InvalidInputError saying what is allowed."""
    for bad in (5, "cuda", [("vm_map", 1.0)]):
        with pytest.raises(InvalidInputError, match="driver_costs must be"):
            SimDevice("1GiB", driver_costs=bad)
    m = DriverCostModel()
    with pytest.raises(InvalidInputError, match="the calls are"):
        m.cost("cuMemMap")
    with pytest.raises(InvalidInputError, match="nbytes"):
        m.cost("vm_map", -1)
    with pytest.raises(InvalidInputError, match="the sim logs"):
        m.cost_of("mmap", 0)
