"""The CI scripts a user runs first (issue 41, points 1 and 6): ``ci/test.sh`` runs every pass
even when one fails and names each failed pass; ``.ci/run`` fails when any step fails, after
running them all; ``ci/setup_env.sh`` prints one line per step and lets pip draw its progress
on a terminal.

Level: **real** (bash runs the real scripts of the checkout), with ``python`` replaced by a
shim that records its calls and plays pytest and pip, so no suite runs and nothing is installed
(``GPUMEM_VENV=none GPUMEM_OFFLINE=1``: the set-up's no-venv, no-index path).
"""
from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
from pathlib import Path

import pytest

from invariants import require_checkout

# the python that ci/setup_env.sh and ci/test.sh call: logs each call (tab-separated: the
# test backends, the segments setting, LD_LIBRARY_PATH, the arguments) and plays its part
SHIM = r"""#!/usr/bin/env bash
printf '%s\t%s\t%s\t%s\n' "${GPUMEM_TEST_BACKENDS-}" "${GPUMEM_TEST_SEGMENTS-}" \
    "${LD_LIBRARY_PATH-}" "$*" >> "$SHIM_LOG"
case "$1 ${2-}" in
    "-m pip") [ "${3-}" = show ] && exit 1; exit 0 ;;
    "-m gpumem") exit 0 ;;
    "-m pytest")
        key="${GPUMEM_TEST_BACKENDS:-all}/${GPUMEM_TEST_SEGMENTS:-auto}"
        case ",${SHIM_FAIL-}," in
            *",$key,"*) echo "== 1 failed, 9 passed in 1.00s =="; exit 1 ;;
        esac
        echo "== 10 passed in 1.00s =="; exit 0 ;;
esac
case "$*" in
    *fake_cuda.build*) echo "$SHIM_FAKE_DIR"; exit 0 ;;
    *availability*) exit "${SHIM_CUDA_RC:-0}" ;;    # 0: cuda-python here, no libcuda
esac
echo "python shim: unexpected call: $*" >&2
exit 99
"""


def _shim_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    shim = tmp_path / "shim" / "python"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(SHIM)
    shim.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PYTHON": str(shim), "GPUMEM_VENV": "none", "GPUMEM_OFFLINE": "1",
           "SHIM_LOG": str(tmp_path / "calls.log"), "SHIM_FAKE_DIR": str(tmp_path / "fake")}
    env.update(extra)
    return env


def _calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "calls.log"
    return [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []


def _pytest_runs(tmp_path: Path) -> list[tuple[str, str, bool]]:
    """(backends, segments, on the fake driver) of each pytest run, in order."""
    return [(b, s, str(tmp_path / "fake") in ld) for b, s, ld, args in _calls(tmp_path)
            if args.startswith("-m pytest")]


def _run_test_sh(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    root = require_checkout("ci/test.sh")
    return subprocess.run(["bash", "ci/test.sh", "-q"], cwd=root, env=_shim_env(tmp_path, **extra),
                          capture_output=True, text=True, timeout=120)


ALL_FOUR = [("", "", False), ("sim", "plain", False), ("cuda", "", True), ("cuda", "plain", True)]


def test_test_sh_runs_every_pass_after_a_failure_and_names_it(tmp_path):
    """The first pass fails (as a timing test under load once did): the three other passes
    still run, each with its own settings, and the script exits non-zero with one summary
    line per pass that names the failed one. Real (bash, the real ci/test.sh; python shimmed)."""
    out = _run_test_sh(tmp_path, SHIM_FAIL="all/auto")
    assert _pytest_runs(tmp_path) == ALL_FOUR, out.stdout + out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    summary = out.stdout[out.stdout.index("=== passes: summary ==="):]
    lines = summary.splitlines()
    assert sum(line.startswith("ok ") for line in lines) == 3, summary
    failed = [line for line in lines if line.startswith("FAILED ")]
    assert len(failed) == 1 and "the suite" in failed[0] and "exit 1" in failed[0], summary
    assert "failed pass: the suite" in summary
    assert lines[-1] == "passes: 3 passed, 1 failed"
    # every pytest run got the extra arguments
    assert all(args.endswith(" -q") for *_, args in _calls(tmp_path)
               if args.startswith("-m pytest"))


def test_test_sh_names_every_failed_pass(tmp_path):
    """Two passes fail (sim without expandable segments, the fake driver's first): both are
    named, the others are reported ok. Real (bash, the real ci/test.sh; python shimmed)."""
    out = _run_test_sh(tmp_path, SHIM_FAIL="sim/plain,cuda/auto")
    assert _pytest_runs(tmp_path) == ALL_FOUR
    assert out.returncode == 1
    failed = [line for line in out.stdout.splitlines() if line.startswith("failed pass: ")]
    assert len(failed) == 2 and "expandable segments off" in failed[0], failed
    assert "fake libcuda" in failed[1] and "off" not in failed[1], failed
    assert out.stdout.splitlines()[-1] == "passes: 2 passed, 2 failed"


def test_test_sh_all_green_and_skipped_fake_driver(tmp_path):
    """All passes green: exit 0 and "passes: 4 passed, 0 failed"; where the fake driver does
    not apply (a real driver, or no cuda-python) its passes are listed as skipped with the
    reason, and do not fail the run. Real (bash, the real ci/test.sh; python shimmed)."""
    out = _run_test_sh(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "passes: 4 passed, 0 failed"
    (tmp_path / "calls.log").unlink()
    out = _run_test_sh(tmp_path, SHIM_CUDA_RC="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _pytest_runs(tmp_path) == ALL_FOUR[:2]
    skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 2 and all("a CUDA driver is here" in line for line in skipped)
    assert out.stdout.splitlines()[-1] == "passes: 2 passed, 0 failed"


def test_ci_run_runs_every_step_and_fails_on_any(tmp_path):
    """.ci/run runs the tests, the docs build and the packages even when the tests fail, and
    exits non-zero naming the failed step; with every step green it exits 0. Real (bash, the
    real .ci/run and ci/passes.sh, in a copy whose three step scripts are stand-ins)."""
    root = require_checkout(".ci/run")
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    (tree / "ci").mkdir()
    shutil.copy(root / ".ci" / "run", tree / ".ci" / "run")
    shutil.copy(root / "ci" / "passes.sh", tree / "ci" / "passes.sh")
    for step in ("test", "docs", "package"):
        (tree / "ci" / f"{step}.sh").write_text(
            f'echo "ran {step} with $GPUMEM_TEST_BACKENDS" >> "$STEPS_LOG"\n'
            f'[ "$FAIL_STEP" != {step} ]\n')
    env = {"PATH": os.environ["PATH"], "STEPS_LOG": str(tmp_path / "steps.log")}
    out = subprocess.run(["bash", ".ci/run"], cwd=tree, env={**env, "FAIL_STEP": "test"},
                         capture_output=True, text=True, timeout=60)
    assert (tmp_path / "steps.log").read_text().splitlines() == [
        f"ran {s} with sim,cpu,opencl" for s in ("test", "docs", "package")]
    assert out.returncode == 1
    assert "failed pass: tests (bash ci/test.sh)" in out.stdout
    assert out.stdout.splitlines()[-1] == "steps: 2 passed, 1 failed"
    out = subprocess.run(["bash", ".ci/run"], cwd=tree, env={**env, "FAIL_STEP": "none"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "steps: 3 passed, 0 failed"


def test_ci_run_calls_the_readme_test_command():
    """.ci/run's test step is the README's test command, `bash ci/test.sh`, and it builds the
    docs with ci/docs.sh, which the README also names. Real (reads the checkout)."""
    root = require_checkout(".ci/run and README.md")
    run = (root / ".ci" / "run").read_text()
    readme = (root / "README.md").read_text()
    for command in ("bash ci/test.sh", "bash ci/docs.sh"):
        assert command in run and command in readme, command


def _setup_in_pty(tmp_path: Path, extras: str) -> str:
    """Source ci/setup_env.sh with stdout on a terminal; what it printed."""
    root = require_checkout("ci/setup_env.sh")
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(["bash", "-c", f'source ci/setup_env.sh "{extras}"'], cwd=root,
                            env=_shim_env(tmp_path), stdout=secondary, stderr=secondary,
                            stdin=subprocess.DEVNULL)
    os.close(secondary)
    chunks = []
    while True:
        ready, _, _ = select.select([primary], [], [], 60)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(primary, 4096)
        except OSError:             # EIO: the terminal's other end is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def test_setup_env_prints_one_line_per_step(tmp_path):
    """ci/setup_env.sh prints "[i/n] ..." for each step, n its step count, the last one the
    gpumem build; into a log (not a terminal) pip runs with -q. Real (bash, the real script;
    python shimmed)."""
    root = require_checkout("ci/setup_env.sh")
    out = subprocess.run(["bash", "-c", 'source ci/setup_env.sh "test,plot"'], cwd=root,
                         env=_shim_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert [s[:5] for s in steps] == ["[1/2]", "[2/2]"], out.stdout
    assert "GPUMEM_VENV=none" in steps[0] and "editable, with [test,plot]" in steps[1]
    assert "Cython core" in steps[1]
    installs = [args for *_, args in _calls(tmp_path) if args.startswith("-m pip install")]
    assert installs and all(" -q " in f" {args} " for args in installs), installs


def test_setup_env_lets_pip_show_progress_on_a_terminal(tmp_path):
    """On a terminal pip runs without -q (its progress bars are the progress of the long
    steps), and the step lines still come. Real (bash, the real script under a pty; python
    shimmed)."""
    text = _setup_in_pty(tmp_path, "plot")
    assert "[1/2]" in text and "[2/2]" in text, text
    installs = [args for *_, args in _calls(tmp_path) if args.startswith("-m pip install")]
    assert installs and not any(" -q " in f" {args} " for args in installs), installs
