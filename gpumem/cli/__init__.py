"""The ``gpumem`` command (also ``python -m gpumem``).

Commands::

    gpumem info                          devices of every backend, memory and pressure
    gpumem groups                        shared memory budgets: members, reserved, cached
    gpumem estimate --model mistral-7b   memory to run a transformer (preset or shape flags)
    gpumem replay TRACE                  replay an allocation trace through the real pool
    gpumem tune TRACE --device sim:24GiB which gpumem/PyTorch settings fit it, on which card
    gpumem snapshot [--load FILE]        segments and blocks of a demo workload or a saved file
    gpumem plot TRACE OUT.png            live vs reserved memory over a trace
    gpumem demo                          what the allocator does, on a simulated device
    gpumem import-torch SNAP -o TRACE    a PyTorch memory snapshot's history as a trace
    gpumem cluster SCHEDULER_ADDRESS     gpumem's memory on every worker of a Dask cluster
    gpumem trace synth KIND -o TRACE     a seeded synthetic trace (serving, varlen, training)

With ``--json -`` a command writes only JSON to stdout (newline-terminated) and its report to
stderr, so ``gpumem replay T --json - | jq .`` works.

Errors are one line on stderr (``gpumem: error: ...``) and a non-zero exit status: 1 for a bad
input or a failure, 2 for a usage error, a trace or PyTorch snapshot that cannot be read, or a
replay that ran out of memory.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from gpumem.cli import (cluster, common, demo, groups, info, inspect, replay, torch_import,
                        trace, tune)
from gpumem.cli.common import (
    DEMO_TRACE,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Parser,
)

__all__ = ["main", "build_parser", "DEMO_TRACE", "GROUPS"]

#: the command groups, in the order ``gpumem --help`` lists them: each module's
#: ``register(subparsers)`` adds its commands
GROUPS = (info, groups, replay, tune, inspect, torch_import, trace, demo, cluster)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="gpumem", description="gpumem: a caching GPU memory allocator. See what "
                "it does with your allocations.")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="show the allocator's DEBUG log (segments grown and released)")
    from gpumem import __version__
    p.add_argument("--version", action="version", version=f"gpumem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    from gpumem.errors import GpuMemoryError
    from gpumem.logging_setup import configure_logging, remove_handler
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except CliError as exc:
        print(f"gpumem: error: {exc}", file=sys.stderr)
        return exc.status
    except SystemExit as exc:       # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    common.report_to_stderr = getattr(args, "json", None) == "-"
    handler = configure_logging(args.verbose)
    try:
        return args.func(args)
    except CliError as exc:
        print(f"gpumem: error: {exc}", file=sys.stderr)
        return exc.status
    except BrokenPipeError:
        return EXIT_ERROR
    except (GpuMemoryError, OSError) as exc:
        msg = str(exc) if not isinstance(exc, OSError) or not exc.filename else \
            f"{exc.filename}: {exc.strerror or exc}"
        print(f"gpumem: error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("gpumem: error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:    # a bug: still one line, with -v the traceback
        if args.verbose:
            raise
        print(f"gpumem: error: unexpected {type(exc).__name__}: {exc} (run with -v for the "
              f"traceback)", file=sys.stderr)
        return EXIT_ERROR
    finally:
        common.report_to_stderr = False
        remove_handler(handler)
