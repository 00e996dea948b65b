"""``gpumem trace synth``: write a synthetic allocation trace (gpumem.observe.synth_traces)."""
from __future__ import annotations

import argparse

from gpumem.cli.common import EXIT_OK, EXIT_USAGE, CliError, fmt_bytes, say


def cmd_synth(args: argparse.Namespace) -> int:
    from gpumem.observe.synth_traces import KINDS, describe, synthesize
    from gpumem.observe.trace import write_trace
    if args.list:
        for kind in KINDS:
            d = describe(kind)
            defaults = ", ".join(f"{k}={v}" for k, v in d["defaults"].items())
            say(f"{kind:<9} {d['summary']}")
            say(f"{'':<9} ({defaults})")
        return EXIT_OK
    if args.kind is None or args.output is None:
        raise CliError("give KIND and -o FILE (or --list)", EXIT_USAGE)
    params = {k: v for k, v in (("steps", args.steps), ("scale", args.scale)) if v is not None}
    data = synthesize(args.kind, seed=args.seed, **params)
    try:
        n = write_trace(args.output, data)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    end = int(data.live_bytes()[-1]) if len(data) else 0
    say(f"wrote {args.output}: {n:,} events ({data.n_allocs:,} allocs), peak live "
        f"{fmt_bytes(data.peak_live_bytes)}, live at the end {fmt_bytes(end)}")
    say(f"next: gpumem replay {args.output} --device sim:80GiB")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'trace' command group ('trace synth')."""
    t = sub.add_parser("trace", help="make allocation traces (trace synth)")
    tsub = t.add_subparsers(dest="trace_command", metavar="SUBCOMMAND",
                            parser_class=type(t))

    def usage(args: argparse.Namespace) -> int:
        raise CliError("give a subcommand: gpumem trace synth KIND -o FILE", EXIT_USAGE)
    t.set_defaults(func=usage)
    s = tsub.add_parser("synth", help="a seeded synthetic trace: serving, varlen or training")
    s.add_argument("kind", nargs="?", metavar="KIND",
                   help="serving (LLM continuous batching), varlen (variable-length batches) "
                        "or training (see --list)")
    s.add_argument("--seed", type=int, default=0, help="random seed (0): same seed, same trace")
    s.add_argument("--steps", type=int, help="length: engine steps, batches or training steps")
    s.add_argument("--scale", type=float, help="multiplies every tensor size (1.0)")
    s.add_argument("-o", "--output", metavar="FILE", help="the trace to write (.csv or .csv.gz)")
    s.add_argument("--list", action="store_true", help="list the generators and their defaults")
    s.set_defaults(func=cmd_synth)
