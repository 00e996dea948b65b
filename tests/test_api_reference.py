"""The API reference of the documentation site (docs/reference/, built by ci/docs.sh with
`mkdocs build --strict`) has an entry for every public name of gpumem (``gpumem.__all__``),
and each entry has a docstring (issue 41).

Level: **real**: reads docs/reference/*.md and gpumem's objects; where griffe is installed (the
``docs`` extra, which ci/docs.sh installs and then runs this file), reads them as the site's
builder does, compiled Cython classes and module data included.
"""
from __future__ import annotations

import importlib.util
import inspect
import re
import types
from pathlib import Path

import pytest

import gpumem
from invariants import require_checkout

_ENTRY = re.compile(r"^::: (?P<path>[\w.]+)\s*$", re.M)


def reference_entries(root: Path) -> dict[str, str]:
    """Each ``::: dotted.path`` directive of docs/reference/*.md -> the page it is on."""
    entries = {}
    for page in sorted((root / "docs" / "reference").glob("*.md")):
        for m in _ENTRY.finditer(page.read_text()):
            entries[m["path"]] = page.name
    return entries


def accepted_paths(name: str) -> set[str]:
    """The identifiers under which the reference may list ``gpumem.<name>``: that, or where
    the object is defined (a lazily loaded name is documented at its module)."""
    obj = getattr(gpumem, name)
    paths = {f"gpumem.{name}"}
    if isinstance(obj, types.ModuleType):
        paths.add(obj.__name__)
    elif getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
        paths.add(f"{obj.__module__}.{obj.__qualname__}")
    if name in getattr(gpumem, "_LAZY", {}):
        module, attr = gpumem._LAZY[name]
        paths.add(module if attr is None else f"{module}.{attr}")
    return paths


def test_every_public_name_has_a_reference_entry():
    """Each name of gpumem.__all__ has a `::: ...` entry on a page of docs/reference/ (a name
    added to __all__ without one fails here, with where to add it)."""
    root = require_checkout("docs/reference/")
    entries = reference_entries(root)
    missing = [n for n in gpumem.__all__ if not accepted_paths(n) & set(entries)]
    assert not missing, (f"public names with no entry in docs/reference/*.md: {missing}; add "
                         f"a line `::: gpumem.<name>` to the page of its area")


def test_every_public_name_has_a_docstring():
    """Each public class, function and module of gpumem says what it is (the reference shows
    the docstring); data such as MODEL_PRESETS is checked through griffe below."""
    empty = []
    for name in gpumem.__all__:
        obj = getattr(gpumem, name)
        if inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, types.ModuleType):
            doc = obj.__doc__ or ""
            if not doc.strip():
                empty.append(name)
    assert not empty, f"public names without a docstring: {empty}"


def _load_hooks(root: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gpumem_mkdocs_hooks",
                                                  root / "ci" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_shows_a_docstring_for_every_entry():
    """Read by griffe, as mkdocstrings builds the site, every entry of the reference resolves
    and has a non-empty docstring: the compiled Buffer and CachingPool and the module-level
    MODEL_PRESETS included. Skipped without griffe (the docs extra; ci/docs.sh runs it)."""
    root = require_checkout("docs/reference/ and ci/mkdocs_hooks.py")
    griffe = pytest.importorskip("griffe")
    _load_hooks(root).import_compiled_modules(root)
    package = griffe.load("gpumem", search_paths=[str(root)], allow_inspection=True)
    bare = []
    for path, page in reference_entries(root).items():
        assert path.startswith("gpumem."), (page, path)
        obj = package[path[len("gpumem."):]]
        docstring = obj.docstring.value.strip() if obj.docstring else ""
        if not docstring:
            bare.append(f"{page}: {path}")
    assert not bare, f"reference entries the site would show without a docstring: {bare}"


def test_compiled_modules_are_found_by_name():
    """The site's hook names each built Cython module by its import path (the pool, the
    buffer), so that it can import them before griffe reads them."""
    root = require_checkout("ci/mkdocs_hooks.py")
    names = _load_hooks(root).compiled_modules(root)
    if not names:
        pytest.skip("the Cython modules are not built in place in this checkout")
    assert {"gpumem._core.pool", "gpumem._core.buffer"} <= set(names), names


def test_doctest_lines_become_a_code_block():
    """On the site a docstring's doctest (``>>>`` lines, ``...`` lines, output) is one code
    block, up to the blank line after it; the prose around it stays prose. Real (the hook)."""
    root = require_checkout("ci/mkdocs_hooks.py")
    fence = _load_hooks(root).fence_doctests
    text = ("Allocates memory.\n\n    >>> mm = f()\n    >>> with g() as b:\n    ...     b.n\n"
            "    1048576\n\nMore prose.")
    assert fence(text) == ("Allocates memory.\n\n    ```pycon\n    >>> mm = f()\n"
                           "    >>> with g() as b:\n    ...     b.n\n    1048576\n    ```\n\n"
                           "More prose.")
    assert fence("no examples here") == "no examples here"
