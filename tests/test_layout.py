"""The package layout stays readable: no import cycle between gpumem's modules, and only the
ground floor lives flat in gpumem/ (docs/architecture.md). Level: real (reads the source).

Imports are read from the source: a module-level ``import``/``from ... import`` of a gpumem
module is an edge; imports inside functions (lazy, by design) and under ``if TYPE_CHECKING:``
are not, because they do not run when the module is imported.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Protocol

import gpumem

PKG = Path(gpumem.__file__).resolve().parent
#: the ground floor every layer uses; anything else belongs in a package
GROUND_FLOOR = {"__init__", "__main__", "config", "errors", "units", "stats", "logging_setup",
                "buffer_protocol"}
MAX_FLAT = 8     # "a handful": the ground floor above, with no room for more


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    found = {}
    for path in PKG.rglob("*"):
        if path.suffix in (".py", ".pyx") and "__pycache__" not in path.parts:
            found[module_name(path)] = path
    return found


_CY_IMPORT = re.compile(r"^(?:from\s+(gpumem[\w.]*)\s+(?:c?import)\s+(.+)|import\s+(gpumem[\w.]*))")
_CY_ANY_IMPORT = re.compile(r"^\s*(?:from\s+(gpumem[\w.]*)\s+(?:c?import)\s+(.+)|"
                            r"import\s+(gpumem[\w.]*))")


def imports(path: Path, *, everywhere: bool = False) -> list[tuple[str, list[str]]]:
    """(module, names) for each import that runs when ``path`` is imported (module level); with
    ``everywhere``, also those inside functions (lazy) and under ``if TYPE_CHECKING:``, which a
    reader or a type checker follows too."""
    src = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":     # Cython: module-level lines are those without indentation
        pattern = _CY_ANY_IMPORT if everywhere else _CY_IMPORT
        out = []
        for line in src.splitlines():
            m = pattern.match(line)
            if m and m.group(1):
                names = [n.strip().split(" as ")[0] for n in m.group(2).strip("()").split(",")]
                out.append((m.group(1), names))
            elif m:
                out.append((m.group(3), []))
        return out
    tree = ast.parse(src)
    out = []
    for node in (ast.walk(tree) if everywhere else tree.body):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = all_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for target, names in imports(path):
            if not target.startswith("gpumem") or target.split(".")[0] != "gpumem":
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
            for dest in subs or ([target] if target in mods else []):
                if dest != mod:
                    graph[mod].add(dest)
            # importing a submodule runs its parent packages' __init__ first
            parent = target.rsplit(".", 1)[0] if "." in target else None
            while parent and parent != mod and not mod.startswith(parent + "."):
                if parent in mods:
                    graph[mod].add(parent)
                parent = parent.rsplit(".", 1)[0] if "." in parent else None
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_between_gpumem_modules():
    """A cycle makes import order matter and a layer depend on the one above it."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    """The cycle finder itself works (so the test above can fail)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# --- circles through every import, lazy and type-only included (issue 33) --------------------


def full_import_graph() -> dict[str, set[str]]:
    """module -> the gpumem modules it names in any import (see :func:`imports` with ``everywhere``)."""
    mods = all_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for target, names in imports(path, everywhere=True):
            if target.split(".")[0] != "gpumem":
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
            graph[mod] |= {d for d in subs or ([target] if target in mods else []) if d != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles: strongly connected sets of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.add(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str, mods: dict[str, Path] | None = None) -> str:
    """The package a module belongs to (a package's __init__ belongs to the package itself)."""
    mods = all_modules() if mods is None else mods
    path = mods.get(module)
    if path is not None and path.stem == "__init__":
        return module
    return module.rsplit(".", 1)[0] if "." in module else module


def test_no_import_circle_across_packages():
    """Counting every import (lazy and type-only too), no circle joins modules of two packages:
    a package can be read, and reworked, without the ones it serves."""
    mods = all_modules()
    across = [sorted(group) for group in circles(full_import_graph())
              if len({package_of(m, mods) for m in group}) > 1]
    assert not across, "import circles across packages: " + "; ".join(map(str, across))


MANAGER = "gpumem.manager.memory_manager"


def test_no_part_imports_the_manager_back():
    """The manager's parts and readers depend on Protocols (gpumem.manager.interfaces, or one
    declared beside them), never on memory_manager.py, even under TYPE_CHECKING; so no circle
    runs through it."""
    graph = full_import_graph()
    back = sorted(m for m, dests in graph.items()
                  if MANAGER in dests and m.startswith("gpumem.manager."))
    assert not back, f"manager parts import {MANAGER}: {back}"
    through = [sorted(g) for g in circles(graph) if MANAGER in g]
    assert not through, f"import circles through {MANAGER}: {through}"


def test_the_circle_finder_finds_circles(tmp_path):
    """circles() and package_of() themselves work (so the two tests above can fail)."""
    graph = {"gpumem.a.x": {"gpumem.b.y"}, "gpumem.b.y": {"gpumem.a.z"},
             "gpumem.a.z": {"gpumem.a.x"}, "gpumem.c": {"gpumem.a.x"}}
    assert circles(graph) == [{"gpumem.a.x", "gpumem.b.y", "gpumem.a.z"}]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert package_of("gpumem.manager.memory_manager") == "gpumem.manager"
    assert package_of("gpumem.manager") == "gpumem.manager"
    assert package_of("gpumem.config") == "gpumem"
    src = "if TYPE_CHECKING:\n    from gpumem.manager.memory_manager import MemoryManager\n" \
          "def f():\n    import gpumem.observe.summary\n"
    probe = tmp_path / "probe.py"
    probe.write_text(src, encoding="utf-8")
    assert imports(probe, everywhere=True) == [("gpumem.manager.memory_manager", ["MemoryManager"]),
                                   ("gpumem.observe.summary", [])]


class _EmptyProtocol(Protocol):
    """The members every Protocol class has (machinery, not an interface's)."""


def test_the_manager_implements_its_interfaces(make_manager):
    """Every member a Protocol of gpumem.manager.interfaces (and the peers registry's Peer)
    names exists on a real MemoryManager (FallbackLedger: on its miss path; the pressure
    watch's CacheRelease: on its segment growth), so the Protocols describe what runs."""
    import inspect

    from gpumem.manager import interfaces
    from gpumem.manager.pressure import CacheRelease
    from gpumem.placement.peers import Peer
    mm = make_manager()
    implementers = {interfaces.FallbackLedger: mm._miss, CacheRelease: mm._growth}
    protocols = [c for _, c in inspect.getmembers(interfaces, inspect.isclass)
                 if c.__module__ == interfaces.__name__] + [Peer, CacheRelease]
    for proto in protocols:
        target = implementers.get(proto, mm)
        for klass in proto.__mro__:
            if klass.__module__ not in (interfaces.__name__, "gpumem.placement.peers",
                                        "gpumem.manager.pressure"):
                continue
            names = set(getattr(klass, "__annotations__", {})) | set(vars(klass))
            for name in names - set(vars(_EmptyProtocol)) - {"__annotations__"}:
                assert hasattr(target, name), f"{proto.__name__}.{name} is not on {target!r}"


def test_only_the_ground_floor_is_flat():
    """Everything but config, errors, units, stats, logging and the buffer protocol lives in
    a package named for its responsibility."""
    flat = {p.stem for p in PKG.glob("*.py")}
    assert len(flat) <= MAX_FLAT, sorted(flat)
    assert flat <= GROUND_FLOOR, f"flat modules outside the ground floor: {sorted(flat - GROUND_FLOOR)}"


def test_every_public_name_imports():
    """Moving modules kept every name users import from gpumem itself."""
    for name in gpumem.__all__:
        assert getattr(gpumem, name) is not None, name


# --- what may import what (docs/architecture.md) --------------------------------------------------
#: a module may import, when it is imported, only modules of its own layer or below; the longest
#: matching prefix gives a module's layer
LAYERS = {
    "gpumem.errors": 0, "gpumem.units": 0, "gpumem.config": 0, "gpumem.stats": 0,
    "gpumem.logging_setup": 0,
    "gpumem.backends": 1, "gpumem.backends.base": 1,      # the registry and the protocol
    "gpumem._core": 2,
    "gpumem.backends.": 3,                                # the backend modules themselves
    "gpumem.buffer_protocol": 4, "gpumem.placement.peers": 4,
    "gpumem.manager": 5, "gpumem.planning": 5,
    "gpumem.observe": 6, "gpumem.placement": 6,
    "gpumem.integrations": 7, "gpumem.dask": 7, "gpumem.testing": 7, "gpumem.cli": 7,
    "gpumem": 7, "gpumem.__main__": 7,
}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p if p.endswith(".")
                                                                        else p + ".")),
               key=len)
    return LAYERS[best]


def test_layers_import_only_downwards():
    """The layers of docs/architecture.md: ground floor < backend protocol and registry <
    _core < backend modules < buffer protocol, peers < manager, planning < observe, placement
    < integrations, dask, testing, cli. An import that runs at import time never goes up."""
    up = [f"{mod} ({layer(mod)}) imports {dest} ({layer(dest)})"
          for mod, dests in import_graph().items() for dest in dests
          if layer(dest) > layer(mod)]
    assert not up, "imports up the layers:\n" + "\n".join(sorted(up))


def test_every_module_has_a_layer():
    """A new package gets its row in LAYERS (and a line in docs/architecture.md)."""
    for mod in all_modules():
        layer(mod)          # raises ValueError (max of nothing) for a module of no layer


# --- backend names stay inside gpumem/backends ---------------------------------------------------
_NAME_TEST = re.compile(r"""\.backend\s*(==|!=|\bin\b|\bnot in\b)|(\bbackend|device_string)\s*"""
                        r"""(==|!=)\s*["'](cuda|opencl|sim|cpu)["']|\.startswith\(["'](cuda|"""
                        r"""opencl|sim|cpu):""")


def test_no_backend_name_is_tested_outside_backends():
    """What the core, placement, views and bridges need of a device they read from its
    declarations (kind, DLPack type, pinned segments...): no module outside gpumem/backends
    compares a device's backend name or device string with a backend's name."""
    found = []
    for mod, path in all_modules().items():
        if mod == "gpumem.backends" or mod.startswith("gpumem.backends."):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _NAME_TEST.search(line.split("#")[0]):
                found.append(f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert not found, "backend names tested outside backends/:\n" + "\n".join(found)


def test_the_name_check_finds_a_name_test():
    """The pattern above matches what it must."""
    for line in ('if device.backend == "cuda":', "if dev.backend in _GPU:",
                 'if backend != "cuda":',
                 'return mm.device_string == "cpu"', 'if not name.startswith("sim:"):'):
        assert _NAME_TEST.search(line), line
    assert not _NAME_TEST.search('location = "cpu" if kind is HOST else "device"')
