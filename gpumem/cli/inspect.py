"""``gpumem snapshot`` and ``gpumem summary``: segments and blocks, and the summary, of a demo workload or a file."""
from __future__ import annotations

import argparse
from typing import Any

from gpumem.cli.common import EXIT_OK, EXIT_USAGE, CliError, json_out, say, write_json


def _demo_workload(mm: Any) -> list:
    """A few tagged buffers with holes, as a model's weights, activations and scratch would
    leave them; returns the live buffers (keep them referenced while snapshotting)."""
    MiB = 1 << 20
    keep = [mm.malloc(64 * MiB, tag="weights"), mm.malloc(64 * MiB, tag="weights"),
            mm.malloc(12 * MiB, tag="kv-cache")]
    acts = [mm.malloc(s * MiB, tag="activations") for s in (3, 5, 3, 6, 2)]
    small = [mm.malloc(s, tag="scalars") for s in (256, 4096, 512, 100_000, 8)]
    for b in acts[::2] + small[1::2]:       # holes between live blocks
        b.free()
    keep += acts[1::2] + small[0::2]
    keep.append(mm.malloc(1 * MiB + 300, tag="scratch"))
    return keep


def cmd_snapshot(args: argparse.Namespace) -> int:
    from gpumem.observe.snapshot import format_snapshot, load_snapshot
    if args.load:
        snap = load_snapshot(args.load)
    else:
        import gpumem_sim
        from gpumem.config import MemoryConfig
        from gpumem.manager.memory_manager import MemoryManager
        with gpumem_sim.using(gpumem_sim.SimDevice(args.capacity, name="demo sim")):
            cfg = MemoryConfig(track_allocations=True, min_free_bytes=0)
            with MemoryManager("sim:0", cfg) as mm:
                live = _demo_workload(mm)
                snap = mm.snapshot()
                for b in live:
                    b.free()
    say(format_snapshot(snap, max_segments=args.max_segments))
    if args.json:
        from gpumem.observe.snapshot import save_snapshot
        if args.json == "-":
            json_out(snap)
        else:
            try:
                save_snapshot(snap, args.json)
            except OSError as exc:
                raise CliError(f"cannot write {args.json}: {exc.strerror or exc}") from None
            say(f"wrote {args.json}")
    if args.plot:
        from gpumem.observe.plot import plot_segments
        say(f"wrote {plot_segments(snap, args.plot, normalize=args.normalize)}")
    return EXIT_OK

def cmd_summary(args: argparse.Namespace) -> int:
    from gpumem.config import MemoryConfig
    from gpumem.manager.memory_manager import MemoryManager
    from gpumem.observe.summary import format_summary, summary_data
    if args.top_tags < 0:
        raise CliError(f"--top-tags must be >= 0, got {args.top_tags}", EXIT_USAGE)
    cfg = MemoryConfig.from_env().replace(track_allocations=True, min_free_bytes=0)
    with MemoryManager(args.device, cfg) as mm:
        live = _demo_workload(mm)
        try:
            data = summary_data(mm, top_tags=args.top_tags)
        finally:
            for b in live:
                b.free()
    say(format_summary(data))               # on stderr when --json - takes stdout
    if args.json:
        write_json(data, args.json)
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'snapshot', 'summary' commands."""
    s = sub.add_parser("snapshot", help="segments and blocks: of a demo workload or a file")
    s.add_argument("--load", metavar="FILE", help="a snapshot JSON saved earlier")
    s.add_argument("--json", metavar="FILE", help="save the snapshot as JSON ('-': stdout)")
    s.add_argument("--plot", metavar="PNG", help="draw the segments")
    s.add_argument("--normalize", action="store_true",
                   help="draw every segment at the same width")
    s.add_argument("--capacity", default="1GiB", help="demo device size (1GiB)")
    s.add_argument("--max-segments", type=int, default=30, help="segments listed (30)")
    s.set_defaults(func=cmd_snapshot)
    s = sub.add_parser("summary", help="MemoryManager.memory_summary() of a demo workload")
    s.add_argument("--device", default="sim:1GiB",
                   help="where to run the workload: sim:<size> (a private simulated device), "
                        "cpu, opencl:0, cuda:0... (default sim:1GiB)")
    s.add_argument("--top-tags", type=int, default=5, help="tags listed (5)")
    s.add_argument("--json", metavar="FILE", help="also save the figures as JSON ('-': only "
                   "JSON, to stdout)")
    s.set_defaults(func=cmd_summary)
