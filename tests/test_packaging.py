"""Identity and first contact (issue 15 items 1, 8, 11, 12), all **real**: the distribution name,
licence and metadata of the installed package, install hints, the shipped traces, that
``import gpumem`` loads no framework, and that every public method says what it does."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import gpumem

REPO = Path(__file__).resolve().parents[1]
DIST = "gpumem-pool"


def test_distribution_name_licence_and_metadata():
    """The installed distribution is gpumem-pool (gpumem on PyPI is someone else's), under
    Apache-2.0 with the LICENSE file, and the import name stays gpumem."""
    meta = metadata.metadata(DIST)
    assert meta["Name"] == DIST
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert any(c.startswith("Programming Language :: Python :: 3")
               for c in meta.get_all("Classifier"))
    assert not meta.get_all("Project-URL")          # left out rather than invented
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert metadata.version(DIST) == gpumem.__version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST and project["license"] == "Apache-2.0"


def test_every_install_hint_names_the_distribution():
    """No message or doc tells users to `pip install gpumem[...]`, which would install the
    unrelated package; the hints that exist say gpumem-pool."""
    wrong = re.compile(r"pip install (\")?gpumem(\[|\s|$)")
    files = [*REPO.glob("gpumem/**/*.py"), *REPO.glob("gpumem/**/*.pyx"),
             *REPO.glob("docs/*.md"), REPO / "README.md", *REPO.glob("ci/*.sh")]
    offenders = [f"{f.relative_to(REPO)}:{i}" for f in files
                 for i, line in enumerate(f.read_text().splitlines(), 1) if wrong.search(line)]
    assert offenders == []
    from gpumem.backends.cuda import _INSTALL_HINT
    assert "pip install gpumem-pool[cuda]" in _INSTALL_HINT


def test_the_four_traces_ship_in_the_repository():
    """README's commands need no ../shared: the traces and their metadata are in
    gpumem/data/traces, and no doc, test or benchmark points at ../shared/traces."""
    d = REPO / "gpumem" / "data" / "traces"
    names = {"gpt2_train", "resnet50_train", "gpt2_generate", "bert_varlen_infer"}
    assert {p.name[:-len(".csv.gz")] for p in d.glob("*.csv.gz")} == names
    assert all((d / f"{n}.json").is_file() for n in names) and (d / "README.md").is_file()
    files = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("tests/*.py"),
             *REPO.glob("asv_benchmarks/**/*.py"), *REPO.glob("gpumem/*.py")]
    assert [f.name for f in files if "shared/traces" in f.read_text()
            and f.name != "test_packaging.py"] == []


def test_import_gpumem_loads_no_framework():
    """`import gpumem` (with the PyTorch bridge and training estimates reachable) imports no
    framework: torch, pyopencl, cupy, numba, distributed stay unloaded."""
    code = ("import sys, gpumem; gpumem.export_memory_viz; gpumem.estimate_training_memory; "
            "print(sorted(m for m in ('torch', 'pyopencl', 'cupy', 'numba', 'distributed', "
            "'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("cls", [gpumem.MemoryManager, gpumem.MemoryConfig,
                                 gpumem.FallbackBuffer, gpumem.MemoryEstimate])
def test_every_public_method_has_a_docstring(cls):
    """stats, pressure, reset_peak_stats, remove_observer... every public method or property
    of the main classes says what it does."""
    missing = []
    for name, obj in inspect.getmembers(cls):
        if name.startswith("_") or not (callable(obj) or isinstance(obj, property)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
    assert missing == []
