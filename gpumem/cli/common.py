"""Plumbing shared by the ``gpumem`` command's subcommands (gpumem.cli, gpumem.cli.demo):
exit statuses, the one-line error, where the report goes, and the trace helpers.

Thread safety: the CLI runs in one thread; ``report_to_stderr`` is set by ``gpumem.cli.main``
for the length of one command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["DEMO_TRACE", "TORCH_SAMPLE", "write_json", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_OOM",
           "EXIT_BAD_FILE", "CliError", "Parser", "say", "json_out", "fmt_bytes", "load_trace",
           "load_torch_snapshot", "progress_for", "replay_cfg", "say_environment"]

#: the small trace shipped with gpumem: step 1 of resnet50_train from data/traces (buffers
#: live at the start of the step allocated first, everything freed at the end)
DEMO_TRACE = Path(__file__).resolve().parents[1] / "data" / "resnet50_train_step1.csv.gz"

#: a PyTorch memory snapshot shipped with gpumem ('demo' for import-torch): the demo trace
#: through gpumem's exporter (ci/make_torch_sample.py says how), to try without torch
TORCH_SAMPLE = Path(__file__).resolve().parents[1] / "data" / "torch_snapshot_sample.pickle"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_OOM = 2
#: a trace or PyTorch snapshot that cannot be read (malformed, missing): the input is unusable,
#: as with a usage error, whatever the file says (its reading is bounded: docs/testing.md)
EXIT_BAD_FILE = 2
#: traces at least this long get a progress bar when stderr is a terminal
PROGRESS_MIN_EVENTS = 200_000


class CliError(Exception):
    """A failure to report as one line, with its exit status."""

    def __init__(self, message: str, status: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.status = status


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        hint = f" (see '{self.prog} --help')"
        raise CliError(f"{message}{hint}", EXIT_USAGE)


#: where the human-readable report goes: stdout, or stderr while stdout carries JSON
report_to_stderr = False


def say(text: str = "") -> None:
    """A line of the report (stderr when the command writes JSON to stdout)."""
    print(text, file=sys.stderr if report_to_stderr else sys.stdout)


def json_out(obj: Any) -> None:
    """JSON on stdout, newline-terminated."""
    sys.stdout.write(json.dumps(obj, indent=1) + "\n")


def fmt_bytes(n: float) -> str:
    from gpumem.units import format_bytes
    return format_bytes(n)




def load_trace(trace: str) -> Any:
    """The trace at path ``trace`` ("demo": the shipped one); a bad file is a CliError with
    EXIT_BAD_FILE."""
    from gpumem.errors import TraceFormatError
    from gpumem.observe.trace import read_trace
    try:
        return read_trace(DEMO_TRACE if trace == "demo" else trace)
    except TraceFormatError as exc:
        raise CliError(str(exc), EXIT_BAD_FILE) from None


def load_torch_snapshot(path: str, **options: Any) -> Any:
    """``read_torch_snapshot(path, **options)`` ("demo": the shipped sample); a bad file is a
    CliError with EXIT_BAD_FILE."""
    from gpumem.errors import InvalidInputError
    from gpumem.observe.torch_snapshot import read_torch_snapshot
    try:
        return read_torch_snapshot(TORCH_SAMPLE if path == "demo" else path, **options)
    except InvalidInputError as exc:
        raise CliError(str(exc), EXIT_BAD_FILE) from None


def progress_for(n_events: int, flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return n_events >= PROGRESS_MIN_EVENTS and sys.stderr.isatty()


def replay_cfg(args: argparse.Namespace) -> Any:
    """The --config preset read with the GPUMEM_* variables (as every manager reads them;
    gpumem.observe.replay.replay_config), then the command line over both: --segments POLICY,
    --expandable-segments / --no-expandable-segments and --expandable-handle-size. A flag
    that names the segment policy replaces whatever the environment said about it."""
    from gpumem.errors import InvalidInputError
    from gpumem.observe.replay import replay_config
    policy = getattr(args, "segments", None)
    choice = getattr(args, "expandable_segments", None)
    handle = getattr(args, "expandable_handle_size", None)
    try:
        cfg = replay_config(args.config)
        if policy is None and choice is None and handle is None:
            return cfg
        # the command line names the policy: the environment's segment settings give way
        changes: dict[str, Any] = {"segments": policy or "auto", "expandable_segments": choice,
                                   "expandable_handle_size": None}
        if handle is not None:
            from gpumem.config import parse_handle_size
            changes["expandable_handle_size"] = parse_handle_size(
                handle, what="--expandable-handle-size")
        return cfg.replace(**changes)
    except InvalidInputError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def say_environment() -> None:
    """One line naming the GPUMEM_* settings a replay took from the environment and those it
    overrides (and why), when there are any."""
    from gpumem.observe.replay import REPLAY_OVERRIDES_WHY, environment_settings
    taken, ignored = environment_settings()
    if taken:
        say(f"settings from the environment: {', '.join(taken)}")
    if ignored:
        say(f"ignored: {', '.join(ignored)} ({REPLAY_OVERRIDES_WHY})")


def write_json(obj: Any, dest: str) -> None:
    if dest == "-":
        json_out(obj)
        return
    text = json.dumps(obj, indent=1)
    try:
        Path(dest).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot write {dest}: {exc.strerror or exc}") from None
    say(f"wrote {dest}")
