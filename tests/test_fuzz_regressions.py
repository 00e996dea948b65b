"""Every input the fuzzers (ci/fuzz.sh) ever broke gpumem with, replayed; and each harness's seed
corpus. Level: real (the parsers, readers and the Cython view/DLPack checks as users call them).

A file in tests/fuzz/crashes/<harness>/ is an input that once ended in an exception other
than a GpuMemoryError (or a wrong result, a hang, or unbounded memory) in that harness; the
harness's ``check`` now returns for it. What each harness allows and asserts is in its
docstring (tests/fuzz/*.py). Named inputs were found while the harnesses were written (from
their seeds or the first fuzzing runs); ``crash-*``, ``timeout-*`` and ``oom-*`` files are
libFuzzer's own.
"""
from __future__ import annotations

import importlib
import time

import pytest

from fuzz import HARNESSES, HERE

CRASHES = sorted(p for p in (HERE / "crashes").glob("*/*") if p.is_file())


@pytest.mark.parametrize("path", CRASHES, ids=[f"{p.parent.name}/{p.name}" for p in CRASHES])
def test_saved_input_is_answered(path):
    """The input ends in a result or a GpuMemoryError within a few seconds (the fuzzers'
    per-input limit is 10 s; the bombs among these would take hours or all memory)."""
    harness = importlib.import_module(f"fuzz.{path.parent.name}")
    started = time.monotonic()
    harness.check(path.read_bytes())
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("name", HARNESSES)
def test_seed_corpus_is_answered(name):
    """Every seed of the harness (the shipped traces' heads, snapshots made of them, edge
    cases) ends in a result or a GpuMemoryError and satisfies the harness's assertions."""
    harness = importlib.import_module(f"fuzz.{name}")
    seeds = list(harness.seeds())
    assert seeds
    for data in seeds:
        harness.check(data)
