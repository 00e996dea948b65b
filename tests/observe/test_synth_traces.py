"""Synthetic traces (gpumem.observe.synth_traces) and `gpumem trace synth`, level **real**:
the generators feed replays on the sim (through the real pool), so these tests prove that their
traces are valid, reproducible, shaped as documented, and replay without OOM."""
from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest

from gpumem.cli import main
from gpumem.errors import InvalidInputError
from gpumem.observe.synth_traces import KINDS, ROUND, synthesize
from gpumem.observe.replay import replay
from gpumem.observe.trace import OP_ALLOC, OP_FREE, read_trace, write_trace
from gpumem.units import GiB

#: shorter than the defaults, same shapes: keeps each test well under a second
SHORT = {"serving": {"steps": 150}, "varlen": {"steps": 60}, "training": {"steps": 6}}


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("t_ns", "ops", "ids", "sizes")) and a.extra == b.extra


@pytest.mark.parametrize("kind", list(KINDS))
def test_seeded_and_deterministic(kind):
    """The same seed gives the identical trace (times, ops, ids, sizes, tags); another seed a
    different one."""
    a = synthesize(kind, seed=5, **SHORT[kind])
    assert _same(a, synthesize(kind, seed=5, **SHORT[kind]))
    assert not _same(a, synthesize(kind, seed=6, **SHORT[kind]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_defaults_fit_the_documented_envelope(kind):
    """With the defaults a trace has 20k-200k events and a peak live of 1-20 GiB; every size is
    a multiple of 512 bytes (PyTorch's rounding); ids count allocations from 0; time never goes
    back; every free pairs with an earlier allocation of the same id and size."""
    d = synthesize(kind)
    assert 20_000 <= len(d) <= 200_000
    assert 1 * GiB <= d.peak_live_bytes <= 20 * GiB
    assert np.all(d.sizes % ROUND == 0) and np.all(d.sizes >= ROUND)
    assert np.all(np.diff(d.t_ns) > 0)
    alloc_ids = d.ids[d.ops == OP_ALLOC]
    assert np.array_equal(alloc_ids, np.arange(len(alloc_ids)))
    live = {}
    for op, i, s in zip(d.ops.tolist(), d.ids.tolist(), d.sizes.tolist()):
        if op == OP_ALLOC:
            live[i] = s
        else:
            assert op == OP_FREE and live.pop(i) == s


def test_scale_multiplies_sizes():
    """scale=2 doubles every size (up to the 512-byte rounding): the same events, twice the
    peak."""
    a, b = synthesize("varlen", seed=1, steps=20), synthesize("varlen", seed=1, steps=20, scale=2)
    assert np.array_equal(a.ops, b.ops) and np.array_equal(a.ids, b.ids)
    assert np.all(np.abs(b.sizes - 2 * a.sizes) <= ROUND)
    assert b.peak_live_bytes == pytest.approx(2 * a.peak_live_bytes, rel=1e-3)


def test_serving_caches_grow_and_the_batch_changes():
    """Serving: a request's KV cache allocations grow (each concatenation allocates a longer
    tensor, then frees the old one), many requests grow more than once, and the decode batch
    (the size of the step's logits) takes many values as requests come and go."""
    d = synthesize("serving", seed=2)
    tags = d.extra["tag"]
    caches = defaultdict(list)
    batches = set()
    for k in np.nonzero(d.ops == OP_ALLOC)[0].tolist():
        if tags[k].startswith("kv:"):
            caches[tags[k]].append(int(d.sizes[k]))
        elif tags[k] == "decode_logits":
            batches.add(int(d.sizes[k]))
    assert len(caches) > 100
    for sizes in caches.values():
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert sum(len(s) > 2 for s in caches.values()) > 50
    assert len(batches) >= 10
    # the old cache is freed right after its longer copy is allocated (torch.cat)
    first_grow = next(k for k, t in enumerate(tags) if t.startswith("kv:") and
                      d.ops[k] == OP_ALLOC and sum(tags[j] == t for j in range(k)) >= 2)
    assert d.ops[first_grow + 1] == OP_FREE and tags[first_grow + 1] == tags[first_grow]


def test_training_state_is_allocated_once():
    """Training: parameters are allocated once before the first step, Adam's two states per
    parameter at the first step only, and gradients every step."""
    d = synthesize("training", seed=0, steps=5)
    allocs = [t for t, o in zip(d.extra["tag"], d.ops.tolist()) if o == OP_ALLOC]
    n_param = allocs.count("param")
    assert allocs[:n_param] == ["param"] * n_param
    assert allocs.count("adam") == 2 * n_param
    assert allocs.count("grad") == 5 * n_param


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("expandable", [False, True])
def test_replays_without_oom_and_ends_at_the_persistent_state(kind, expandable):
    """Each kind replays on sim:80GiB through the real pool (either segment mode) with no OOM;
    live bytes come back to 0 (serving, varlen) or to the parameters and Adam state
    (training)."""
    d = synthesize(kind, seed=3, **SHORT[kind])
    from gpumem.observe.replay import replay_config
    cfg = replay_config("default").replace(expandable_segments=expandable)
    res = replay(d, "sim:80GiB", cfg, record_series=True)
    assert res.num_ooms == 0 and res.skipped_frees == 0
    persistent = sum(int(s) for s, t, o in zip(d.sizes, d.extra["tag"], d.ops.tolist())
                     if o == OP_ALLOC and t in ("param", "adam"))
    assert int(res.series["live"][-1]) == (persistent if kind == "training" else 0)
    assert res.peak_live_bytes == d.peak_live_bytes


def test_cli_writes_what_read_trace_reads_back(tmp_path, capsys):
    """`gpumem trace synth serving --seed 4 --steps 80 -o F.csv.gz` writes exactly
    synthesize("serving", seed=4, steps=80): read_trace gives the same events and tags."""
    out = tmp_path / "s.csv.gz"
    assert main(["trace", "synth", "serving", "--seed", "4", "--steps", "80", "-o",
                 str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    back = read_trace(out)
    assert _same(back, synthesize("serving", seed=4, steps=80))
    assert main(["trace", "synth", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(re.search(rf"^{k}\s", listed, re.M) for k in KINDS)


def test_trace_writer_round_trip_is_byte_stable(tmp_path):
    """Writing the same trace twice gives the same bytes (gzip without a timestamp), so a
    synthetic trace can be regenerated and compared."""
    d = synthesize("varlen", seed=9, steps=10)
    write_trace(tmp_path / "a.csv.gz", d)
    write_trace(tmp_path / "b.csv.gz", synthesize("varlen", seed=9, steps=10))
    assert (tmp_path / "a.csv.gz").read_bytes() == (tmp_path / "b.csv.gz").read_bytes()


@pytest.mark.parametrize("kind, params, word", [
    ("servng", {}, "kind"),
    (None, {}, "kind"),
    ("serving", {"stepz": 3}, "stepz"),
    ("serving", {"steps": 0}, "steps"),
    ("serving", {"steps": 2.5}, "steps"),
    ("serving", {"steps": True}, "steps"),
    ("varlen", {"scale": -1.0}, "scale"),
    ("varlen", {"scale": float("nan")}, "scale"),
    ("training", {"seq": 10}, "seq"),
    ("serving", {"seed": -1}, "seed"),
])
def test_bad_arguments_name_what_is_wrong(kind, params, word):
    """An unknown kind or parameter, or a value out of range, raises InvalidInputError naming
    the argument and what is allowed."""
    with pytest.raises(InvalidInputError, match=word):
        synthesize(kind, **params)


def test_cli_errors_are_one_line(capsys, tmp_path):
    """Bad input on the command line: one error line and a non-zero status, no file written."""
    out = tmp_path / "x.csv"
    assert main(["trace", "synth", "servng", "-o", str(out)]) == 1
    assert main(["trace", "synth", "serving", "--steps", "0", "-o", str(out)]) == 1
    assert main(["trace", "synth", "serving"]) == 2
    assert main(["trace"]) == 2
    err = capsys.readouterr().err
    assert err.count("gpumem: error:") == 4 and "Traceback" not in err
    assert not out.exists()
