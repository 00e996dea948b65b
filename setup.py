"""Build gpumem: the Cython core (C++ for std::atomic) plus the pure-Python packages."""
import os

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

extra = ["-O3", "-std=c++17"] if os.name != "nt" else ["/O2", "/std:c++17"]

extensions = [
    Extension(f"gpumem._core.{name}", [f"gpumem/_core/{name}.pyx"], language="c++",
              extra_compile_args=extra)
    for name in ("pool", "buffer")
]

setup(
    packages=find_packages(include=["gpumem", "gpumem.*", "gpumem_sim", "gpumem_sim.*"]),
    package_data={"gpumem._core": ["*.pxd", "*.pyi"], "gpumem": ["data/*.csv.gz", "py.typed"]},
    ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"},
                          annotate=False),
    zip_safe=False,
)
