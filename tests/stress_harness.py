"""A multi-threaded stress run of one MemoryManager on a host-backed simulated device.

Used twice: briefly by tests/manager/test_stress.py (in the suite) and at scale by ci/soak.sh
(``python tests/stress_harness.py --ops 1000000 ...``).

Eight threads share one manager:
- ``workers`` allocators: mixed sizes (64 B .. 64 MiB, log-uniform), four streams,
  ``record_stream`` on another stream with work submitted there, batches and
  ``malloc_async`` now and then; every live buffer carries a pattern derived from its id at
  its start, middle and end, checked before every free (an overlap or an early reuse
  overwrites someone's pattern);
- one device thread that completes the streams' simulated work (so deferred frees resolve);
- one maintenance thread: ``snapshot()``, ``stats()``, ``empty_cache()``, ``shrink()``,
  ``collect_pending_frees()`` and ``pool.check_invariants()``;
- with ``sleep=True`` one more, the *sleeper*: it allocates patterned buffers in a region, puts
  the tag to sleep (with backup) and wakes it (retrying a wake the injected faults refuse),
  checks every pattern after each wake and frees some, while the others run.

Afterwards every buffer is freed and checked, and the run verifies: pool invariants, exact
counters (allocations == frees, nothing in use or pending), and after ``empty_cache()`` the
device holds 0 bytes and no events; the streams are destroyed cleanly.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import gpumem_sim
from gpumem import FallbackBuffer, MemoryConfig, MemoryManager
from gpumem.config import parse_handle_size
from gpumem.errors import DriverError, OutOfMemoryError
from gpumem.units import MiB, parse_size

PATTERN = 16                              # bytes written at each of three places per buffer


@dataclass
class StressResult:
    ops: int = 0
    frees_checked: int = 0
    ooms: int = 0
    driver_errors: int = 0
    fallbacks: int = 0
    sleeps: int = 0
    wakes_refused: int = 0
    seconds: float = 0.0
    threads: int = 0
    failures: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        state = "OK" if not self.failures else f"FAILED ({len(self.failures)})"
        return (f"{state}: {self.ops} ops ({self.frees_checked} frees pattern-checked) by "
                f"{self.threads} threads in {self.seconds:.1f} s "
                f"({self.ops / max(self.seconds, 1e-9):,.0f} ops/s); {self.ooms} OOMs, "
                f"{self.driver_errors} driver errors, {self.fallbacks} CPU fallbacks"
                + (f", {self.sleeps} sleep/wake cycles ({self.wakes_refused} wakes refused)"
                   if self.sleeps or self.wakes_refused else ""))


def _places(nbytes: int) -> list[int]:
    if nbytes < 3 * PATTERN:
        return [0]
    return [0, (nbytes // 2) & ~(PATTERN - 1), nbytes - PATTERN]


def _pattern(buf_id: int, n: int = PATTERN) -> bytes:
    word = (buf_id * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "little")
    return (word * (n // 8 + 1))[:n]


def _where(buf: Any) -> tuple[Any, int, int]:
    """(device, segment handle, offset) of a Buffer or FallbackBuffer, for ranged copies."""
    block = buf._host if isinstance(buf, FallbackBuffer) else buf
    handle, offset = block.segment_location()
    return block.manager.device, handle, offset


def _write(buf: Any) -> None:
    dev, handle, offset = _where(buf)
    n = min(PATTERN, buf.nbytes)
    pat = memoryview(_pattern(buf.id, n))
    for p in _places(buf.nbytes):
        dev.copy_from_host(handle, offset + p, pat, buf.stream)


def _check(buf: Any) -> str | None:
    dev, handle, offset = _where(buf)
    n = min(PATTERN, buf.nbytes)
    want = _pattern(buf.id, n)
    got = bytearray(n)
    for p in _places(buf.nbytes):
        dev.copy_to_host(handle, offset + p, memoryview(got), buf.stream)
        if bytes(got) != want:
            return f"buffer {buf.id} ({buf.nbytes} B): pattern at offset {p} overwritten"
    return None


def _size(rng: random.Random, max_size: int) -> int:
    return int(math.exp(rng.uniform(math.log(64), math.log(max_size))))


def run(*, ops: int = 20_000, seconds: float | None = None, workers: int = 6,
        capacity: str = "1GiB", max_size: int = 64 * MiB, live_per_worker: int = 12,
        fail_rate: float = 0.0, cpu_fallback: bool = False, seed: int = 0,
        expandable: bool | None = None, handle_size: int | str | None = None,
        sleep: bool = False, verbose: bool = False) -> StressResult:
    """One run; ``ops`` is the total across allocator threads (``seconds`` caps it).
    ``expandable``: expandable segments (holes, stitching; ``fail_rate`` then also fails page
    creation and mapping); None: as GPUMEM_TEST_EXPANDABLE_SEGMENTS says. ``handle_size``:
    MemoryConfig.expandable_handle_size (0: one page per physical handle, the tight policy;
    "growth": the fast one; None: the policy of invariants.TEST_SEGMENTS, auto by default).
    ``sleep``: a sleeper thread too (the module docstring)."""
    if expandable is None:
        from invariants import TEST_EXPANDABLE
        expandable = TEST_EXPANDABLE
    from invariants import TEST_SEGMENTS
    segments = (TEST_SEGMENTS if TEST_SEGMENTS != "plain" else "auto") if expandable else "plain"
    if handle_size is not None:
        segments = "auto"                   # the handle size names the policy
    dev = gpumem_sim.SimDevice(parse_size(capacity), back_memory=True, seed=seed)
    gpumem_sim.install(dev)
    config = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                          cpu_fallback_enabled=cpu_fallback, track_allocations=False,
                          segments=segments,
                          expandable_handle_size=handle_size if expandable else None)
    mm = MemoryManager("sim:0", config)
    streams = [0] + [dev.create_stream() for _ in range(3)]
    result = StressResult(threads=workers + 2)
    lock = threading.Lock()               # guards result and `budget`
    budget = [ops]
    stop = threading.Event()
    deadline = time.monotonic() + seconds if seconds else None
    if fail_rate:
        dev.inject(fail_rate=fail_rate, seed=seed)
        if expandable:                    # per page: a few times rarer than per segment
            dev.inject_vm(create_rate=fail_rate / 4, map_rate=fail_rate / 4)

    def fail(msg: str) -> None:
        with lock:
            result.failures.append(msg)
        stop.set()

    def take(n: int = 1) -> bool:
        with lock:
            if budget[0] <= 0 or stop.is_set():
                return False
            budget[0] -= n
            result.ops += n
        if deadline is not None and time.monotonic() > deadline:
            stop.set()
        return True

    def free_checked(buf: Any) -> None:
        err = _check(buf)
        if err:
            fail(err)
        buf.free()
        with lock:
            result.frees_checked += 1

    def allocator(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        live: list[Any] = []
        try:
            while take():
                if live and (len(live) >= live_per_worker or rng.random() < 0.45):
                    free_checked(live.pop(rng.randrange(len(live))))
                    continue
                stream = rng.choice(streams)
                roll = rng.random()
                try:
                    if roll < 0.04:
                        sizes = [_size(rng, max_size // 8) for _ in range(rng.randint(2, 5))]
                        got = mm.allocate_batch(sizes, stream=stream)
                    elif roll < 0.08:
                        got = [mm.malloc_async(_size(rng, max_size), stream=stream).result(30)]
                    else:
                        got = [mm.malloc(_size(rng, max_size), stream=stream)]
                except OutOfMemoryError:
                    with lock:
                        result.ooms += 1
                    if live:
                        free_checked(live.pop(0))
                    continue
                except DriverError:
                    with lock:
                        result.driver_errors += 1
                    continue
                for buf in got:
                    if isinstance(buf, FallbackBuffer):
                        with lock:
                            result.fallbacks += 1
                    _write(buf)
                    if rng.random() < 0.15 and not isinstance(buf, FallbackBuffer):
                        other = rng.choice(streams)
                        buf.record_stream(other)
                        dev.submit(other) if other else None
                    live.append(buf)
        except BaseException as exc:      # any other exception is a failure of the run
            fail(f"allocator {k}: {type(exc).__name__}: {exc}")
        finally:
            for buf in live:
                try:
                    free_checked(buf)
                except BaseException as exc:
                    fail(f"allocator {k} cleanup: {type(exc).__name__}: {exc}")

    def device_work() -> None:
        rng = random.Random(seed + 7)
        while not stop.wait(0.0005):
            try:
                dev.complete(rng.choice(streams[1:]))
            except Exception as exc:
                fail(f"device thread: {exc}")

    def maintenance() -> None:
        rng = random.Random(seed + 11)
        while not stop.wait(0.002):
            try:
                what = rng.randrange(6)
                if what == 0:
                    mm.snapshot()
                elif what == 1:
                    mm.stats()
                elif what == 2:
                    mm.empty_cache()
                elif what == 3:
                    mm.shrink(rng.randrange(4) * 64 * MiB)
                elif what == 4:
                    mm.collect_pending_frees()
                else:
                    mm.pool.check_invariants()
            except AssertionError as exc:
                fail(f"invariants during the run: {exc}")
            except DriverError:
                with lock:
                    result.driver_errors += 1
            except Exception as exc:
                fail(f"maintenance: {type(exc).__name__}: {exc}")

    sleeper_state: dict[str, Any] = {"mine": [], "asleep": False}

    def sleeper() -> None:
        rng = random.Random(seed + 13)
        mine = sleeper_state["mine"]
        try:
            while not stop.is_set():
                if not sleeper_state["asleep"]:
                    with mm.region("sleeper"):
                        while len(mine) < 6:
                            try:
                                buf = mm.malloc(_size(rng, max_size // 4))
                            except (OutOfMemoryError, DriverError):
                                break
                            _write(buf)
                            mine.append(buf)
                    try:
                        mm.sleep("sleeper", backup=True)
                    except DriverError:
                        with lock:
                            result.driver_errors += 1
                        continue
                    sleeper_state["asleep"] = True
                stop.wait(0.001)
                try:
                    mm.wake("sleeper")
                except (OutOfMemoryError, DriverError):
                    with lock:
                        result.wakes_refused += 1
                    continue
                sleeper_state["asleep"] = False
                with lock:
                    result.sleeps += 1
                for buf in mine:
                    err = _check(buf)
                    if err:
                        fail(f"after a wake: {err}")
                for _ in range(rng.randrange(len(mine) + 1)):
                    free_checked(mine.pop(rng.randrange(len(mine))))
        except BaseException as exc:      # any other exception is a failure of the run
            fail(f"sleeper: {type(exc).__name__}: {exc}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=allocator, args=(k,), name=f"alloc-{k}")
               for k in range(workers)]
    helpers = [threading.Thread(target=device_work, name="device"),
               threading.Thread(target=maintenance, name="maintenance")]
    if sleep:
        helpers.append(threading.Thread(target=sleeper, name="sleeper"))
        result.threads += 1
    for t in threads + helpers:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in helpers:
        t.join()
    result.seconds = time.monotonic() - t0
    dev.clear_faults()
    try:
        if sleeper_state["asleep"]:
            mm.wake("sleeper")                 # no fault now
        for buf in sleeper_state["mine"]:
            free_checked(buf)
        _final_checks(mm, dev, streams, result)
    finally:
        mm.close()
        gpumem_sim.uninstall()
    if verbose:
        print(result, file=sys.stderr)
    return result


def _final_checks(mm: MemoryManager, dev: gpumem_sim.SimDevice, streams: list[int],
                  result: StressResult) -> None:
    dev.complete()
    mm.collect_pending_frees(wait=True)
    mm.pool.check_invariants()
    st = mm.stats()
    if (st.in_use_bytes, st.active_buffers, st.pending_free_bytes) != (0, 0, 0):
        result.failures.append(f"after freeing everything: in use {st.in_use_bytes}, active "
                               f"{st.active_buffers}, pending {st.pending_free_bytes}")
    if st.num_allocs != st.num_frees:
        result.failures.append(f"{st.num_allocs} allocations but {st.num_frees} frees")
    if st.fallback_bytes:
        result.failures.append(f"{st.fallback_bytes} fallback bytes still counted")
    mm.empty_cache()
    if dev.live_bytes or dev.live_segments:
        result.failures.append(f"device still holds {dev.live_bytes} bytes in "
                               f"{dev.live_segments} segments after empty_cache()")
    if dev.live_events:
        result.failures.append(f"{dev.live_events} events leaked")
    vm = (dev.live_page_handles, dev.live_mappings, dev.live_reservations)
    if any(vm):
        result.failures.append(f"after empty_cache(): {vm[0]} page handles, {vm[1]} mappings, "
                               f"{vm[2]} reservations still live")
    for s in streams[1:]:
        dev.destroy_stream(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--capacity", default="1GiB")
    ap.add_argument("--fail-rate", type=float, default=0.0)
    ap.add_argument("--cpu-fallback", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expandable", action=argparse.BooleanOptionalAction, default=None,
                    help="expandable segments on / off (default: as "
                         "GPUMEM_TEST_EXPANDABLE_SEGMENTS says: on unless it is 0)")
    ap.add_argument("--sleep", action="store_true",
                    help="a sleeper thread too: a tag put to sleep and woken over and over")
    ap.add_argument("--handle-size", default=None,
                    help="MemoryConfig.expandable_handle_size, e.g. 6MiB (0: one page, the "
                         "tight policy; 'growth': the fast one; default: the auto policy)")
    args = ap.parse_args(argv)
    res = run(ops=args.ops, seconds=args.seconds, workers=args.workers, capacity=args.capacity,
              fail_rate=args.fail_rate, cpu_fallback=args.cpu_fallback, seed=args.seed,
              expandable=args.expandable, sleep=args.sleep,
              handle_size=None if args.handle_size is None
              else parse_handle_size(args.handle_size, what="--handle-size"))
    print(f"capacity={args.capacity} fail_rate={args.fail_rate} "
          f"cpu_fallback={args.cpu_fallback} seed={args.seed} "
          f"expandable={'default' if args.expandable is None else args.expandable} "
          f"handle_size={args.handle_size or ('-' if args.expandable is False else 'default (auto)')}: {res}")
    for f in res.failures[:20]:
        print("  " + f)
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
