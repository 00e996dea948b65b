"""``gpumem cluster``: gpumem's memory on every worker of a Dask cluster."""
from __future__ import annotations

import argparse
import json

from gpumem.cli.common import EXIT_OK, EXIT_USAGE, CliError, say


def cmd_cluster(args: argparse.Namespace) -> int:
    try:
        from distributed import Client

        from gpumem.dask import format_report, memory_report
    except ImportError as exc:
        raise CliError(f"gpumem cluster needs the 'distributed' package ({exc}); install it "
                       f"with pip install 'gpumem-pool[dask]'") from None
    if args.timeout <= 0:
        raise CliError(f"--timeout must be > 0 seconds, got {args.timeout}", EXIT_USAGE)
    try:
        client = Client(args.address, timeout=args.timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise CliError(f"cannot reach the Dask scheduler at {args.address!r}: {exc}") from None
    try:
        rows = memory_report(client, show=False, timeout=args.timeout)
    finally:
        client.close()
    if args.json:
        say(json.dumps(rows, indent=1, default=str))
    else:
        say(format_report(rows))
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'cluster' command."""
    s = sub.add_parser("cluster", help="gpumem's memory on every worker of a Dask cluster "
                       "(each worker's GpumemPlugin counters, asked of the workers)")
    s.add_argument("address", help="the scheduler's address, e.g. tcp://10.0.0.5:8786")
    s.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the scheduler, and for each worker's answer (10)")
    s.add_argument("--json", action="store_true", help="print JSON rows")
    s.set_defaults(func=cmd_cluster)
