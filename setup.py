"""Build gpumem (distribution gpumem-pool): the Cython core (C++ for std::atomic) plus the pure-Python packages.

The CUDA fast path (gpumem/backends/_cuda_native.pyx, cuda.bindings.cydriver calls without the
GIL) is built only where cuda.h and cuda-python's .pxd files are both found at build time;
GPUMEM_BUILD_CUDA=0 skips it, =1 makes its absence an error. Without it the CUDA backend uses
the Python-level cuda.bindings.driver, with the same behaviour.

The .pyx files are cythonized when the extensions are built (build_ext), not whenever this file
runs: an sdist lists the .pyx sources themselves (MANIFEST.in says what else ships) and making
one runs no Cython. The generated C++ is not shipped: Cython is a build requirement anyway.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

extra = ["-O3", "-std=c++17"] if os.name != "nt" else ["/O2", "/std:c++17"]


def cuda_include_dir() -> str | None:
    """The CUDA toolkit's include directory holding cuda.h (CUDA_HOME, CUDA_PATH, or the
    usual install place), or None."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda.h").is_file():
            return str(Path(root) / "include")
    return None


def cuda_native_extension() -> list[Extension]:
    wanted = os.environ.get("GPUMEM_BUILD_CUDA", "auto").lower()
    if wanted in ("0", "no", "false", "off"):
        return []
    include = cuda_include_dir()
    spec = importlib.util.find_spec("cuda.bindings") if importlib.util.find_spec("cuda") else None
    has_pxd = spec is not None and any(
        (Path(p) / "cydriver.pxd").is_file() for p in spec.submodule_search_locations or ())
    if include is None or not has_pxd:
        if wanted in ("1", "yes", "true", "on"):
            raise SystemExit("GPUMEM_BUILD_CUDA=1 but "
                             + ("cuda.h was not found (set CUDA_HOME)" if include is None
                                else "cuda-python (cuda.bindings) is not installed"))
        return []
    ext = Extension("gpumem.backends._cuda_native", ["gpumem/backends/_cuda_native.pyx"],
                    language="c++", include_dirs=[include], extra_compile_args=extra)
    from Cython.Build import cythonize
    try:
        built = cythonize([ext], compiler_directives=DIRECTIVES, quiet=True)
    except Exception as exc:
        if wanted != "auto":
            raise
        print(f"warning: gpumem's CUDA fast path is not built ({exc}); the CUDA backend will "
              f"use cuda.bindings.driver")
        return []
    for e in built:
        # A C compile error (typically a cuda-python whose .pxd needs newer CUDA headers than
        # the ones found) skips the module with a warning. cythonize drops this flag: set here.
        e.optional = wanted == "auto"
    return built


DIRECTIVES = {"language_level": "3"}

#: the compiled modules: add an Extension here (C++ for std::atomic). Packages, data files and
#: metadata live in pyproject.toml.
EXTENSIONS = [
    Extension(f"gpumem._core.{name}", [f"gpumem/_core/{name}.pyx"], language="c++",
              extra_compile_args=extra)
    for name in ("pool", "pool_segments", "pool_inspect", "pool_history", "pool_pages",
                 "manager_base", "buffer", "manager_core", "dlpack", "view", "native_cache")
]
# The C allocator torch loads with CUDAPluggableAllocator (gpumem.integrations.torch): an
# ordinary extension whose two `cdef public` functions are exported with C linkage (Cython
# gives public functions C++ linkage in a C++ module unless CYTHON_EXTERN_C says otherwise).
EXTENSIONS.append(Extension(
    "gpumem.integrations._torch_alloc", ["gpumem/integrations/_torch_alloc.pyx"],
    language="c++", extra_compile_args=extra, define_macros=[("CYTHON_EXTERN_C", 'extern "C"')]))
# CuPy's allocator hot path (gpumem.integrations.cupy): it knows no CuPy type at compile time,
# so it builds and imports where CuPy is absent.
EXTENSIONS.append(Extension(
    "gpumem.integrations._cupy_alloc", ["gpumem/integrations/_cupy_alloc.pyx"],
    language="c++", extra_compile_args=extra))


class CythonizingBuildExt(build_ext):
    """build_ext that cythonizes first (and adds the CUDA fast path where it can be built)."""

    def finalize_options(self) -> None:
        from Cython.Build import cythonize
        self.distribution.ext_modules = (
            cythonize(EXTENSIONS, compiler_directives=DIRECTIVES, quiet=True)
            + cuda_native_extension())
        super().finalize_options()
        if self.parallel is None:
            # pip and `python -m build` give no -j: compile the modules on every core
            self.parallel = os.cpu_count() or 1


setup(
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": CythonizingBuildExt},
    zip_safe=False,
)
