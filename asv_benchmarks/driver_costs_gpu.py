"""The CUDA driver cost model (gpumem_sim.CUDA_DRIVER_COSTS) against the real driver, on a GPU.

    python asv_benchmarks/driver_costs_gpu.py [--json out.json] [--repeats 40]

1. Each priced call timed on the GPU through cuda.bindings.driver (median of ``--repeats``;
   the binding adds well under a microsecond), beside the model's figure for the same size.
2. cuMemSetAccess over k one-page mappings side by side (k = 1..20): whether its cost is per
   call or per mapping.
3. In situ (``--in-situ``): four traces replayed on ``cuda:0`` with every driver call that goes
   through ``CudaDevice._call`` timed alone, so replay time splits into driver time per call
   name and the rest (gpumem's own work and the replay loop).
4. The shipped and synthetic traces replayed on ``cuda:0`` and on ``sim:80GiB`` with expandable
   segments (2 MiB and 20 MiB handles) and plain segments: real replay seconds on the GPU beside
   the modeled driver seconds plus the sim's own replay time, so the model's verdict (expandable
   vs plain) can be checked against the card's.
Prints a table for each part; exits 1 when no usable GPU is found.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gpumem

MiB = 1 << 20


def _ok(res: Any, what: str) -> Any:
    from cuda.bindings import driver as drv
    err = res[0] if isinstance(res, tuple) else res
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err}")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else None


def _median_us(setup: Callable[[], Any], timed: Callable[[Any], Any],
               teardown: Callable[[Any], None], repeats: int) -> float:
    """Median microseconds of ``timed(setup())``; teardown is not timed."""
    samples = []
    for _ in range(repeats):
        state = setup()
        t0 = time.perf_counter_ns()
        out = timed(state)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        teardown(out if out is not None else state)
    return statistics.median(samples)


def measure_calls(repeats: int) -> list[dict]:
    from cuda.bindings import driver as drv

    from gpumem_sim.driver_costs import DriverCostModel
    model = DriverCostModel()
    _ok(drv.cuInit(0), "cuInit")
    dev = _ok(drv.cuDeviceGet(0), "cuDeviceGet")
    ctx = _ok(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = drv.CUmemAccessDesc()
    access.location = prop.location
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    nothing = (lambda: None)
    rows: list[dict] = []

    def model_us(key: str, nbytes: int = 0) -> float:
        return model.cost(key, nbytes) * 1e6

    def add(call: str, key: str, nbytes: int, us: float, modeled: float | None = None) -> None:
        m = model_us(key, nbytes) if modeled is None else modeled
        rows.append({"call": call, "model_key": key, "bytes": nbytes, "measured_us": us,
                     "model_us": m})

    for n in (2 * MiB, 20 * MiB, 64 * MiB, 256 * MiB):
        us = _median_us(nothing, lambda _: _ok(drv.cuMemAlloc(n), "cuMemAlloc"),
                        lambda p: drv.cuMemFree(p), repeats)
        add(f"cuMemAlloc {n // MiB} MiB", "segment_alloc", n, us)
        us = _median_us(lambda: _ok(drv.cuMemAlloc(n), "cuMemAlloc"),
                        lambda p: _ok(drv.cuMemFree(p), "cuMemFree"), lambda p: None, repeats)
        add(f"cuMemFree {n // MiB} MiB", "segment_free", n, us)
    va_size = 1 << 30
    us = _median_us(nothing, lambda _: _ok(drv.cuMemAddressReserve(va_size, 0, 0, 0),
                                           "cuMemAddressReserve"),
                    lambda a: drv.cuMemAddressFree(a, va_size), repeats)
    add("cuMemAddressReserve 1 GiB", "vm_reserve", va_size, us)
    us = _median_us(lambda: _ok(drv.cuMemAddressReserve(va_size, 0, 0, 0), "reserve"),
                    lambda a: _ok(drv.cuMemAddressFree(a, va_size), "cuMemAddressFree"),
                    lambda a: None, repeats)
    add("cuMemAddressFree 1 GiB", "vm_free", va_size, us)
    va = int(_ok(drv.cuMemAddressReserve(va_size, 0, 0, 0), "cuMemAddressReserve"))
    for n in (2 * MiB, 20 * MiB, 64 * MiB):
        us = _median_us(nothing, lambda _: _ok(drv.cuMemCreate(n, prop, 0), "cuMemCreate"),
                        lambda h: drv.cuMemRelease(h), repeats)
        add(f"cuMemCreate {n // MiB} MiB", "vm_create", n, us)
        us = _median_us(lambda: _ok(drv.cuMemCreate(n, prop, 0), "cuMemCreate"),
                        lambda h: _ok(drv.cuMemRelease(h), "cuMemRelease"), lambda h: None,
                        repeats)
        add(f"cuMemRelease {n // MiB} MiB", "vm_release", n, us)
        h = _ok(drv.cuMemCreate(n, prop, 0), "cuMemCreate")
        us = _median_us(nothing, lambda _: _ok(drv.cuMemMap(va, n, 0, h, 0), "cuMemMap"),
                        lambda _: drv.cuMemUnmap(va, n), repeats)
        add(f"cuMemMap {n // MiB} MiB", "vm_map", n, us)

        def mapped():
            _ok(drv.cuMemMap(va, n, 0, h, 0), "cuMemMap")
        us = _median_us(mapped, lambda _: _ok(drv.cuMemSetAccess(va, n, [access], 1),
                                              "cuMemSetAccess"),
                        lambda _: drv.cuMemUnmap(va, n), repeats)
        add(f"cuMemSetAccess {n // MiB} MiB", "vm_set_access", n, us)

        def mapped_accessible():
            mapped()
            _ok(drv.cuMemSetAccess(va, n, [access], 1), "cuMemSetAccess")
        us = _median_us(mapped_accessible, lambda _: _ok(drv.cuMemUnmap(va, n), "cuMemUnmap"),
                        lambda _: None, repeats)
        add(f"cuMemUnmap {n // MiB} MiB", "vm_unmap", n, us)
        drv.cuMemRelease(h)
    # one-page handles side by side; first ten: one cuMemSetAccess and one cuMemUnmap for the
    # whole range against ten each (the driver allows a range that spans several mappings)
    pages = [_ok(drv.cuMemCreate(2 * MiB, prop, 0), "cuMemCreate") for _ in range(20)]

    def map_ten():
        for i, h in enumerate(pages[:10]):
            _ok(drv.cuMemMap(va + i * 2 * MiB, 2 * MiB, 0, h, 0), "cuMemMap")
        _ok(drv.cuMemSetAccess(va, 20 * MiB, [access], 1), "cuMemSetAccess")
    us = _median_us(map_ten, lambda _: _ok(drv.cuMemUnmap(va, 20 * MiB), "cuMemUnmap"),
                    lambda _: None, repeats)
    add("cuMemUnmap 10 x 2 MiB mappings, one call", "vm_unmap", 20 * MiB, us,
        modeled=10 * model_us("vm_unmap"))

    def unmap_each(_):
        for i in range(10):
            _ok(drv.cuMemUnmap(va + i * 2 * MiB, 2 * MiB), "cuMemUnmap")
    us = _median_us(map_ten, unmap_each, lambda _: None, repeats)
    add("cuMemUnmap 10 x 2 MiB mappings, ten calls", "vm_unmap", 20 * MiB, us,
        modeled=10 * model_us("vm_unmap"))
    # cuMemSetAccess over k one-page mappings: per call or per mapping?
    for k in (1, 2, 5, 10, 20):
        def map_k(k=k):
            for i in range(k):
                _ok(drv.cuMemMap(va + i * 2 * MiB, 2 * MiB, 0, pages[i], 0), "cuMemMap")

        def unmap_k(_, k=k):
            for i in range(k):
                drv.cuMemUnmap(va + i * 2 * MiB, 2 * MiB)
        us = _median_us(map_k, lambda _, k=k: _ok(drv.cuMemSetAccess(va, k * 2 * MiB, [access], 1),
                                                   "cuMemSetAccess"), unmap_k, repeats)
        add(f"cuMemSetAccess over {k} x 2 MiB mappings", "vm_set_access", k * 2 * MiB, us)
    for h in pages:
        drv.cuMemRelease(h)
    drv.cuMemAddressFree(va, va_size)

    us = _median_us(nothing, lambda _: _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize"),
                    lambda _: None, repeats)
    add("cuCtxSynchronize (idle)", "synchronize", 0, us)
    stream = _ok(drv.cuStreamCreate(1), "cuStreamCreate")
    flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    us = _median_us(lambda: _ok(drv.cuEventCreate(flags), "cuEventCreate"),
                    lambda ev: (_ok(drv.cuEventRecord(ev, stream), "cuEventRecord"), ev)[1],
                    lambda ev: drv.cuEventDestroy(ev), repeats)
    add("cuEventRecord", "event_record", 0, us)
    ev = _ok(drv.cuEventCreate(flags), "cuEventCreate")
    drv.cuEventRecord(ev, stream)
    drv.cuStreamSynchronize(stream)
    us = _median_us(nothing, lambda _: drv.cuEventQuery(ev), lambda _: None, repeats)
    add("cuEventQuery", "event_query", 0, us)
    us = _median_us(nothing, lambda _: drv.cuStreamQuery(stream), lambda _: None, repeats)
    add("cuStreamQuery", "stream_query", 0, us)
    us = _median_us(nothing, lambda _: _ok(drv.cuMemGetInfo(), "cuMemGetInfo"),
                    lambda _: None, repeats)
    add("cuMemGetInfo", "mem_get_info", 0, us)
    drv.cuEventDestroy(ev)
    drv.cuStreamDestroy(stream)
    return rows


def _traces(names: tuple[str, ...] | None = None) -> list[tuple[str, Any]]:
    import gpumem
    from gpumem.observe import synth_traces
    data = Path(gpumem.__file__).resolve().parent / "data" / "traces"
    traces: list[tuple[str, Any]] = [(p.name.split(".")[0], p)
                                     for p in sorted(data.glob("*.csv.gz"))]
    traces += [(f"synth {k}", synth_traces.synthesize(k, seed=0))
               for k in ("serving", "varlen", "training")]
    return [t for t in traces if names is None or t[0] in names]


def in_situ_rows() -> list[dict]:
    """Replays on cuda:0 (default config) with each driver call made through CudaDevice._call
    timed alone, up to the replay's last event (the manager's close() after it is not counted,
    as in ReplayResult.driver_calls); the rest of the replay time is gpumem's and the loop's."""
    from gpumem.backends import open_device
    from gpumem.observe.replay import replay, replay_config
    dev = open_device("cuda:0")
    orig = dev._call
    stats: dict[str, list] = {}

    def call(what: str, fn: Any, *args: Any) -> Any:
        def timed(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                s = stats.setdefault(what, [0, 0.0])
                s[0] += 1
                s[1] += time.perf_counter() - t0
        return orig(what, timed, *args)

    rows = []
    dev._call = call
    try:
        for name, trace in _traces(("bert_varlen_infer", "gpt2_train", "synth serving",
                                    "synth varlen")):
            stats.clear()
            at_end: dict[str, list] = {}

            def snapshot(done: int, total: int) -> None:
                if done == total:                   # the last event, before close()
                    at_end.update({k: list(v) for k, v in stats.items()})
            res = replay(trace, dev, replay_config("default"), progress=snapshot)
            driver = sum(v[1] for v in at_end.values())
            rows.append({"trace": name, "replay_seconds": res.duration_s,
                         "driver_seconds": driver, "driver_calls": res.driver_calls,
                         "calls": {k: {"count": v[0], "mean_us": v[1] / v[0] * 1e6}
                                   for k, v in sorted(at_end.items())}})
    finally:
        del dev._call
    return rows


def replay_rows() -> list[dict]:
    from gpumem.observe.replay import replay, replay_config
    traces = _traces()
    modes = {"expandable 2 MiB": dict(expandable_segments=True),
             "expandable 20 MiB": dict(expandable_segments=True,
                                       expandable_handle_size=20 * MiB),
             "plain": dict(expandable_segments=False)}
    rows = []
    for name, trace in traces:
        for mode, change in modes.items():
            cfg = replay_config("default").replace(**change)
            gpu = replay(trace, "cuda:0", cfg)
            sim = replay(trace, "sim:80GiB", cfg)
            rows.append({"trace": name, "mode": mode, "gpu_seconds": gpu.duration_s,
                         "gpu_ratio": gpu.reserved_live_ratio, "gpu_calls": gpu.driver_calls,
                         "sim_seconds": sim.duration_s,
                         "modeled_driver_seconds": sim.modeled_driver_seconds,
                         "sim_calls": sim.driver_calls, "num_ooms": gpu.num_ooms})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--no-replays", action="store_true")
    ap.add_argument("--in-situ", action="store_true",
                    help="also time each driver call inside four replays on cuda:0")
    args = ap.parse_args(argv)
    from gpumem.backends.cuda import BACKEND
    ok, reason = BACKEND.availability()
    if not ok:
        print(f"skipped: no usable GPU: {reason}")
        return 1
    calls = measure_calls(args.repeats)
    print(f"{'call':44} {'measured us':>12} {'model us':>10} {'model/real':>10}")
    for r in calls:
        print(f"{r['call']:44} {r['measured_us']:12.2f} {r['model_us']:10.2f} "
              f"{r['model_us'] / r['measured_us']:10.2f}")
    situ = in_situ_rows() if args.in_situ else []
    for r in situ:
        print(f"\nin situ: {r['trace']}: replay {r['replay_seconds'] * 1e3:.1f} ms, driver calls "
              f"{r['driver_seconds'] * 1e3:.1f} ms ({r['driver_calls']} calls), the rest "
              f"{(r['replay_seconds'] - r['driver_seconds']) * 1e3:.1f} ms")
        for k, v in r["calls"].items():
            print(f"    {k:28} {v['count']:8d} x {v['mean_us']:8.2f} us")
    replays = [] if args.no_replays else replay_rows()
    if replays:
        print(f"\n{'trace':20} {'mode':18} {'GPU s':>8} {'sim s':>8} {'modeled s':>10} "
              f"{'GPU calls':>9} {'sim calls':>9} {'ratio':>6} {'OOMs':>4}")
        for r in replays:
            print(f"{r['trace']:20} {r['mode']:18} {r['gpu_seconds']:8.3f} "
                  f"{r['sim_seconds']:8.3f} {r['modeled_driver_seconds']:10.3f} "
                  f"{r['gpu_calls']:9d} {r['sim_calls']:9d} {r['gpu_ratio']:6.3f} "
                  f"{r['num_ooms']:4d}")
    if args.json:
        Path(args.json).write_text(json.dumps({"calls": calls, "in_situ": situ,
                                               "replays": replays}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
