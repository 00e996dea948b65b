"""Build and load ``_cbench`` (C-level pool benchmarks) at benchmark time.

``_cbench.pyx`` is cythonized as C++ with the repo root on the include path, so its
``from gpumem._core.pool cimport ...`` resolves against the very .pxd downstream code uses; the
built module calls gm_alloc/gm_free through the function pointers that ``gpumem._core.pool``
exports. The build goes to a cache directory outside the repo (``$TMPDIR/gpumem_cbench_<hash>``,
keyed by the .pyx, the .pxd files, Python and Cython versions), so repeated runs do not rebuild.

    python asv_benchmarks/build_cbench.py          # build (or find) and print the module path
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PYX = HERE / "_cbench.pyx"
PXD = REPO / "gpumem" / "_core" / "pool.pxd"
LAYOUT = REPO / "gpumem" / "_core" / "pool_layout.pxd"    # the structures pool.pxd re-exports
MODULE = "_cbench"

_loaded = None


def _key() -> str:
    import Cython
    h = hashlib.sha256()
    for path in (PYX, PXD, LAYOUT):
        h.update(path.read_bytes())
    h.update(sys.version.encode())
    h.update(Cython.__version__.encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    return Path(os.environ.get("GPUMEM_CBENCH_DIR")
                or Path(tempfile.gettempdir()) / f"gpumem_cbench_{_key()}")


def build(force: bool = False, quiet: bool = True) -> Path:
    """Compile _cbench if needed; the path of the extension module."""
    out_dir = build_dir()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = out_dir / f"{MODULE}{suffix}"
    if target.exists() and not force:
        return target
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build_", dir=out_dir))
    try:
        src = work / PYX.name
        shutil.copyfile(PYX, src)
        extra = ["-O3", "-std=c++17"] if os.name != "nt" else ["/O2", "/std:c++17"]
        ext = Extension(MODULE, [str(src)], language="c++", extra_compile_args=extra)
        exts = cythonize([ext], include_path=[str(REPO)], quiet=quiet,
                         compiler_directives={"language_level": "3"})
        dist = Distribution({"name": MODULE, "ext_modules": exts})
        cmd = dist.get_command_obj("build_ext")
        cmd.build_lib = str(work / "lib")
        cmd.build_temp = str(work / "tmp")
        cmd.inplace = False
        cmd.ensure_finalized()
        cmd.run()
        built = next((work / "lib").glob(f"{MODULE}*{suffix}"))
        os.replace(built, target)        # atomic: concurrent builders never see half a file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def load(force: bool = False, quiet: bool = True):
    """Build if needed and import the _cbench module (gpumem must be importable)."""
    global _loaded
    if _loaded is not None and not force:
        return _loaded
    if str(REPO) not in sys.path:
        try:
            import gpumem  # noqa: F401
        except ImportError:
            sys.path.insert(0, str(REPO))
    import gpumem._core.pool  # noqa: F401  (its C API must be loaded first)
    path = build(force=force, quiet=quiet)
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    _loaded = mod
    return mod


if __name__ == "__main__":
    force = "--force" in sys.argv
    print(build(force=force, quiet=False))
