"""`gpumem demo` (what ci/demo.sh runs) says what happens (issue 33): each narrated step carries
a claim about the pool's counters, and the counters the step really changed agree with it, with
expandable segments (the default) and with plain ones; the CPU-fallback step really serves a
host buffer.

Level: real (the Cython pool and the manager on gpumem_sim).
"""
from __future__ import annotations

import pytest

import gpumem_sim
from gpumem.cli import main
from gpumem.cli.demo import _demo_manual


@pytest.mark.parametrize("expandable", [True, False], ids=["expandable", "plain"])
def test_each_step_does_what_it_says(expandable, capsys):
    """Every step's claimed counter changes are the observed ones; the fallback step's
    printed buffer is a host buffer and the final stats count one CPU fallback."""
    dev = gpumem_sim.SimDevice("256MiB", name="demo sim 256 MiB")
    record = _demo_manual(dev, expandable=expandable)
    out = capsys.readouterr().out
    assert len(record) == 9
    for label, claim, observed in record:
        assert claim, f"step {label!r} claims nothing: it could say anything"
        assert observed == claim, f"step {label!r} claims {claim} but did {observed}"
    labels = [label for label, _, _ in record]
    assert any("CPU fallback" in label for label in labels)
    assert "-> <gpumem.FallbackBuffer" in out and "CPU fallbacks 1" in out
    assert ("grows in place" in out) == expandable
    assert dev.live_bytes == 0                      # the demo gave everything back


def test_cli_demo_runs_and_narrates_the_fallback(capsys):
    """`gpumem demo` (ci/demo.sh) exits 0 and its narrated fallback is a FallbackBuffer, not a
    device Buffer (the issue saw a sim:0 Buffer under a "CPU fallback" label)."""
    code = main(["demo"])
    out = capsys.readouterr().out
    assert code == 0
    fallback_line = next(i for i, line in enumerate(out.splitlines()) if "CPU fallback)" in line)
    assert "1 CPU fallback" in out.splitlines()[fallback_line]
    assert out.splitlines()[fallback_line + 1].strip().startswith("-> <gpumem.FallbackBuffer")
    assert "CPU fallbacks 1" in out
