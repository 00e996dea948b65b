"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`).

- Before the build, gpumem's compiled (Cython) modules are imported: mkdocstrings' loader
  (griffe) reads a compiled module by importing it with ``sys.path`` narrowed to the checkout,
  where a standard-library module not yet loaded cannot be found; it then falls back to the
  module's ``.pyi`` stub, which has signatures but no docstrings. Imported here first, every
  compiled class is read the same way (docstrings from the module, signatures from its stub),
  whatever order the file system lists the files in.
- gpumem's docstrings use Sphinx roles (:class:`gpumem.MemoryManager`, :meth:`~a.B.c`), which
  would show as text before the code; the page shows the code alone, as Sphinx would (a leading
  ``~`` keeps the last dotted part).
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|data|mod|exc|obj|const|ref|envvar):"
                   r"<code>(?P<target>[^<]*)</code>")


def compiled_modules(root: Path = ROOT) -> list[str]:
    """The dotted names of the compiled modules built in place in the checkout."""
    names = []
    for package in ("gpumem", "gpumem_sim"):
        for so in sorted((root / package).rglob("*.so")):
            rel = so.relative_to(root)
            names.append(".".join(rel.parent.parts + (so.name.split(".")[0],)))
    return names


def import_compiled_modules(root: Path = ROOT) -> None:
    """Import every compiled module of the checkout; none built is an error (the reference
    would lose the docstrings of Buffer, CachingPool and MemoryManager's core methods)."""
    names = compiled_modules(root)
    if not names:
        raise RuntimeError("gpumem's Cython modules are not built: run `bash ci/docs.sh` (or "
                           "`python setup.py build_ext --inplace`) first")
    for name in names:
        importlib.import_module(name)


def on_startup(**_: object) -> None:
    """Import the compiled modules once, before mkdocstrings reads them."""
    import_compiled_modules()


def _code(match: re.Match) -> str:
    target = match["target"]
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"<code>{target}</code>"


def on_page_content(html: str, **_: object) -> str:
    """The page's HTML with every Sphinx role reduced to its code."""
    return _ROLE.sub(_code, html)
