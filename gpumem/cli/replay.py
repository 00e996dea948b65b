"""``gpumem replay`` and ``gpumem plot``: a trace through the real pool, and its timeline."""
from __future__ import annotations

import argparse
from typing import Any

from gpumem.cli.common import (
    EXIT_OK,
    EXIT_OOM,
    CliError,
    fmt_bytes,
    load_trace,
    progress_for,
    replay_cfg,
    say,
    write_json,
)


def cmd_replay(args: argparse.Namespace) -> int:
    from gpumem.observe.replay import replay
    data = load_trace(args.trace)
    if args.list_phases:
        if not data.phases:
            say(f"{data.name}: no phases (no .json sidecar next to the trace)")
        for p in data.phases:
            say(f"{p.name:<14} rows {p.first_row:>7}..{p.end_row:<7} ({len(p):,} events)")
        return EXIT_OK
    res = replay(data, args.device, replay_cfg(args), phase=args.phase,
                 progress=progress_for(len(data), args.progress),
                 record_series=bool(args.plot), snapshot_at="peak" if args.segments else None,
                 stop_on_oom=False)
    say(str(res))
    _write_outputs(res, args)
    if res.num_ooms:
        raise CliError(f"{res.num_ooms:,} allocation(s) of the trace did not fit on "
                       f"{args.device} ({fmt_bytes(res.failed_bytes)} refused); use a larger "
                       f"device or another --config", EXIT_OOM)
    return EXIT_OK


def _write_outputs(res: Any, args: argparse.Namespace) -> None:
    if getattr(args, "json", None):
        write_json(res.as_dict(), args.json)
    if getattr(args, "plot", None):
        from gpumem.observe.plot import plot_timeline
        say(f"wrote {plot_timeline(res, args.plot)}")
    if getattr(args, "segments", None) and res.snapshot is not None:
        from gpumem.observe.plot import plot_segments
        say(f"wrote {plot_segments(res.snapshot, args.segments)}")


def cmd_plot(args: argparse.Namespace) -> int:
    from gpumem.observe.plot import plot_segments, plot_timeline
    from gpumem.observe.replay import replay
    data = load_trace(args.trace)
    res = replay(data, args.device, replay_cfg(args), phase=args.phase, record_series=True,
                 snapshot_at="peak" if args.segments else None,
                 progress=progress_for(len(data), None))
    say(f"wrote {plot_timeline(res, args.out, x=args.x)}")
    if args.segments and res.snapshot is not None:
        say(f"wrote {plot_segments(res.snapshot, args.segments)}")
    say(f"peak live {fmt_bytes(res.peak_live_bytes)}, peak reserved {fmt_bytes(res.peak_reserved_bytes)} "
         f"(reserved/live {res.reserved_live_ratio:.3f}), hit rate {res.hit_rate:.1%}")
    if res.num_ooms:
        raise CliError(f"{res.num_ooms:,} allocation(s) did not fit on {args.device}", EXIT_OOM)
    return EXIT_OK


def replay_flags(s: argparse.ArgumentParser) -> None:
    """The device and configuration flags of the commands that replay a trace."""
    from gpumem.observe.replay import CONFIG_PRESETS
    s.add_argument("--device", default="sim:80GiB",
                   help="sim:<size> for a fresh simulated device, or cuda:0, opencl:0, "
                        "sim:0, cpu (default sim:80GiB)")
    s.add_argument("--config", default="default", choices=CONFIG_PRESETS,
                   help="MemoryConfig preset (CPU fallback off, no free margin)")
    s.add_argument("--phase", help="replay one phase of the trace (from its .json sidecar)")
    s.add_argument("--expandable-segments", action=argparse.BooleanOptionalAction, default=None,
                   help="grow large-pool segments in place (on by default on devices with "
                        "virtual memory; --no-expandable-segments: plain segments)")
    s.add_argument("--expandable-handle-size", metavar="SIZE",
                   help="largest physical handle of an expandable segment, e.g. 20MiB (default: "
                        "one page; larger: fewer driver calls, less tight), or 'growth': one "
                        "handle per growth (about plain segments' driver calls)")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'replay', 'plot' commands."""
    s = sub.add_parser("replay", help="replay an allocation trace through the pool")
    s.add_argument("trace", help="a t_ns,op,id,size CSV (.gz), or 'demo' for the packaged one")
    replay_flags(s)
    s.add_argument("--plot", metavar="PNG", help="write a live/reserved timeline")
    s.add_argument("--segments", metavar="PNG", help="write the segment map at peak live")
    s.add_argument("--json", metavar="FILE", help="write the figures as JSON ('-': stdout)")
    s.add_argument("--list-phases", action="store_true", help="list the trace's phases")
    pg = s.add_mutually_exclusive_group()
    pg.add_argument("--progress", dest="progress", action="store_true", default=None,
                    help="show a progress bar (default: for long traces on a terminal)")
    pg.add_argument("--no-progress", dest="progress", action="store_false")
    s.set_defaults(func=cmd_replay)
    s = sub.add_parser("plot", help="plot live vs reserved memory over a trace")
    s.add_argument("trace", help="a trace file, or 'demo'")
    s.add_argument("out", help="the PNG to write")
    replay_flags(s)
    s.add_argument("--x", choices=("event", "time"), default="event", help="x axis")
    s.add_argument("--segments", metavar="PNG", help="also draw the segments at peak live")
    s.set_defaults(func=cmd_plot)
