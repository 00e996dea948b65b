"""``gpumem tune``: which gpumem or PyTorch allocator settings fit a recorded workload on a card."""
from __future__ import annotations

import argparse

from gpumem.cli.common import EXIT_OK, EXIT_USAGE, CliError, DEMO_TRACE, say, write_json


def cmd_tune(args: argparse.Namespace) -> int:
    from gpumem.config import env_settings
    from gpumem.errors import InvalidInputError
    from gpumem.planning.card import Card, card_size
    from gpumem.planning.tune import PRESETS, SEGMENT_POLICIES, gpumem_grid, tune
    if args.plot:                               # fail before the replays, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from gpumem.observe.plot import INSTALL_HINT
            raise CliError(f"--plot needs matplotlib: {INSTALL_HINT}", EXIT_USAGE) from None
    try:
        Card(card_size(args.device), args.card_kind)   # a card without a size fails first
        presets = PRESETS if args.presets is None else _names(args.presets)
        policies = tuple(SEGMENT_POLICIES) if args.segments is None else _names(args.segments)
        gpumem_cands = [] if args.allocator == "torch" else gpumem_grid(presets, policies)
        torch_confs = [] if args.allocator == "gpumem" else args.torch_conf
        result = tune(DEMO_TRACE if args.trace == "demo" else args.trace, args.device,
                      card_kind=args.card_kind, gpumem_configs=gpumem_cands,
                      torch_confs=torch_confs, jobs=args.jobs,
                      find_min_capacity=not args.no_min_capacity,
                      record_series=bool(args.plot), progress=_progress_flag(args.progress))
    except InvalidInputError as exc:            # a bad trace, card, grid or setting
        raise CliError(str(exc), EXIT_USAGE) from None
    ignored = env_settings()
    if ignored and args.allocator != "torch":
        say(f"tune ignores {', '.join(ignored.values())}: each gpumem row replays the settings "
            f"its line names (what you would paste), not the environment's")
    say(result.table())
    if args.json:
        write_json(result.as_dict(), args.json)
    if args.plot:
        from gpumem.observe.plot import plot_reserved_comparison
        title = f"Reserved memory of the best settings: {result.trace}"
        say(f"wrote {plot_reserved_comparison(result.series, args.plot, title=title, capacity=result.card.gpumem_bytes)}")
    return EXIT_OK


def _names(text: str) -> tuple[str, ...]:
    """A comma list; names in any case, as MemoryConfig.segments and GPUMEM_SEGMENTS take them."""
    return tuple(p.strip().lower() for p in text.split(",") if p.strip())


def _progress_flag(flag: bool | None) -> bool:
    import sys
    return sys.stderr.isatty() if flag is None else flag


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'tune' command."""
    from gpumem.planning.card import CARD_KINDS
    from gpumem.planning.tune import PRESETS, SEGMENT_POLICIES, TORCH_CONFS, gpumem_grid
    n_gpumem, n_torch = len(gpumem_grid()), len(TORCH_CONFS)   # the grid itself: cannot drift
    s = sub.add_parser(
        "tune", help="which allocator settings fit a recorded workload on a card",
        description=f"Replay a trace under a small grid of gpumem configurations and PyTorch "
                    f"allocator settings (a model of PyTorch's caching allocator) on what such "
                    f"a card leaves to each allocator, and recommend one: fits with margin, "
                    f"then least modeled driver time, then least peak reserved. By default "
                    f"{n_gpumem + n_torch} candidates: {n_gpumem} gpumem rows ({len(PRESETS)} "
                    f"presets x {len(SEGMENT_POLICIES)} segment policies) and {n_torch} PyTorch "
                    f"settings. Each row shows its peak reserved memory, whether it fits, its "
                    f"driver calls and the smallest card it fits on. The gpumem rows ignore "
                    f"GPUMEM_* variables: each replays the line it prints.")
    s.add_argument("trace", help="a gpumem trace (t_ns,op,id,size CSV, .gz), a PyTorch memory "
                                 "snapshot pickle (torch.cuda.memory._dump_snapshot), or 'demo'")
    s.add_argument("--card", "--device", dest="device", default="24GiB", metavar="SIZE",
                   help="the card to plan for: its size, e.g. 4GiB (sim:4GiB also works; "
                        "default 24GiB)")
    s.add_argument("--card-kind", choices=CARD_KINDS, default="cuda",
                   help="whose usable-memory rule applies: cuda (default: gpumem keeps CUDA's "
                        "reserve for the driver and context back) or sim (the whole card)")
    s.add_argument("--json", metavar="FILE", help="write every row as JSON ('-': stdout)")
    s.add_argument("--plot", metavar="PNG",
                   help="plot reserved memory over the trace for the best gpumem and best "
                        "PyTorch rows")
    s.add_argument("--allocator", choices=("both", "gpumem", "torch"), default="both",
                   help="which allocator's settings to try (default both)")
    s.add_argument("--presets", metavar="LIST",
                   help=f"comma-separated gpumem presets to try (default: {','.join(PRESETS)})")
    s.add_argument("--segments", metavar="LIST",
                   help=f"comma-separated segment policies (MemoryConfig.segments) to try with "
                        f"each preset (default: {','.join(SEGMENT_POLICIES)})")
    s.add_argument("--torch-conf", metavar="CONF", action="append",
                   help="a PYTORCH_CUDA_ALLOC_CONF value to try; repeat for several "
                        "(replaces the built-in torch settings; '' is torch's default)")
    s.add_argument("--jobs", type=int, default=None,
                   help="processes to use (default: one per CPU, at most one per candidate)")
    s.add_argument("--no-min-capacity", action="store_true",
                   help="skip the search for the smallest card of rows that fit (faster)")
    pg = s.add_mutually_exclusive_group()
    pg.add_argument("--progress", dest="progress", action="store_true", default=None,
                    help="show a progress bar (tqdm; default: on a terminal)")
    pg.add_argument("--no-progress", dest="progress", action="store_false")
    s.set_defaults(func=cmd_tune)
