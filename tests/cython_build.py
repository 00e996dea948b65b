"""Compiling a small downstream Cython module against gpumem's public .pxd at test time (as
numpy's test_extending does), for tests that need C code calling the pool without the GIL.

The build honours CFLAGS and LDFLAGS (setuptools reads them), so under ci/sanitize.sh the test
module is instrumented like gpumem itself.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import gpumem

REPO_ROOT = Path(gpumem.__file__).resolve().parent.parent

SETUP = textwrap.dedent("""
    import sys
    from Cython.Build import cythonize
    from setuptools import Extension, setup

    root, name = sys.argv.pop(1), sys.argv.pop(1)
    ext = Extension(name, [name + ".pyx"], language="c++", include_dirs=[root],
                    extra_compile_args=["-std=c++17", "-O1", "-pthread"],
                    extra_link_args=["-pthread"])
    setup(name=name, ext_modules=cythonize(
        [ext], include_path=[root], compiler_directives={"language_level": "3"}, quiet=True))
""")


def build_module(folder: Path, name: str, pyx: str) -> ModuleType:
    """Compile ``pyx`` as module ``name`` in ``folder`` (C++17) and import it; skips on
    Windows (the flags are a Unix compiler's)."""
    if os.name == "nt":
        pytest.skip("the test build uses a Unix C++ compiler flag")
    (folder / f"{name}.pyx").write_text(pyx)
    (folder / "setup.py").write_text(SETUP)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "setup.py", str(REPO_ROOT), name, "build_ext",
                           "--inplace"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"building {name} failed:\n{proc.stdout}\n{proc.stderr}"
    (so,) = [p for p in folder.iterdir() if p.name.startswith(name + ".") and
             p.suffix in (".so", ".pyd")]
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
