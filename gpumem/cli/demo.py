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


def _demo_step(mm: Any, label: str, fn: Any) -> Any:
    # the label goes out before the step runs: an error the step raises is printed after it
    sys.stdout.write(f"  {label:<{_DEMO_LABEL}} ")
    sys.stdout.flush()
    before = mm.stats()
    try:
        out = fn()
    except Exception as exc:
        say(f"{type(exc).__name__}")
        raise
    after = mm.stats()
    hits = after.pool_hits - before.pool_hits
    misses = after.pool_misses - before.pool_misses
    new_segs = after.segments_created - before.segments_created
    released = after.segments_released - before.segments_released
    what = []
    if hits:
        what.append(f"{hits} hit{'s' if hits > 1 else ''}")
    if misses:
        what.append(f"{misses} miss{'es' if misses > 1 else ''}")
    if new_segs:
        what.append(f"+{new_segs} segment{'s' if new_segs > 1 else ''}")
    if released:
        what.append(f"-{released} segment{'s' if released > 1 else ''}")
    say(f"{', '.join(what) or 'no pool traffic':<30} "
         f"in use {fmt_bytes(after.in_use_bytes):>10}, reserved {fmt_bytes(after.reserved_bytes):>10}")
    return out


def _demo_manual(dev: Any) -> None:
    import gpumem_sim
    from gpumem.config import MemoryConfig
    from gpumem.errors import OutOfMemoryError
    from gpumem.manager.memory_manager import MemoryManager
    from gpumem.observe.snapshot import format_snapshot
    MiB, GiB = 1 << 20, 1 << 30
    with gpumem_sim.using(dev):
        cfg = MemoryConfig(track_allocations=True, min_free_bytes=0, cpu_fallback_enabled=True)
        with MemoryManager("sim:0", cfg) as mm:
            step = lambda label, fn: _demo_step(mm, label, fn)  # noqa: E731
            a = step("malloc 3 MiB (first request)", lambda: mm.malloc(3 * MiB, tag="act"))
            b = step("malloc 3 MiB again (same segment)", lambda: mm.malloc(3 * MiB, tag="act"))
            small = step("malloc 100 x 4 KiB (small pool)",
                         lambda: [mm.malloc(4096, tag="small") for _ in range(100)])
            step("free the first 3 MiB buffer", a.free)
            a = step("malloc 3 MiB (reuses the freed block)",
                     lambda: mm.malloc(3 * MiB, tag="act"))
            w = step("malloc 160 MiB of weights (own segment)",
                     lambda: mm.malloc(160 * MiB, tag="weights"))
            step("free the small buffers", lambda: [s.free() for s in small])
            try:
                step("malloc 1 GiB (more than the device)", lambda: mm.malloc(1 * GiB))
            except OutOfMemoryError as exc:
                say(f"    -> {exc}")
            fb = step("malloc 64 MiB (device nearly full: CPU fallback)",
                      lambda: mm.malloc(64 * MiB, tag="spill"))
            say(f"    -> {fb!r}")
            fb.free()
            say("")
            say("  " + str(mm.stats()).replace("; ", ";\n  "))
            leaks = mm.check_leaks()
            say(f"  still live (tracked): {len(leaks)} buffer(s): "
                 + ", ".join(f"{m.tag} {fmt_bytes(m.nbytes)}" for m in leaks))
            say("")
            say("  " + format_snapshot(mm.snapshot(), max_segments=6,
                                         max_blocks=4).replace("\n", "\n  "))
            for buf in (a, b, w):
                buf.free()
            released = mm.empty_cache()
            say(f"  freed everything; empty_cache() returned {fmt_bytes(released)} to the device")


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
        say(f"  at the peak: {sm['num_segments']} segments, {sm['allocated_blocks']:,} live blocks, "
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
