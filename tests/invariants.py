"""The invariant checker every pool/manager test calls after it has changed something.

``check(manager)`` runs the pool's own C-level check (blocks tile each segment, free neighbours of
one heap are merged, size-class lists and bitmaps agree, counters equal a recount) and then
checks from Python what a user can see:

- no two live blocks overlap, no two segments overlap, every block lies in its segment;
- ``MemoryStats``: ``reserved_bytes == in_use_bytes + cached_bytes`` and each field equals
  a recount over ``pool.segments()``;
- with ``live=`` (the buffers the test holds): ``active_buffers`` equals the number still alive,
  and each device buffer is a live block of the pool at its own address and size;
- the device agrees with the pool: on sim the driver's live segments are exactly the pool's
  (handles, bases, sizes, ``live_bytes == reserved``); expandable segments are exactly their
  mapped pages (the pages of every block that is not unmapped, holes whole pages, physical
  bytes = mapped bytes, every page handle mapped, one reservation each);
  on cpu ``bytes_held`` equals reserved; on
  OpenCL every pool segment is a live segment of the device.

It also holds the plain helpers test modules share (fixtures live in conftest.py):

- ``selected_backends(default)``: the backends named by ``GPUMEM_TEST_BACKENDS``, or ``default``
  when it is unset (conftest's fixtures: all four; modules written for the simulated device
  first pass ``("sim",)``); ``backend_device(name, ...)`` turns one into a device string,
  skipping an unavailable backend with its reason.
- ``sim_manager(capacity, ...)``: a MemoryManager on a fresh SimDevice, with a base config
  (``EXACT``: usable memory is the capacity; ``QUIET``: the same, no automatic responses).
- ``DATA``: gpumem's data folder (presets, shipped traces) where gpumem was imported from;
  ``require_checkout(what)``: the source checkout, or a skip when this copy of tests/ runs
  outside one (ci/package.sh runs it against an installed wheel).
- ``run_threads(work, args)``: ``work(a)`` for each ``a`` on its own thread, all at once; the
  exceptions they raised (the test asserts there are none).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

import gpumem
import gpumem_sim
from gpumem import FallbackBuffer, MemoryConfig, MemoryManager
from gpumem.backends import BACKEND_NAMES, canonical_device, get_backend

__all__ = ["DATA", "CHECKOUT", "require_checkout", "check", "live_ranges", "stats_without",
           "snapshot_state", "TEST_EXPANDABLE", "config_over",
           "ALL_BACKENDS", "selected_backends", "require_backend", "device_string",
           "backend_device", "EXACT", "QUIET", "sim_manager", "run_threads"]

#: every bundled backend, the ones every machine has first (a new registry row joins the
#: backend tests by itself)
ALL_BACKENDS = ("sim", "cpu", "opencl", "cuda")
ALL_BACKENDS += tuple(n for n in BACKEND_NAMES if n not in ALL_BACKENDS)

#: gpumem's data (model presets, the shipped traces) from the gpumem under test: the checkout's,
#: or an installed wheel's
DATA = Path(gpumem.__file__).resolve().parent / "data"
#: the folder that holds tests/: the source checkout, or a copy of tests/ outside any
CHECKOUT = Path(__file__).resolve().parents[1]


def require_checkout(what: str) -> Path:
    """The source checkout; skip the test (it reads ``what``: docs, README, LICENSE,
    pyproject.toml, which no wheel installs) where this copy of tests/ runs outside one."""
    if not (CHECKOUT / "pyproject.toml").is_file() or not (CHECKOUT / "gpumem").is_dir():
        pytest.skip(f"reads {what} of the source checkout; these tests run outside one "
                    f"(against an installed gpumem)")
    return CHECKOUT


def selected_backends(default: Iterable[str] = ALL_BACKENDS, *,
                      keep_unknown: bool = False) -> list[str]:
    """The backends named in ``GPUMEM_TEST_BACKENDS`` (comma list, any case), in the order of
    ``ALL_BACKENDS``; ``default`` when it is unset or empty. Unknown names are dropped, or with
    ``keep_unknown`` kept at the end (so ``require_backend`` fails them loudly)."""
    env = os.environ.get("GPUMEM_TEST_BACKENDS", "").strip()
    names = [n.strip().lower() for n in env.split(",") if n.strip()] or list(default)
    known = [n for n in ALL_BACKENDS if n in names]
    return known + [n for n in names if n not in ALL_BACKENDS] if keep_unknown else known


def require_backend(name: str) -> None:
    """Fail on a name that is no backend (a typo must not pass silently); skip the test, with
    the reason, when the backend is unavailable here."""
    if name not in ALL_BACKENDS:
        pytest.fail(f"GPUMEM_TEST_BACKENDS names an unknown backend {name!r}; choose among "
                    f"{', '.join(ALL_BACKENDS)}", pytrace=False)
    ok, reason = get_backend(name).availability()
    if not ok:
        pytest.skip(f"backend {name!r} unavailable: {reason}")


def device_string(name: str) -> str:
    """Device 0 of backend ``name``: ``"cpu"``, ``"sim:0"``, ``"opencl:0"``, ``"cuda:0"``."""
    return canonical_device(f"{name}:0")


def backend_device(name: str, capacity: int | str = "4GiB", **sim_options: Any) -> str:
    """``require_backend(name)``, then the device string of its device 0; for ``sim`` a fresh
    ``SimDevice(capacity, **sim_options)`` is installed as sim:0 first (replacing any)."""
    require_backend(name)
    if name == "sim":
        gpumem_sim.install(gpumem_sim.SimDevice(capacity, **sim_options))
    return device_string(name)


def libcuda_is_fake() -> bool | None:
    """True when the libcuda.so.1 this process loads is tests/fake_cuda, False when it is a real
    NVIDIA driver, None when there is none."""
    import ctypes
    try:
        return hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_live_allocations")
    except OSError:
        return None


def real_cuda_driver(backend: str) -> bool:
    """Whether `backend` is cuda on a real NVIDIA driver (not tests/fake_cuda): the driver's own
    rules then apply, e.g. a forked child cannot use the parent's CUDA state."""
    return backend == "cuda" and libcuda_is_fake() is False


#: The segment policy of the shared base configs (EXACT, QUIET, conftest's PERMISSIVE): the
#: library's default (auto) unless GPUMEM_TEST_SEGMENTS names another (tight, fast, plain);
#: GPUMEM_TEST_EXPANDABLE_SEGMENTS=0 still means plain (ci/test.sh's second pass on sim and on
#: the fake driver). Tests of one policy's mechanics name it themselves.
TEST_SEGMENTS = ("plain" if os.environ.get("GPUMEM_TEST_EXPANDABLE_SEGMENTS", "1") == "0"
                 else os.environ.get("GPUMEM_TEST_SEGMENTS", "auto"))
#: whether the base configs use expandable segments (where the device has virtual memory)
TEST_EXPANDABLE = TEST_SEGMENTS != "plain"

#: Usable memory is exactly the device's capacity (no fraction, no reserve, no min free), and an
#: out-of-memory is an error a test sees (no CPU fallback).
EXACT = dict(min_free_bytes=0, gpu_memory_fraction=1.0, reserve_bytes=0,
             cpu_fallback_enabled=False, segments=TEST_SEGMENTS)
#: ``EXACT`` with the automatic responses off: the driver is asked only what the test causes.
QUIET = dict(EXACT, release_before_grow=False, auto_release_at_high=False,
             auto_cleanup_at_critical=False)


def config_over(base: dict, changes: dict) -> dict:
    """``{**base, **changes}``, except that a test naming ``expandable_segments`` or
    ``expandable_handle_size`` (and not ``segments``) gets the policy those say: the base's
    ``segments`` (plain in the plain pass) is dropped, since ``segments="plain"`` with an
    older setting that says expandable is refused."""
    merged = {**base, **changes}
    if "segments" not in changes and ({"expandable_segments", "expandable_handle_size"}
                                      & changes.keys()):
        merged.pop("segments", None)
    return merged


def sim_manager(capacity: int | str, *, device: Any = None, back_memory: bool = False,
                seed: int = 0, install: bool = True, base: dict | None = None,
                **config: Any) -> tuple[Any, MemoryManager]:
    """``(device, manager)``: a fresh ``SimDevice(capacity, back_memory=, seed=)`` (or the given
    ``device``) and a MemoryManager on it with ``MemoryConfig(**{**base, **config})`` (``base``
    defaults to ``EXACT``). With ``install`` the device is installed as sim:0 (replacing any)
    and the manager opens "sim:0"; without, the manager is given the device object itself."""
    dev = device if device is not None else gpumem_sim.SimDevice(capacity, back_memory=back_memory,
                                                                 seed=seed)
    if install:
        gpumem_sim.install(dev)
    cfg = MemoryConfig(**config_over(EXACT if base is None else base, config))
    return dev, MemoryManager("sim:0" if install else dev, cfg)


def run_threads(work: Callable[[Any], None], args: Iterable[Any], *,
                timeout: float | None = None) -> list[BaseException]:
    """Run ``work(a)`` for each of ``args`` on its own thread, all started before any is
    joined (each join waits at most ``timeout`` seconds); what they raised, in no order."""
    errors: list[BaseException] = []

    def guarded(a: Any) -> None:
        try:
            work(a)
        except BaseException as exc:        # surfaced by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


def live_ranges(manager: Any) -> list[tuple[int, int, int]]:
    """``(start, end, id)`` of every live block, by address."""
    out = []
    for seg in manager.pool.segments():
        for b in seg["blocks"]:
            if b["state"] == "allocated":
                start = seg["base"] + b["offset"]
                out.append((start, start + b["size"], b["id"]))
    out.sort()
    return out


def stats_without(manager: Any, *names: str) -> dict:
    """``manager.stats().as_dict()`` minus the given fields."""
    d = manager.stats().as_dict()
    for n in names:
        d.pop(n, None)
    return d


def snapshot_state(manager: Any) -> tuple[dict, list]:
    """Everything a failed call must leave unchanged: the stats (minus num_ooms) and the
    segments with their blocks."""
    return stats_without(manager, "num_ooms"), manager.pool.segments()


def _check_device(manager: Any, segs: list[dict], reserved: int) -> None:
    dev = manager.device
    backend = getattr(dev, "backend", None)
    if manager.closed:
        return
    expandable = manager._expandable.layout() if manager._expandable is not None else {}
    for s in segs:
        if s["handle"] in expandable:
            # physical bytes = mapped bytes: the pages the manager mapped are exactly the pages
            # of the segment's blocks that are not unmapped; holes are whole pages
            mapped, reservation = expandable[s["handle"]]
            page = manager._expandable.page
            want = set()
            for b in s["blocks"]:
                if b["state"] == "unmapped":
                    assert b["offset"] % page == 0 and b["size"] % page == 0, (
                        f"expandable segment {s['handle']:#x}: hole {b} is not whole pages")
                else:
                    want.update(range(b["offset"] // page * page, b["offset"] + b["size"], page))
            blocks = s["blocks"]
            assert len(blocks) == 1 or blocks[-1]["state"] != "unmapped", (
                f"expandable segment {s['handle']:#x} ends in a hole {blocks[-1]}: the span "
                f"must shrink back (a growth at the end would be planned past it)")
            have = manager._expandable.pages(s["handle"])
            assert have == sorted(want), (
                f"expandable segment {s['handle']:#x}: pages mapped at {have[:8]}..., blocks "
                f"need {sorted(want)[:8]}...")
            assert s["size"] <= reservation and mapped == len(have) * page, (
                f"expandable segment {s['handle']:#x}: span {s['size']}, mapped {mapped}, "
                f"reserved {reservation}")
    assert set(expandable) <= {s["handle"] for s in segs}, "an expandable segment left the pool"
    if backend == "sim":
        assert dev.mapped_bytes == sum(m for m, _ in expandable.values()), (
            f"sim maps {dev.mapped_bytes} bytes, the pool's expandable segments span "
            f"{sum(m for m, _ in expandable.values())}")
        held = manager._expandable.held_pages if manager._expandable is not None else 0
        assert dev.live_mappings + held == dev.live_page_handles, (
            "a page is created but neither mapped nor held for a refused free")
        assert dev.live_reservations == len(expandable), "a reservation leaked or is missing"
        segs = [s for s in segs if s["handle"] not in expandable]
        sim = {s.handle: s for s in dev.segments()}
        pool = {s["handle"]: s for s in segs}
        assert set(sim) == set(pool), (
            f"sim holds segments {sorted(sim)} but the pool knows {sorted(pool)}")
        for h, s in pool.items():
            assert sim[h].base == s["base"], f"segment {h}: pool base differs from the driver's"
            assert sim[h].nbytes == s["size"], f"segment {h}: pool size differs from the driver's"
        held_bytes = manager._expandable.held_bytes if manager._expandable is not None else 0
        assert dev.live_bytes == reserved + held_bytes == manager.stats().reserved_bytes, (
            f"sim live_bytes {dev.live_bytes} != pool reserved {reserved} + held {held_bytes}")
        assert dev.live_segments == len(segs)
    elif backend == "cpu":
        held = dev.properties().extra["bytes_held"]
        assert held == reserved, f"cpu device holds {held} bytes, pool reserved {reserved}"
    elif backend == "opencl":
        for s in segs:
            assert dev.segment_size(s["handle"]) == s["size"]
        # every cached sub-buffer (Buffer.native) lies inside a segment the pool still has
        by_handle = {s["handle"]: s for s in segs}
        for ptr, (nbytes, _sub, handle) in list(dev.native_cache.items()):
            s = by_handle.get(handle)
            assert s is not None, f"native_cache holds {ptr:#x} of released segment {handle}"
            assert s["base"] <= ptr and ptr + nbytes <= s["base"] + s["size"], (ptr, nbytes, s)


def check(manager: Any, live: Iterable[Any] | None = None) -> None:
    """Assert every invariant of `manager` (see the module docstring)."""
    pool = manager.pool
    pool.check_invariants()
    segs = pool.segments()

    # segments and blocks ----------------------------------------------------------------------
    seg_ranges = sorted((s["base"], s["base"] + s["size"], s["handle"]) for s in segs)
    for (a0, a1, ha), (b0, b1, hb) in zip(seg_ranges, seg_ranges[1:]):
        assert a1 <= b0, f"segments {ha:#x} [{a0:#x},{a1:#x}) and {hb:#x} [{b0:#x},{b1:#x}) overlap"
    assert len({s["handle"] for s in segs}) == len(segs), "two segments share a handle"
    reserved = in_use = requested = cached = largest = nlive = 0
    ids = set()
    for s in segs:
        reserved += s["size"]
        end = 0
        for b in s["blocks"]:
            assert b["offset"] == end, f"segment {s['handle']:#x}: blocks do not tile"
            end = b["offset"] + b["size"]
            if b["state"] == "unmapped":        # a hole of an expandable segment: not reserved
                reserved -= b["size"]
            elif b["state"] == "allocated":
                nlive += 1
                in_use += b["size"]
                requested += b["requested"]
                assert 0 <= b["requested"] <= b["size"], f"block {b} requested more than its size"
                assert b["id"] not in ids, f"two live blocks share id {b['id']}"
                ids.add(b["id"])
            else:
                cached += b["size"]
                largest = max(largest, b["size"])
        assert end == s["size"], f"segment {s['handle']:#x}: blocks cover {end} of {s['size']}"
    ranges = live_ranges(manager)
    for (a0, a1, ia), (b0, b1, ib) in zip(ranges, ranges[1:]):
        assert a1 <= b0, f"live blocks {ia} [{a0:#x},{a1:#x}) and {ib} [{b0:#x},{b1:#x}) overlap"

    # stats ------------------------------------------------------------------------------------
    st = manager.stats()
    # pages the driver refused to free are held by the device: reserved, neither used nor cached
    held = manager._expandable.held_bytes if manager._expandable is not None else 0
    assert st.held_bytes == (0 if manager.closed else held), (st.held_bytes, held)
    assert st.reserved_bytes == st.in_use_bytes + st.cached_bytes + st.held_bytes, st
    assert st.reserved_bytes == reserved + st.held_bytes, (st.reserved_bytes, reserved)
    assert st.in_use_bytes == in_use, (st.in_use_bytes, in_use)
    assert st.requested_bytes == requested, (st.requested_bytes, requested)
    assert st.cached_bytes == cached, (st.cached_bytes, cached)
    assert st.largest_free_block == largest, (st.largest_free_block, largest)
    assert st.num_segments == len(segs), (st.num_segments, len(segs))
    assert st.num_allocs - st.num_frees == nlive, (st.num_allocs, st.num_frees, nlive)
    # freed blocks waiting for other streams stay allocated in the pool until collected
    pending = getattr(manager, "pending_free_count", 0)
    nlive -= pending
    assert 0 <= getattr(manager, "pending_free_bytes", 0) <= st.in_use_bytes
    assert st.peak_in_use_bytes >= st.in_use_bytes
    assert st.peak_reserved_bytes >= st.reserved_bytes
    assert st.segments_created - st.segments_released == st.num_segments, st
    assert st.active_buffers >= nlive
    assert 0.0 <= st.hit_rate() <= 1.0
    assert 0.0 <= st.fragmentation_ratio() <= 1.0

    if live is not None:
        alive = [b for b in live if b.alive]
        assert st.active_buffers == len(alive), (
            f"stats say {st.active_buffers} active buffers, the test holds {len(alive)} alive")
        device_bufs = [b for b in alive if not isinstance(b, FallbackBuffer)]
        fallback = len(alive) - len(device_bufs)
        assert st.active_buffers - nlive == fallback, (st.active_buffers, nlive, fallback)
        blocks = {}
        for s in segs:
            for b in s["blocks"]:
                if b["state"] == "allocated":
                    blocks[b["id"]] = (s["base"] + b["offset"], b["size"], b["requested"])
        for buf in device_bufs:
            assert buf.id in blocks, f"buffer {buf!r} is alive but not a live block of the pool"
            addr, size, req = blocks[buf.id]
            assert buf.ptr == addr and buf.nbytes == req and size >= buf.nbytes, (buf, blocks[buf.id])

    _check_device(manager, segs, reserved)
