"""``gpumem tune``: which gpumem or PyTorch allocator settings fit a recorded workload on a card."""
from __future__ import annotations

import argparse

from gpumem.cli.common import EXIT_OK, EXIT_USAGE, CliError, DEMO_TRACE, say, write_json


def cmd_tune(args: argparse.Namespace) -> int:
    from gpumem.errors import InvalidInputError
    from gpumem.planning.tune import (GRID_MAX_SPLITS, PRESETS, device_capacity, gpumem_grid,
                                      tune)
    if args.plot:                               # fail before the replays, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from gpumem.observe.plot import INSTALL_HINT
            raise CliError(f"--plot needs matplotlib: {INSTALL_HINT}", EXIT_USAGE) from None
    try:
        device_capacity(args.device)            # a device without a size fails before reading
        presets = PRESETS if args.presets is None else \
            tuple(p.strip() for p in args.presets.split(",") if p.strip())
        gpumem_cands = [] if args.allocator == "torch" else gpumem_grid(presets,
                                                                        GRID_MAX_SPLITS)
        torch_confs = [] if args.allocator == "gpumem" else args.torch_conf
        result = tune(DEMO_TRACE if args.trace == "demo" else args.trace, args.device,
                      gpumem_configs=gpumem_cands, torch_confs=torch_confs, jobs=args.jobs,
                      find_min_capacity=not args.no_min_capacity,
                      record_series=bool(args.plot), progress=_progress_flag(args.progress))
    except InvalidInputError as exc:            # a bad trace, device, grid or setting
        raise CliError(str(exc), EXIT_USAGE) from None
    say(result.table())
    if args.json:
        write_json(result.as_dict(), args.json)
    if args.plot:
        from gpumem.observe.plot import plot_reserved_comparison
        title = f"Reserved memory of the best settings: {result.trace}"
        say(f"wrote {plot_reserved_comparison(result.series, args.plot, title=title, capacity=result.capacity)}")
    return EXIT_OK


def _progress_flag(flag: bool | None) -> bool:
    import sys
    return sys.stderr.isatty() if flag is None else flag


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'tune' command."""
    s = sub.add_parser(
        "tune", help="which allocator settings fit a recorded workload on a card",
        description="Replay a trace under a grid of gpumem configurations and PyTorch "
                    "allocator settings (a model of PyTorch's caching allocator) and show, for "
                    "each, the peak reserved memory, whether it fits the device and the "
                    "smallest card it fits on.")
    s.add_argument("trace", help="a gpumem trace (t_ns,op,id,size CSV, .gz), a PyTorch memory "
                                 "snapshot pickle (torch.cuda.memory._dump_snapshot), or 'demo'")
    s.add_argument("--device", default="sim:24GiB",
                   help="the card to plan for, as sim:<size> (default sim:24GiB)")
    s.add_argument("--json", metavar="FILE", help="write every row as JSON ('-': stdout)")
    s.add_argument("--plot", metavar="PNG",
                   help="plot reserved memory over the trace for the best gpumem and best "
                        "PyTorch rows")
    s.add_argument("--allocator", choices=("both", "gpumem", "torch"), default="both",
                   help="which allocator's settings to try (default both)")
    s.add_argument("--presets", metavar="LIST",
                   help="comma-separated gpumem presets to try (default: "
                        "default,inference,constrained)")
    s.add_argument("--torch-conf", metavar="CONF", action="append",
                   help="a PYTORCH_CUDA_ALLOC_CONF value to try; repeat for several "
                        "(replaces the built-in torch settings; '' is torch's default)")
    s.add_argument("--jobs", type=int, default=None,
                   help="processes to use (default: one per CPU)")
    s.add_argument("--no-min-capacity", action="store_true",
                   help="skip the search for the smallest card of each row (faster)")
    pg = s.add_mutually_exclusive_group()
    pg.add_argument("--progress", dest="progress", action="store_true", default=None,
                    help="show a progress bar (tqdm; default: on a terminal)")
    pg.add_argument("--no-progress", dest="progress", action="store_false")
    s.set_defaults(func=cmd_tune)
