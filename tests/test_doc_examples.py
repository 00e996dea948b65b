"""Every Python example in README.md and docs/**/*.md runs as written, pasted alone into a
fresh interpreter (docs/testing.md, "The documentation's examples").

Each ```python block runs by itself in a new ``python`` process, as a reader who pastes it
would: no earlier block's names, no ``GPUMEM_*`` setting (the suite's own included), no
simulated device installed unless the block installs one, the warning filters a script gets, in
a scratch folder where ``gpumem/data`` is the checkout's. So a block names its own device: on a
machine without a GPU, ``"sim:0"`` or ``"sim:24GiB"`` (a simulated card), with ``"cuda:0"`` in a
comment.

What a block needs comes from its code: an import of ``torch``, ``cupy``, ``numba``,
``pyopencl``, ``distributed``/``dask`` (or of gpumem's bridge to one of them), or a device
string ``"cuda:N"``/``"opencl:N"``, adds that requirement. A marker on the line before the
fence adds more, or says the block is not meant to run:

- ``<!-- requires: cuda, torch -->``: the block runs only where each of these is there
  (``cuda``: a CUDA device gpumem can open; ``opencl``: an OpenCL device; ``cupy``, ``numba``,
  ``torch``: the framework with a CUDA device; ``dask``: ``distributed``); elsewhere it is
  reported as skipped, with what was missing.
- ``<!-- fragment: why -->``: the block is not meant to run alone (it needs a cluster's client,
  or it is a test module that another test runs); it is only compiled. Keep these few.

Level: **real** (the documented code in a new interpreter on gpumem_sim devices; OpenCL blocks
on PoCL where CI has it; CUDA blocks on the fake driver in ci/test.sh's fake-driver passes).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from invariants import TEST_SEGMENTS, require_checkout

ROOT = Path(__file__).resolve().parent.parent
#: none outside a checkout (ci/package.sh runs tests/ against an installed wheel)
PAGES = (["README.md"] + sorted(p.relative_to(ROOT).as_posix()
                                for p in (ROOT / "docs").rglob("*.md"))
         if (ROOT / "README.md").is_file() else [])
REQUIREMENTS = ("cuda", "opencl", "cupy", "numba", "torch", "dask")
#: a block's imports -> what it needs (the first dotted prefix that matches)
IMPORT_NEEDS = {
    "torch": "torch", "cupy": "cupy", "numba": "numba", "pyopencl": "opencl",
    "distributed": "dask", "dask": "dask",
    "gpumem.integrations.torch": "torch", "gpumem.integrations.cupy": "cupy",
    "gpumem.integrations.numba": "numba", "gpumem.integrations.pyopencl": "opencl",
    "gpumem.dask": "dask",
}
_DEVICE_NEEDS = re.compile(r"^(?P<backend>cuda|opencl):\d+$")
#: a pasted example gets a minute or two even on a loaded 2-core machine (Dask's cluster)
TIMEOUT_S = 600

_FENCE = re.compile(r"^(?P<indent>[ ]*)```python[ ]*$")
_MARKER = re.compile(r"^[ ]*<!--\s*(?P<kind>requires|fragment):\s*(?P<value>.*?)\s*-->[ ]*$")


@dataclass
class Block:
    page: str
    line: int                       # of the opening fence, 1-based
    code: str
    marked: tuple[str, ...] = ()    # requirements its marker names
    fragment: str = ""              # why it does not run alone ("": it runs)

    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def requires(self) -> tuple[str, ...]:
        """What the block needs: its marker's requirements and those its code shows."""
        return tuple(dict.fromkeys(self.marked + needs_of(self.code)))


def needs_of(code: str) -> tuple[str, ...]:
    """The requirements a block's code shows: what its imports reach (a framework, or gpumem's
    bridge to one) and the devices it names ("cuda:0", "opencl:1"), in order of appearance."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ()                   # reported by the test that compiles every block
    needs = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _DEVICE_NEEDS.match(node.value.strip().lower())
            if m:
                needs.append(m["backend"])
        for module in modules:
            parts = module.split(".")
            for n in range(len(parts), 0, -1):
                need = IMPORT_NEEDS.get(".".join(parts[:n]))
                if need:
                    needs.append(need)
                    break
    return tuple(dict.fromkeys(needs))


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
            block.marked = tuple(r.strip() for r in marker["value"].split(",") if r.strip())
        elif marker:
            block.fragment = marker["value"]
        found.append(block)
        i = end + 1
    return found


@functools.cache
def _missing(requirement: str) -> str:
    """Why ``requirement`` is not met here ("" when it is)."""
    def device(backend_name: str, what: str) -> str:
        from gpumem.backends import get_backend
        backend = get_backend(backend_name)
        ok, reason = backend.availability()
        if not ok:
            return f"no {what} ({reason})"
        return "" if backend.device_count() else f"no {what} device"

    if requirement == "cuda":
        return device("cuda", "CUDA")
    if requirement == "opencl":
        return device("opencl", "OpenCL")
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


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks_of(page, (ROOT / page).read_text())]


def pasted_env() -> dict[str, str]:
    """The environment of a reader's new interpreter: this one's, without any GPUMEM_*
    setting (the suite's GPUMEM_TEST_* and a developer's own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}


def run_alone(code: str, folder: Path) -> subprocess.CompletedProcess:
    """Run ``code`` as a script in a new interpreter, in ``folder/work`` where gpumem/data is
    the checkout's (the examples read the shipped traces by that relative path)."""
    work = folder / "work"
    (work / "gpumem").mkdir(parents=True, exist_ok=True)
    data = work / "gpumem" / "data"
    if not data.is_symlink():
        # the gpumem under test's data: the checkout's, or the installed wheel's (ci/package.sh
        # runs the suite outside any checkout, where ROOT has no gpumem/data)
        spec = importlib.util.find_spec("gpumem")
        assert spec is not None and spec.origin is not None
        data.symlink_to(Path(spec.origin).parent / "data")
    script = folder / "example.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=work, env=pasted_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


_RUNNABLE = [b for b in _all_blocks() if not b.fragment]
#: a pass of the suite whose test configs use another segment policy (ci/test.sh's plain
#: passes): the examples, which see no GPUMEM_* setting, would run exactly as in the default one
_OTHER_SEGMENTS_PASS = TEST_SEGMENTS != "auto"


@pytest.mark.parametrize("block", _RUNNABLE, ids=[b.where() for b in _RUNNABLE])
def test_example_runs_pasted_alone(block, tmp_path):
    """The example runs without an error in a fresh interpreter, on its own (no other block's
    names, no GPUMEM_* setting); one that needs hardware or a framework this machine lacks is
    skipped only for that reason."""
    require_checkout(block.page)
    compile(block.code, block.where(), "exec")
    if _OTHER_SEGMENTS_PASS:
        pytest.skip(f"the examples see no GPUMEM_* setting: this pass (test segments "
                    f"{TEST_SEGMENTS!r}) would run them exactly as the default pass does")
    missing = [why for why in dict.fromkeys(map(_missing, block.requires)) if why]
    if missing:
        pytest.skip(f"{block.where()} needs {', '.join(block.requires)}: {'; '.join(missing)}")
    out = run_alone(block.code, tmp_path)
    assert out.returncode == 0, (
        f"the example at {block.where()} fails when pasted alone (exit {out.returncode}):\n"
        + "\n".join(out.stderr.strip().splitlines()[-15:]))


def test_fragments_compile():
    """The few blocks marked as fragments are valid Python at least."""
    require_checkout("docs/")
    for block in _all_blocks():
        if block.fragment:
            compile(block.code, block.where(), "exec")


def test_markers_are_few_and_known():
    """A marker names only known requirements, every fragment says why, and fragments stay
    few (an example a reader cannot run is one the docs should fix)."""
    require_checkout("docs/")
    fragments = []
    for block in _all_blocks():
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


def test_needs_come_from_the_code_not_only_from_markers():
    """An unmarked block that imports distributed (docs/dask.md's cluster once was one: it
    failed ci/sanitize.sh, whose venv has no Dask), a framework, gpumem's bridge to one, or
    names a CUDA or OpenCL device, needs it; gpumem's own modules and sim devices need
    nothing. Real (the extractor)."""
    cases = {
        "from distributed import Client, LocalCluster": ("dask",),
        "import gpumem.dask": ("dask",),
        "import numpy as np\nimport pyopencl.array as cla": ("opencl",),
        "from gpumem.integrations import pyopencl as gm_cl": ("opencl",),
        "from gpumem.integrations.numba import GpumemNumbaManager": ("numba",),
        "from gpumem.integrations import torch as gm_torch\nimport torch": ("torch",),
        "import cupy": ("cupy",),
        "import gpumem\nmm = gpumem.MemoryManager('cuda:0')": ("cuda",),
        "import gpumem\nmm = gpumem.MemoryManager('OpenCL:1')": ("opencl",),
        "import gpumem\nmm = gpumem.MemoryManager('sim:0')  # 'cuda:0' on a GPU": (),
        "import gpumem.observe.replay\nfrom gpumem.integrations import torch_snapshot": (),
        "import gpumem_sim, numpy": (),
    }
    for code, needs in cases.items():
        assert needs_of(code) == needs, code
    marked = blocks_of("p.md", "<!-- requires: cuda -->\n```python\nimport torch\n```\n")[0]
    assert marked.requires == ("cuda", "torch")
    dask_page = blocks_of("docs/dask.md", (ROOT / "docs" / "dask.md").read_text()) \
        if (ROOT / "docs" / "dask.md").is_file() else []
    assert all("dask" in b.requires for b in dask_page if "distributed" in b.code)


def test_a_block_runs_without_the_names_of_the_one_before(tmp_path, monkeypatch):
    """Blocks do not share a namespace: a block that uses a name only an earlier block
    defined fails (NameError), as it does for a reader who pastes it alone; and no GPUMEM_*
    setting of the suite reaches the example. Real (a new interpreter)."""
    first, second = blocks_of("p.md", "```python\nx = 1\n```\n\n```python\nprint(x)\n```\n")
    assert run_alone(first.code, tmp_path).returncode == 0
    out = run_alone(second.code, tmp_path)
    assert out.returncode != 0 and "NameError" in out.stderr
    monkeypatch.setenv("GPUMEM_DEVICE", "sim:0")
    out = run_alone("import os; print(sorted(k for k in os.environ "
                    "if k.startswith('GPUMEM_')))", tmp_path)
    assert out.stdout.strip() == "[]"
