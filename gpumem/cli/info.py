"""``gpumem info`` (devices and their memory) and ``gpumem estimate`` (memory to run a model)."""
from __future__ import annotations

import argparse
from typing import Any

from gpumem.cli.common import EXIT_OK, EXIT_USAGE, CliError, fmt_bytes, json_out, say


def cmd_info(args: argparse.Namespace) -> int:
    from gpumem.backends import devices, open_device
    from gpumem.config import MemoryConfig
    from gpumem.manager.pressure import pressure_level

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
    limits = config.limit_kinds()
    sleeping = sleeping_tag_rows()
    for row in rows:
        if row["available"]:
            row["limits"] = limits
        row["sleeping_tags"] = [t for t in sleeping if t["device"] == row["device"]]
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
    hard = [n for n, k in limits.items() if k == "hard"]
    say(f"limits: {config.describe_limits()}")
    say("  soft: trims the cache and sets the pressure scale, never refuses what the device can "
        "serve; hard (" + (", ".join(hard) if hard else "none set") + "): refuses, named in "
        "the OOM (docs/pressure_and_oom.md)")
    from gpumem.config import env_settings
    taken = env_settings()
    if taken:
        say(f"settings from the environment: {', '.join(taken.values())}")
    if sleeping:
        say("sleeping tags (managers of this process: MemoryManager.sleep):")
        for t in sleeping:
            say(f"  {t['device']:<10} {t['tag']!r:<16} asleep {fmt_bytes(t['asleep_bytes']):>11}"
                f"  backup {fmt_bytes(t['backup_bytes']):>11}")
    from gpumem.cli.groups import group_lines
    lines = group_lines(live_only=True)           # dead and refused ledgers: one line
    if lines:
        say("shared groups (gpumem groups):")
        for line in lines:
            say("  " + line)
    return EXIT_OK

def sleeping_tag_rows() -> list[dict[str, Any]]:
    """The sleeping tags of this process's managers: device, tag (its repr when not a JSON
    value), asleep and backup bytes."""
    from gpumem.placement import peers
    out = []
    for mm in peers.open_managers():
        states = getattr(mm, "sleeping_tags", None)
        for t in (states() if states is not None else []):
            if t["asleep"]:
                tag = t["tag"] if isinstance(t["tag"], (str, int, float)) else repr(t["tag"])
                out.append({"device": mm.device_string, "tag": tag,
                            "asleep_bytes": t["asleep_bytes"], "backup_bytes": t["backup_bytes"]})
    return out


_SHAPE_FLAGS = ("hidden_size", "intermediate_size", "num_layers", "vocab_size", "num_heads")


def cmd_estimate(args: argparse.Namespace) -> int:
    from gpumem.planning.estimate import MODEL_PRESETS, ModelShape, parse_dtype, preset
    from gpumem.planning.estimate_training import estimate_training_memory
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
        from gpumem.manager.memory_manager import MemoryManager
        from gpumem.observe.replay import open_replay_device
        with MemoryManager(open_replay_device(args.device)) as mm:
            usable = mm.usable_memory
        verdict = "fits" if est.total_bytes <= usable else "does NOT fit"
        say(f"{verdict} in the {fmt_bytes(usable)} usable on {args.device}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'info', 'estimate' commands."""
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
