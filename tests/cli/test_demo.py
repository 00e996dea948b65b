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


def test_demo_figures_each_count_one_thing_and_agree_with_the_counters(capsys):
    """real: the demo's segment and buffer figures are labelled by what they count, and each
    equals its counter: "N held at most" is the replay's segments_peak, "M at peak live" and
    "at peak live: M segments" are the segments of the snapshot at peak live (the issue saw
    "36 at peak" beside "at the peak: 19"); the stats line's device buffers are the tracked
    live buffers (it used to say "4 buffers", counting the CPU-fallback one, beside "3
    buffer(s) still live")."""
    import re

    from gpumem.cli.common import DEMO_TRACE
    from gpumem.observe.replay import replay, replay_config
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    held, at_live = map(int, re.search(r"segments\s+(\d+) held at most, (\d+) at peak live",
                                       out).groups())
    snap_segments = int(re.search(r"at peak live: (\d+) segments", out).group(1))
    res = replay(DEMO_TRACE, "sim:80GiB", replay_config("default"), snapshot_at="peak")
    assert held == res.segments_peak
    assert at_live == snap_segments == res.segments_at_peak_live == len(res.snapshot["segments"])
    device_buffers = int(re.search(r"in use [^(]+\((\d+) device buffer\(s\)\)", out).group(1))
    fallback_live = int(re.search(r"CPU fallbacks 1 \((\d+) live", out).group(1))
    still_live = int(re.search(r"still live \(tracked\): (\d+) device buffer\(s\)", out).group(1))
    assert (device_buffers, fallback_live) == (still_live, 1) == (3, 1)
