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
    say_environment,
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
    cfg = replay_cfg(args)
    say_environment()
    res = replay(data, args.device, cfg, phase=args.phase,
                 progress=progress_for(len(data), args.progress),
                 record_series=bool(args.plot),
                 snapshot_at="peak" if args.plot_segments else None, stop_on_oom=False)
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
    if getattr(args, "plot_segments", None) and res.snapshot is not None:
        from gpumem.observe.plot import plot_segments
        say(f"wrote {plot_segments(res.snapshot, args.plot_segments)}")


def cmd_plot(args: argparse.Namespace) -> int:
    from gpumem.observe.plot import plot_segments, plot_timeline
    from gpumem.observe.replay import replay
    data = load_trace(args.trace)
    cfg = replay_cfg(args)
    say_environment()
    res = replay(data, args.device, cfg, phase=args.phase, record_series=True,
                 snapshot_at="peak" if args.plot_segments else None,
                 progress=progress_for(len(data), None))
    say(f"wrote {plot_timeline(res, args.out, x=args.x)}")
    if args.plot_segments and res.snapshot is not None:
        say(f"wrote {plot_segments(res.snapshot, args.plot_segments)}")
    say(f"peak live {fmt_bytes(res.peak_live_bytes)}, peak reserved {fmt_bytes(res.peak_reserved_bytes)} "
         f"(reserved/live {res.reserved_live_ratio:.3f}), hit rate {res.hit_rate:.1%}")
    if res.num_ooms:
        raise CliError(f"{res.num_ooms:,} allocation(s) did not fit on {args.device}", EXIT_OOM)
    return EXIT_OK


class _SegmentsFlag(argparse.Action):
    """``--segments POLICY`` (auto, tight, fast, plain, any case: MemoryConfig.segments).
    A value that is no policy but a file name (``.png``) is the option's old meaning, the
    segment map's file: kept for a while with a deprecation note (--plot-segments)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        from gpumem.config import SEGMENT_POLICIES
        text = str(values).strip()
        if text.lower() in SEGMENT_POLICIES:
            namespace.segments = text.lower()
        elif text.lower().endswith(".png"):
            import sys
            print(f"gpumem: --segments {text} is deprecated for the segment map: use "
                  f"--plot-segments {text} (--segments names the segment policy)",
                  file=sys.stderr)
            namespace.plot_segments = text
        else:
            parser.error(f"--segments: expected a segment policy ({', '.join(SEGMENT_POLICIES)}),"
                         f" got {text!r}")


def replay_flags(s: argparse.ArgumentParser) -> None:
    """The device and configuration flags of the commands that replay a trace (the same
    names and values as the MemoryConfig fields and GPUMEM_* variables they set)."""
    from gpumem.config import SEGMENT_POLICIES
    from gpumem.observe.replay import CONFIG_PRESETS
    s.add_argument("--device", default="sim:80GiB",
                   help="sim:<size> for a fresh simulated device (sizes: 80GiB = 80 x 2**30, "
                        "80GB = 80 x 10**9), or cuda:0, opencl:0, sim:0, cpu (default "
                        "sim:80GiB)")
    s.add_argument("--config", default="default", choices=CONFIG_PRESETS,
                   help="MemoryConfig preset, with the GPUMEM_* variables over it as every "
                        "manager reads them; the replay turns CPU fallback off (it counts the "
                        "requests the device refuses) and keeps the preset's free margin")
    s.add_argument("--phase", help="replay one phase of the trace (from its .json sidecar)")
    s.add_argument("--segments", metavar="POLICY", action=_SegmentsFlag, default=None,
                   help=f"the segment policy (MemoryConfig.segments, GPUMEM_SEGMENTS): "
                        f"{', '.join(SEGMENT_POLICIES)} (default: the preset's, auto)")
    s.add_argument("--expandable-segments", action=argparse.BooleanOptionalAction, default=None,
                   help="older spelling of --segments: --expandable-segments is auto, "
                        "--no-expandable-segments plain")
    s.add_argument("--expandable-handle-size", metavar="SIZE",
                   help="older spelling of --segments tight with physical handles of SIZE, "
                        "e.g. 20MiB (0: one page), or 'growth': --segments fast (default: as "
                        "the policy says; auto makes handles of at least 20 MiB while there is "
                        "room, one page near its limits)")
    s.add_argument("--plot-segments", metavar="PNG", default=None,
                   help="write the segment map at peak live")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'replay', 'plot' commands."""
    s = sub.add_parser("replay", help="replay an allocation trace through the pool")
    s.add_argument("trace", help="a t_ns,op,id,size CSV (.gz), or 'demo' for the packaged one")
    replay_flags(s)
    s.add_argument("--plot", metavar="PNG", help="write a live/reserved timeline")
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
    s.set_defaults(func=cmd_plot)
