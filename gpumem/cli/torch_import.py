"""``gpumem import-torch``: a PyTorch memory snapshot's history as a trace to replay."""
from __future__ import annotations

import argparse

from gpumem.cli.common import EXIT_OK, CliError, fmt_bytes, load_torch_snapshot, say


def cmd_import_torch(args: argparse.Namespace) -> int:
    from gpumem.observe.trace import write_trace
    data = load_torch_snapshot(args.snapshot, device=args.cuda_device, strict=args.strict)
    try:
        n = write_trace(args.output, data)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    meta = data.metadata
    say(f"wrote {args.output}: {n:,} events ({data.n_allocs:,} allocs) of device "
         f"{meta['device']}, peak live {fmt_bytes(data.peak_live_bytes)}")
    if meta["orphan_frees"]:
        say(f"  left out {meta['orphan_frees']:,} free(s) of memory allocated before the "
             f"recording started")
    if meta["live_at_end"]:
        say(f"  {meta['live_at_end']:,} allocation(s) still live at the end (kept, no free)")
    say(f"next: gpumem replay {args.output} --device sim:24GiB")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'import-torch' command."""
    s = sub.add_parser("import-torch", help="turn a PyTorch memory snapshot "
                       "(torch.cuda.memory._dump_snapshot) into a trace to replay")
    s.add_argument("snapshot", help="the .pickle written by _dump_snapshot(), or 'demo' for "
                                    "the sample shipped with gpumem (no torch needed)")
    s.add_argument("-o", "--output", required=True, metavar="TRACE",
                   help="the trace to write (.csv or .csv.gz)")
    s.add_argument("--cuda-device", type=int, metavar="N",
                   help="which device's history (default: the only one recorded)")
    s.add_argument("--strict", action="store_true",
                   help="fail on a free whose allocation was not recorded (default: skip it)")
    s.set_defaults(func=cmd_import_torch)
