"""The ``gpumem`` command (also ``python -m gpumem``).

Commands::

    gpumem info                          devices of every backend, memory and pressure
    gpumem estimate --model mistral-7b   memory to run a transformer (preset or shape flags)
    gpumem replay TRACE                  replay an allocation trace through the real pool
    gpumem snapshot [--load FILE]        segments and blocks of a demo workload or a saved file
    gpumem plot TRACE OUT.png            live vs reserved memory over a trace
    gpumem demo                          what the allocator does, on a simulated device
    gpumem import-torch SNAP -o TRACE    a PyTorch memory snapshot's history as a trace
    gpumem cluster SCHEDULER_ADDRESS     gpumem's memory on every worker of a Dask cluster
    gpumem trace synth KIND -o TRACE     a seeded synthetic trace (serving, varlen, training)

With ``--json -`` a command writes only JSON to stdout (newline-terminated) and its report to
stderr, so ``gpumem replay T --json - | jq .`` works.

Errors are one line on stderr (``gpumem: error: ...``) and a non-zero exit status: 1 for a bad
input or a failure, 2 for a usage error or a replay that ran out of memory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from gpumem import cli_common
from gpumem.cli_common import (DEMO_TRACE, EXIT_ERROR, EXIT_OK, EXIT_OOM, EXIT_USAGE, CliError,
                               fmt_bytes, json_out, load_trace, say, Parser, progress_for, replay_cfg)
from gpumem.cli_demo import cmd_demo

__all__ = ["main", "build_parser", "DEMO_TRACE"]

# --- info ---------------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    from gpumem.backends import devices, open_device
    from gpumem.config import MemoryConfig
    from gpumem.pressure import pressure_level

    config = MemoryConfig.from_env()
    rows = []
    for d in devices():
        row: dict[str, Any] = {"device": d.device, "backend": d.backend,
                               "available": d.available}
        if not d.available:
            row["reason"] = d.reason
            rows.append(row)
            continue
        total, free = d.total_memory, d.free_memory
        reserve = config.reserve_bytes
        if reserve is None:
            try:
                reserve = open_device(d.device).recommended_reserve(total)
            except Exception:
                reserve = 0
        usable = max(0, min(int(total * config.gpu_memory_fraction), total - reserve))
        used = max(0, total - free)
        ratio = min(1.0, used / usable) if usable else 1.0
        row.update(name=d.name, total_memory=total, free_memory=free, usable_memory=usable,
                   used_ratio=ratio,
                   pressure=pressure_level(ratio, config.pressure_thresholds).name)
        rows.append(row)
    if args.json:
        json_out(rows)
        return EXIT_OK
    say(f"{'device':<10} {'name':<32} {'total':>11} {'free':>11} {'usable':>11}  pressure")
    for r in rows:
        if not r["available"]:
            say(f"{r['device']:<10} unavailable: {r['reason']}")
            continue
        name = r["name"] if len(r["name"]) <= 32 else r["name"][:31] + "~"
        say(f"{r['device']:<10} {name:<32} {fmt_bytes(r['total_memory']):>11} "
             f"{fmt_bytes(r['free_memory']):>11} {fmt_bytes(r['usable_memory']):>11}  "
             f"{r['pressure']} ({r['used_ratio']:.0%} of usable in use)")
    say(f"usable = min(total x gpu_memory_fraction {config.gpu_memory_fraction}, total - "
         f"reserve); pressure counts memory already in use on the device")
    return EXIT_OK


# --- estimate -----------------------------------------------------------------------------------------
_SHAPE_FLAGS = ("hidden_size", "intermediate_size", "num_layers", "vocab_size", "num_heads")


def cmd_estimate(args: argparse.Namespace) -> int:
    from gpumem.estimate import MODEL_PRESETS, ModelShape, parse_dtype, preset
    from gpumem.estimate_training import estimate_training_memory
    if args.list:
        say(f"{'preset':<14} {'parameters':>16}  layers  hidden  heads/kv  experts  max seq")
        for name, sh in sorted(MODEL_PRESETS.items()):
            experts = f"{sh.experts_per_token}/{sh.num_experts}" if sh.num_experts > 1 else "-"
            say(f"{name:<14} {sh.parameter_count():>16,}  {sh.num_layers:>6}  "
                 f"{sh.hidden_size:>6}  {f'{sh.num_heads}/{sh.num_kv_heads}':>8}  "
                 f"{experts:>7}  {sh.max_seq_len or '-':>7}")
        return EXIT_OK
    shape_given = [f for f in _SHAPE_FLAGS if getattr(args, f) is not None]
    if args.model and shape_given:
        raise CliError("give either --model or the shape flags, not both", EXIT_USAGE)
    if args.model:
        shape = preset(args.model)
        what = args.model
    else:
        missing = [f for f in _SHAPE_FLAGS if getattr(args, f) is None]
        if missing:
            raise CliError("give --model NAME (see --list) or every shape flag; missing "
                           + ", ".join("--" + m.replace("_", "-") for m in missing), EXIT_USAGE)
        kv = args.num_kv_heads if args.num_kv_heads is not None else args.num_heads
        shape = ModelShape(args.hidden_size, args.intermediate_size, args.num_layers,
                           args.vocab_size, args.num_heads, kv,
                           tie_embeddings=args.tie_embeddings, gated_mlp=not args.no_gated_mlp,
                           bias=args.bias, max_position_embeddings=args.max_position_embeddings,
                           norm=args.norm)
        what = "custom model"
    if args.seq_len is None and shape.max_seq_len is None \
            and shape.max_position_embeddings is None:
        raise CliError("give --seq-len (this model shape has no maximum sequence length)",
                       EXIT_USAGE)
    seq_len = args.seq_len if args.seq_len is not None else shape.default_seq_len()
    parse_dtype(args.dtype)
    if args.training:
        est: Any = estimate_training_memory(shape, seq_len, args.batch, args.dtype,
                                            optimizer=args.optimizer)
        mode = f"training with {args.optimizer}"
    else:
        est = shape.estimate(seq_len, args.batch, args.dtype)
        mode = "inference"
    if args.json:
        json_out({"model": what, "mode": "training" if args.training else "inference",
                   "optimizer": args.optimizer if args.training else None,
                   "dtype": args.dtype, "seq_len": seq_len, "batch": args.batch,
                   **est.as_dict()})
        return EXIT_OK
    default = "" if args.seq_len is not None else " (the model's maximum)"
    say(f"{what}, {mode}, {args.dtype}, batch {args.batch} x {seq_len} tokens{default}")
    say(str(est))
    if args.device:
        from gpumem.manager import MemoryManager
        from gpumem.replay import open_replay_device
        with MemoryManager(open_replay_device(args.device)) as mm:
            usable = mm.usable_memory
        verdict = "fits" if est.total_bytes <= usable else "does NOT fit"
        say(f"{verdict} in the {fmt_bytes(usable)} usable on {args.device}")
    return EXIT_OK


# --- replay -------------------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    from gpumem.replay import replay
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
        _write_json(res.as_dict(), args.json)
    if getattr(args, "plot", None):
        from gpumem.plot import plot_timeline
        say(f"wrote {plot_timeline(res, args.plot)}")
    if getattr(args, "segments", None) and res.snapshot is not None:
        from gpumem.plot import plot_segments
        say(f"wrote {plot_segments(res.snapshot, args.segments)}")


def _write_json(obj: Any, dest: str) -> None:
    if dest == "-":
        json_out(obj)
        return
    text = json.dumps(obj, indent=1)
    try:
        Path(dest).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write {dest}: {exc.strerror or exc}") from None
    say(f"wrote {dest}")


# --- plot ---------------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> int:
    from gpumem.plot import plot_segments, plot_timeline
    from gpumem.replay import replay
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


# --- snapshot -----------------------------------------------------------------------------------------
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
    from gpumem.snapshot import format_snapshot, load_snapshot
    if args.load:
        snap = load_snapshot(args.load)
    else:
        import gpumem_sim
        from gpumem.config import MemoryConfig
        from gpumem.manager import MemoryManager
        with gpumem_sim.using(gpumem_sim.SimDevice(args.capacity, name="demo sim")):
            cfg = MemoryConfig(track_allocations=True, min_free_bytes=0)
            with MemoryManager("sim:0", cfg) as mm:
                live = _demo_workload(mm)
                snap = mm.snapshot()
                for b in live:
                    b.free()
    say(format_snapshot(snap, max_segments=args.max_segments))
    if args.json:
        from gpumem.snapshot import save_snapshot
        if args.json == "-":
            json_out(snap)
        else:
            try:
                save_snapshot(snap, args.json)
            except OSError as exc:
                raise CliError(f"cannot write {args.json}: {exc.strerror or exc}") from None
            say(f"wrote {args.json}")
    if args.plot:
        from gpumem.plot import plot_segments
        say(f"wrote {plot_segments(snap, args.plot, normalize=args.normalize)}")
    return EXIT_OK


# --- summary ------------------------------------------------------------------------------------------
def cmd_summary(args: argparse.Namespace) -> int:
    from gpumem.config import MemoryConfig
    from gpumem.manager import MemoryManager
    from gpumem.summary import format_summary, summary_data
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
        _write_json(data, args.json)
    return EXIT_OK


# --- import-torch -------------------------------------------------------------------------------------
def cmd_import_torch(args: argparse.Namespace) -> int:
    from gpumem.torch_snapshot import read_torch_snapshot
    from gpumem.trace import write_trace
    data = read_torch_snapshot(args.snapshot, device=args.cuda_device, strict=args.strict)
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


# --- cluster ------------------------------------------------------------------------------------------
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
        rows = memory_report(client, show=False)
    finally:
        client.close()
    if args.json:
        say(json.dumps(rows, indent=1, default=str))
    else:
        say(format_report(rows))
    return EXIT_OK


# --- parser -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from gpumem.replay import CONFIG_PRESETS
    p = Parser(prog="gpumem", description="gpumem: a caching GPU memory allocator. See what "
                "it does with your allocations.")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="show the allocator's DEBUG log (segments grown and released)")
    from gpumem import __version__
    p.add_argument("--version", action="version", version=f"gpumem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    s = sub.add_parser("info", help="devices of every backend with their memory")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("estimate", help="memory to run a transformer model")
    s.add_argument("--model", help="a preset, e.g. mistral-7b, llama-3-8b, gpt2 (see --list)")
    s.add_argument("--list", action="store_true", help="list the presets")
    s.add_argument("--dtype", default="float16", help="weight/activation dtype (default float16)")
    s.add_argument("--seq-len", type=int,
                   help="tokens per sequence (default: the model's maximum)")
    s.add_argument("--batch", type=int, default=1, help="sequences per batch (1)")
    s.add_argument("--device", help="also say whether it fits on this device (e.g. cuda:0, "
                   "sim:24GiB)")
    s.add_argument("--training", action="store_true",
                   help="estimate a training step: weights, gradients, optimizer state, "
                        "activations kept for the backward pass")
    s.add_argument("--optimizer", default="adam",
                   choices=("adam", "adamw", "sgd", "sgd-momentum"),
                   help="optimizer for --training (adam)")
    s.add_argument("--json", action="store_true", help="print JSON")
    g = s.add_argument_group("model shape (instead of --model)")
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--intermediate-size", type=int)
    g.add_argument("--num-layers", "--layers", type=int, dest="num_layers")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--num-heads", "--heads", type=int, dest="num_heads")
    g.add_argument("--num-kv-heads", "--kv-heads", type=int, dest="num_kv_heads",
                   help="(default: --num-heads)")
    g.add_argument("--tie-embeddings", action="store_true")
    g.add_argument("--no-gated-mlp", action="store_true", help="plain up/down MLP (GPT-2)")
    g.add_argument("--bias", action="store_true")
    g.add_argument("--max-position-embeddings", type=int, help="learned position table size")
    g.add_argument("--norm", choices=("rms", "layer"), default="rms")
    s.set_defaults(func=cmd_estimate)

    def replay_flags(s: argparse.ArgumentParser) -> None:
        s.add_argument("--device", default="sim:80GiB",
                       help="sim:<size> for a fresh simulated device, or cuda:0, opencl:0, "
                            "sim:0, cpu (default sim:80GiB)")
        s.add_argument("--config", default="default", choices=CONFIG_PRESETS,
                       help="MemoryConfig preset (CPU fallback off, no free margin)")
        s.add_argument("--phase", help="replay one phase of the trace (from its .json sidecar)")
        s.add_argument("--expandable-segments", action="store_true",
                       help="grow large-pool segments in place (devices with virtual memory)")

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

    s = sub.add_parser("plot", help="plot live vs reserved memory over a trace")
    s.add_argument("trace", help="a trace file, or 'demo'")
    s.add_argument("out", help="the PNG to write")
    replay_flags(s)
    s.add_argument("--x", choices=("event", "time"), default="event", help="x axis")
    s.add_argument("--segments", metavar="PNG", help="also draw the segments at peak live")
    s.set_defaults(func=cmd_plot)

    s = sub.add_parser("import-torch", help="turn a PyTorch memory snapshot "
                       "(torch.cuda.memory._dump_snapshot) into a trace to replay")
    s.add_argument("snapshot", help="the .pickle written by _dump_snapshot()")
    s.add_argument("-o", "--output", required=True, metavar="TRACE",
                   help="the trace to write (.csv or .csv.gz)")
    s.add_argument("--cuda-device", type=int, metavar="N",
                   help="which device's history (default: the only one recorded)")
    s.add_argument("--strict", action="store_true",
                   help="fail on a free whose allocation was not recorded (default: skip it)")
    s.set_defaults(func=cmd_import_torch)

    s = sub.add_parser("demo", help="show what the allocator does, on a simulated device")
    s.add_argument("--trace", help=f"trace to replay (default: the packaged {DEMO_TRACE.name})")
    s.add_argument("--device", default="sim:80GiB", help="replay device (sim:80GiB)")
    s.add_argument("--config", default="default", choices=CONFIG_PRESETS)
    s.add_argument("--plot", metavar="PNG",
                   help="write the timeline there and the segment map next to it")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("cluster", help="gpumem's memory on every worker of a Dask cluster "
                       "(GpumemPlugin's counters, as of the last heartbeat)")
    s.add_argument("address", help="the scheduler's address, e.g. tcp://10.0.0.5:8786")
    s.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the scheduler (10)")
    s.add_argument("--json", action="store_true", help="print JSON rows")
    s.set_defaults(func=cmd_cluster)

    from gpumem import cli_trace
    cli_trace.register(sub)
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
    cli_common.report_to_stderr = getattr(args, "json", None) == "-"
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
        cli_common.report_to_stderr = False
        remove_handler(handler)
