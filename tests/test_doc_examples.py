"""Every Python example in README.md and docs/*.md runs as written (docs/testing.md, "The
documentation's examples").

Each ```python block of a page runs, in order, in one namespace per page (a page reads top to
bottom, so a later block may use what an earlier one made), on two simulated 24 GiB GPUs
installed for the page (``sim:0``, ``sim:1``; ``GPUMEM_DEVICE=sim:0`` makes the first the
default device), in a scratch folder where ``gpumem/data`` is the checkout's. A marker on the
line before a block's fence changes that:

- ``<!-- requires: cuda, torch -->``: the block runs only where each of these is there
  (``cuda``: a CUDA device gpumem can open; ``opencl``: an OpenCL device; ``cupy``, ``numba``,
  ``torch``: the framework with a CUDA device; ``dask``: ``distributed``); elsewhere it is
  reported as skipped, with what was missing.
- ``<!-- fragment: why -->``: the block is not meant to run alone (it needs a cluster's client,
  or it is a test module that another test runs); it is only compiled. Keep these few.

Level: **real** (the documented code on gpumem_sim devices; OpenCL blocks on PoCL where CI has
it).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from invariants import require_checkout

ROOT = Path(__file__).resolve().parent.parent
#: none outside a checkout (ci/package.sh runs tests/ against an installed wheel)
PAGES = (["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
         if (ROOT / "README.md").is_file() else [])
REQUIREMENTS = ("cuda", "opencl", "cupy", "numba", "torch", "dask")

_FENCE = re.compile(r"^(?P<indent>[ ]*)```python[ ]*$")
_MARKER = re.compile(r"^[ ]*<!--\s*(?P<kind>requires|fragment):\s*(?P<value>.*?)\s*-->[ ]*$")


@dataclass
class Block:
    page: str
    line: int                       # of the opening fence, 1-based
    code: str
    requires: tuple[str, ...] = ()
    fragment: str = ""              # why it does not run alone ("": it runs)

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str, text: str) -> list[Block]:
    """The ```python blocks of a page's text, with their markers."""
    lines = text.split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{i + 1}: a ```python block is never closed")
        code = textwrap.dedent("\n".join(lines[i + 1:end]))
        block = Block(page, i + 1, code)
        marker = _MARKER.match(lines[i - 1]) if i else None
        if marker and marker["kind"] == "requires":
            block.requires = tuple(r.strip() for r in marker["value"].split(",") if r.strip())
        elif marker:
            block.fragment = marker["value"]
        found.append(block)
        i = end + 1
    return found


def _missing(requirement: str) -> str:
    """Why ``requirement`` is not met here ("" when it is)."""
    def cuda_device() -> str:
        from gpumem.backends import get_backend
        backend = get_backend("cuda")
        ok, reason = backend.availability()
        if not ok:
            return f"no CUDA ({reason})"
        return "" if backend.device_count() else "no CUDA device"

    if requirement == "cuda":
        return cuda_device()
    if requirement == "opencl":
        from gpumem.backends import get_backend
        backend = get_backend("opencl")
        ok, reason = backend.availability()
        if not ok:
            return f"no OpenCL ({reason})"
        return "" if backend.device_count() else "no OpenCL device"
    if requirement == "dask":
        return "" if importlib.util.find_spec("distributed") else "distributed is not installed"
    if requirement in ("cupy", "numba", "torch"):
        if importlib.util.find_spec(requirement) is None:
            return f"{requirement} is not installed"
        # the framework's own view: on the fake driver gpumem sees a device, they do not
        try:
            if requirement == "cupy":
                import cupy
                ok = cupy.cuda.runtime.getDeviceCount() > 0
            elif requirement == "numba":
                from numba import cuda
                ok = cuda.is_available()
            else:
                import torch
                ok = torch.cuda.is_available()
        except Exception as exc:        # a framework without a driver raises its own errors
            return f"{requirement} sees no CUDA device ({type(exc).__name__}: {exc})"
        return "" if ok else f"{requirement} sees no CUDA device"
    raise AssertionError(f"unknown requirement {requirement!r}; known: {REQUIREMENTS}")


def _pages() -> list[str]:
    return [p for p in PAGES if "```python" in (ROOT / p).read_text()]


@pytest.fixture
def scratch(tmp_path, monkeypatch, clean_registry):
    """A scratch working folder whose gpumem/data is the checkout's, two simulated 24 GiB GPUs
    (the default device), no GPUMEM_* setting from outside, and gpumem's process-wide state
    (shared managers, the OOM dump folder, warning filters) put back afterwards."""
    import gpumem_sim
    from gpumem.observe import history
    from gpumem.placement.shared import close_shared_managers
    for key in list(os.environ):
        if key.startswith("GPUMEM_") and key not in ("GPUMEM_TEST_BACKENDS",):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GPUMEM_DEVICE", "sim:0")     # also where a CUDA device is present
    (tmp_path / "gpumem").mkdir()
    (tmp_path / "gpumem" / "data").symlink_to(ROOT / "gpumem" / "data")
    monkeypatch.chdir(tmp_path)
    gpumem_sim.install(gpumem_sim.SimDevice("24GiB"), gpumem_sim.SimDevice("24GiB"))
    close_shared_managers()
    dump = (history._dump_dir, history._dump_set)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()        # as a user's script: not the suite's filters
            warnings.simplefilter("default")
            yield tmp_path
    finally:
        history._dump_dir, history._dump_set = dump
        close_shared_managers()


@pytest.mark.parametrize("page", _pages())
def test_page_examples_run(page, scratch):
    """Each example of the page runs without an error, in order, on simulated GPUs; a block
    that needs hardware or a framework this machine lacks is skipped only for that reason."""
    require_checkout(page)
    blocks = blocks_of(page, (ROOT / page).read_text())
    namespace = {"__name__": "__main__"}
    skipped = []
    for block in blocks:
        compiled = compile(block.code, block.where(), "exec")
        if block.fragment:
            continue
        missing = [why for why in dict.fromkeys(map(_missing, block.requires)) if why]
        if missing:
            skipped.append(f"{block.where()}: {'; '.join(missing)}")
            continue
        try:
            with contextlib.redirect_stdout(_Sink()):
                exec(compiled, namespace)
        except Exception as exc:
            raise AssertionError(f"the example at {block.where()} fails: "
                                 f"{type(exc).__name__}: {exc}") from exc
    if skipped:
        pytest.skip("examples not run here: " + " | ".join(skipped))


class _Sink:
    """stdout of the examples: kept out of the test's output."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def test_markers_are_few_and_known():
    """A marker names only known requirements, every fragment says why, and fragments stay
    few (an example a reader cannot run is one the docs should fix)."""
    require_checkout("docs/")
    fragments = []
    for page in PAGES:
        for block in blocks_of(page, (ROOT / page).read_text()):
            assert set(block.requires) <= set(REQUIREMENTS), (block.where(), block.requires)
            if block.fragment:
                assert len(block.fragment) > 10, f"{block.where()}: say why it is a fragment"
                fragments.append(block.where())
    assert len(fragments) <= 3, fragments


def test_extraction_sees_markers_and_indented_blocks():
    """The extractor finds an indented block (in a list item), dedents it, and reads the
    marker on the line before a fence, nothing further away."""
    text = ("text\n<!-- requires: torch, cuda -->\n```python\nimport torch\n```\n"
            "- item:\n  <!-- fragment: needs a client from a cluster -->\n  ```python\n"
            "  client.close()\n  ```\n<!-- requires: cuda -->\n\n```python\nx = 1\n```\n")
    a, b, c = blocks_of("page.md", text)
    assert (a.requires, a.fragment, a.code, a.line) == (("torch", "cuda"), "", "import torch", 3)
    assert (b.requires, b.fragment, b.code) == ((), "needs a client from a cluster",
                                                 "client.close()")
    assert (c.requires, c.fragment) == ((), "")
