"""Build a tiny Cython extension against gpumem's public .pxd files at test time, as downstream
code would (numpy's test_extending does the same for numpy.random); shared by the tests that
reach the pool's C API (tests/core/test_cython_api.py, test_pool_findings.py,
test_nogil_stress.py).

The build honours CFLAGS and LDFLAGS (setuptools reads them), so under ci/sanitize.sh the test
extension is instrumented like gpumem itself; -pthread lets a test module start C threads.
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

__all__ = ["REPO_ROOT", "build_extension"]

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


def build_extension(directory: Path, pyx: str, name: str = "gm_downstream") -> ModuleType:
    """Compile ``pyx`` as module ``name`` in ``directory`` (C++17; cimports resolve against
    the .pxd files of the gpumem under test: the checkout's, or an installed wheel's) and
    import it; skips on Windows, fails with the compiler's output."""
    if os.name == "nt":
        pytest.skip("the test build uses a Unix C++ compiler flag")
    (directory / f"{name}.pyx").write_text(pyx)
    (directory / "setup.py").write_text(SETUP)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "setup.py", str(REPO_ROOT), name, "build_ext",
                           "--inplace"], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (f"building the test extension {name} failed:\n"
                                  f"{proc.stdout}\n{proc.stderr}")
    (so,) = [p for p in directory.iterdir() if p.name.startswith(name + ".") and
             p.suffix in (".so", ".pyd")]
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
