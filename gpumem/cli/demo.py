"""``gpumem demo``: what the allocator does, on a simulated device (no GPU needed)."""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from gpumem.cli.common import (
    DEMO_TRACE,
    EXIT_OK,
    EXIT_OOM,
    CliError,
    fmt_bytes,
    load_trace,
    progress_for,
    replay_cfg,
    say,
)

__all__ = ["cmd_demo"]


# --- demo ---------------------------------------------------------------------------------------------
#: width of the demo's step labels (the longest label fits)
_DEMO_LABEL = 50


#: a step's claim: MemoryStats fields and how much the step changes each
Claim = dict[str, int]


def _demo_step(mm: Any, label: str, fn: Any, claim: Claim, record: list) -> Any:
    """Run one narrated step; print what the pool did; append ``(label, claim, observed)`` to
    `record`, `observed` being the change of each field `claim` names (tests/cli/test_demo.py
    checks that the two agree, so the narration cannot drift from what happens)."""
    # the label goes out before the step runs: an error the step raises is printed after it
    sys.stdout.write(f"  {label:<{_DEMO_LABEL}} ")
    sys.stdout.flush()
    before = mm.stats()
    try:
        out = fn()
    except Exception as exc:
        say(f"{type(exc).__name__}")
        record.append((label, claim, _deltas(before, mm.stats(), claim)))
        raise
    after = mm.stats()
    record.append((label, claim, _deltas(before, after, claim)))
    hits = after.pool_hits - before.pool_hits
    misses = after.pool_misses - before.pool_misses
    new_segs = after.segments_created - before.segments_created
    released = after.segments_released - before.segments_released
    fallbacks = after.cpu_fallbacks - before.cpu_fallbacks
    what = []
    if hits:
        what.append(f"{hits} hit{'s' if hits > 1 else ''}")
    if misses:
        what.append(f"{misses} miss{'es' if misses > 1 else ''}")
    if new_segs:
        what.append(f"+{new_segs} segment{'s' if new_segs > 1 else ''}")
    if released:
        what.append(f"-{released} segment{'s' if released > 1 else ''}")
    if fallbacks:
        what.append(f"{fallbacks} CPU fallback{'s' if fallbacks > 1 else ''}")
    say(f"{', '.join(what) or 'no pool traffic':<30} "
         f"in use {fmt_bytes(after.in_use_bytes):>10}, reserved {fmt_bytes(after.reserved_bytes):>10}")
    return out


def _deltas(before: Any, after: Any, claim: Claim) -> Claim:
    return {name: getattr(after, name) - getattr(before, name) for name in claim}


def _demo_manual(dev: Any, *, expandable: bool = True) -> list:
    """The hand-made allocations of the demo on `dev` (256 MiB), with expandable segments
    (the default) or plain ones; returns each step's ``(label, claim, observed)``."""
    import gpumem_sim
    from gpumem.config import MemoryConfig
    from gpumem.errors import OutOfMemoryError
    from gpumem.manager.memory_manager import MemoryManager
    from gpumem.observe.snapshot import format_snapshot
    MiB, GiB = 1 << 20, 1 << 30
    record: list = []
    with gpumem_sim.using(dev):
        # gpu_memory_fraction written here is a hard limit (the default's is soft): the demo's
        # last step goes over it to show the CPU fallback
        cfg = MemoryConfig(track_allocations=True, min_free_bytes=0, cpu_fallback_enabled=True,
                           gpu_memory_fraction=0.9, expandable_segments=expandable)
        with MemoryManager("sim:0", cfg) as mm:
            grows = mm.expandable_segments is not None
            kind = ("expandable segments: a large segment grows in place by mapping pages"
                    if grows else "plain segments: each holds a fixed size from the driver")
            say(f"  ({kind}; usable {fmt_bytes(mm.usable_memory)} of "
                f"{fmt_bytes(mm.total_memory)})")

            def step(label: str, fn: Any, **claim: int) -> Any:
                return _demo_step(mm, label, fn, claim, record)
            a = step("malloc 3 MiB (first request: a new segment)",
                     lambda: mm.malloc(3 * MiB, tag="act"), pool_misses=1, segments_created=1)
            if grows:
                b = step("malloc 3 MiB again (the segment grows in place)",
                         lambda: mm.malloc(3 * MiB, tag="act"), pool_misses=1, segments_created=0)
            else:
                b = step("malloc 3 MiB again (the same segment's free rest)",
                         lambda: mm.malloc(3 * MiB, tag="act"), pool_hits=1, pool_misses=0)
            small = step("malloc 100 x 4 KiB (small pool: one new segment)",
                         lambda: [mm.malloc(4096, tag="small") for _ in range(100)],
                         pool_hits=99, pool_misses=1, segments_created=1)
            step("free the first 3 MiB buffer (cached, not returned)", a.free,
                 reserved_bytes=0, segments_released=0)
            a = step("malloc 3 MiB (reuses the freed block)",
                     lambda: mm.malloc(3 * MiB, tag="act"), pool_hits=1, pool_misses=0)
            if grows:
                w = step("malloc 160 MiB of weights (the segment grows)",
                         lambda: mm.malloc(160 * MiB, tag="weights"),
                         pool_misses=1, segments_created=0)
            else:
                w = step("malloc 160 MiB of weights (a segment of its own)",
                         lambda: mm.malloc(160 * MiB, tag="weights"),
                         pool_misses=1, segments_created=1)
            step("free the small buffers", lambda: [s.free() for s in small],
                 reserved_bytes=0)
            try:
                step("malloc 1 GiB (more than the device)", lambda: mm.malloc(1 * GiB),
                     num_ooms=1, cpu_fallbacks=0)
            except OutOfMemoryError as exc:
                say(f"    -> {exc}")
            fb = step("malloc 80 MiB (over the limit: CPU fallback)",
                      lambda: mm.malloc(80 * MiB, tag="spill"), cpu_fallbacks=1, in_use_bytes=0)
            say(f"    -> {fb!r}")
            say("")
            say("  " + str(mm.stats()).replace("; ", ";\n  "))
            fb.free()
            leaks = mm.check_leaks()
            say(f"  the fallback buffer freed, still live (tracked): {len(leaks)} device buffer(s): "
                 + ", ".join(f"{m.tag} {fmt_bytes(m.nbytes)}" for m in leaks))
            say("")
            say("  " + format_snapshot(mm.snapshot(), max_segments=6,
                                         max_blocks=4).replace("\n", "\n  "))
            for buf in (a, b, w):
                buf.free()
            released = mm.empty_cache()
            say(f"  freed everything; empty_cache() returned {fmt_bytes(released)} to the device")
    return record


class _DropWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.WARNING


def cmd_demo(args: argparse.Namespace) -> int:
    import gpumem_sim
    from gpumem.errors import CpuFallbackWarning

    say("gpumem demo: a caching allocator on a simulated GPU (gpumem_sim, no GPU needed)")
    say("")
    say("1. Hand-made allocations on a simulated 256 MiB device")
    dev = gpumem_sim.SimDevice("256MiB", name="demo sim 256 MiB")
    # the OOM, the fallback and the fragmentation below are on purpose and the demo prints
    # them itself: their log warnings and the CpuFallbackWarning are kept for -v
    quiet = None if args.verbose else _DropWarnings()
    logger = logging.getLogger("gpumem")
    if quiet is not None:
        logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            if not args.verbose:
                warnings.simplefilter("ignore", CpuFallbackWarning)
            _demo_manual(dev)
            _demo_replay(args)
    finally:
        if quiet is not None:
            logger.removeFilter(quiet)
    return EXIT_OK


def _demo_replay(args: argparse.Namespace) -> None:
    from gpumem.observe.replay import replay

    say("")
    trace = args.trace or str(DEMO_TRACE)
    data = load_trace(trace)
    say(f"2. Replay of a real PyTorch allocation trace: {data.name} "
         f"({len(data):,} events, peak live {fmt_bytes(data.peak_live_bytes)})")
    res = replay(data, args.device, replay_cfg(args), record_series=bool(args.plot),
                 snapshot_at="peak", progress=progress_for(len(data), None))
    say("  " + str(res).replace("\n", "\n  "))
    waste = res.peak_reserved_bytes - res.peak_live_bytes
    say(f"  peak reserved exceeds peak live by {fmt_bytes(waste)} "
         f"({res.reserved_live_ratio - 1:.1%}); {res.hit_rate:.1%} of the requests were "
         f"served from the cache without a driver call")
    if res.snapshot is not None:
        from gpumem.observe.snapshot import summarize
        sm = summarize(res.snapshot)
        say(f"  at peak live: {sm['num_segments']} segments, {sm['allocated_blocks']:,} live blocks, "
             f"{sm['free_blocks']} free blocks of {fmt_bytes(sm['cached_bytes'])} (largest "
             f"{fmt_bytes(sm['largest_free_block'])})")
    if args.plot:
        from gpumem.observe.plot import plot_segments, plot_timeline
        p = Path(args.plot)
        seg_path = p.with_name(p.stem + "_segments" + (p.suffix or ".png"))
        say(f"  wrote {plot_timeline(res, p)}")
        if res.snapshot is not None:
            say(f"  wrote {plot_segments(res.snapshot, seg_path)}")
    if res.num_ooms:
        raise CliError(f"{res.num_ooms:,} allocation(s) of the trace did not fit on "
                       f"{args.device}", EXIT_OOM)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'demo' command."""
    from gpumem.observe.replay import CONFIG_PRESETS
    s = sub.add_parser("demo", help="show what the allocator does, on a simulated device")
    s.add_argument("--trace", help=f"trace to replay (default: the packaged {DEMO_TRACE.name})")
    s.add_argument("--device", default="sim:80GiB", help="replay device (sim:80GiB)")
    s.add_argument("--config", default="default", choices=CONFIG_PRESETS)
    s.add_argument("--plot", metavar="PNG",
                   help="write the timeline there and the segment map next to it")
    s.set_defaults(func=cmd_demo)
