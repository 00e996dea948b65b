"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`).

- Before the build, gpumem's compiled (Cython) modules are imported: mkdocstrings' loader
  (griffe) reads a compiled module by importing it with ``sys.path`` narrowed to the checkout,
  where a standard-library module not yet loaded cannot be found; it then falls back to the
  module's ``.pyi`` stub, which has signatures but no docstrings. Imported here first, every
  compiled class is read the same way (docstrings from the module, signatures from its stub),
  whatever order the file system lists the files in.
- Doctest lines in a docstring (``>>> ...`` with their output) are shown as a code block, not
  as nested quotes (``DoctestAsCode``, a griffe extension named in mkdocs.yml).
- gpumem's docstrings use Sphinx roles (:class:`gpumem.MemoryManager`, :meth:`~a.B.c`), which
  would show as text before the code; the page shows the code alone, as Sphinx would (a leading
  ``~`` keeps the last dotted part).
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

try:
    import griffe
except ImportError:         # the tests read compiled_modules() and fence_doctests() without it
    griffe = None

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


def fence_doctests(text: str) -> str:
    """``text`` with each run of doctest lines (a ``>>>`` line, then its ``...`` lines and its
    output, up to a blank line) put in a ```` ```pycon ```` fence."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith(">>>"):
            out.append(lines[i])
            i += 1
            continue
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        end = i
        while end < len(lines) and lines[end].strip():
            end += 1
        out += [f"{indent}```pycon", *lines[i:end], f"{indent}```"]
        i = end
    return "\n".join(out)


if griffe is not None:
    class DoctestAsCode(griffe.Extension):
        """Every docstring's doctest lines as a code block (see ``fence_doctests``)."""

        def on_object(self, *, obj: griffe.Object, **_: object) -> None:
            if obj.docstring and ">>>" in obj.docstring.value:
                obj.docstring.value = fence_doctests(obj.docstring.value)
