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


def top_level_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for each import that runs when ``path`` is imported."""
    src = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":     # Cython: module-level lines only (no indentation)
        out = []
        for line in src.splitlines():
            m = _CY_IMPORT.match(line)
            if m and m.group(1):
                names = [n.strip().split(" as ")[0] for n in m.group(2).strip("()").split(",")]
                out.append((m.group(1), names))
            elif m:
                out.append((m.group(3), []))
        return out
    out = []
    for node in ast.parse(src).body:
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = all_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for target, names in top_level_imports(path):
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
