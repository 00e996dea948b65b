"""The manager is composed of parts that never keep it alive, and the parts talk through declared
interfaces. Level: real (sim) for the runtime checks; the static check reads the source.
"""
from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest

import gpumem
from gpumem import MemoryConfig, MemoryManager

MiB = 1 << 20
MANAGER_PKG = Path(gpumem.__file__).resolve().parent / "manager"


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_a_dropped_manager_returns_its_memory_at_once(sim_device, expandable):
    """A manager dropped without close() gives the device every byte back as soon as the last
    reference goes, with the cyclic GC off: its parts (growth, streams, miss path, expandable
    segments) hold it only weakly. (With expandable segments the manager used to sit in a
    reference cycle until a GC pass.)"""
    dev = sim_device("1GiB")
    mm = MemoryManager("sim:0", MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                                             cpu_fallback_enabled=False,
                                             track_allocations=False,
                                             expandable_segments=expandable))
    assert (mm.expandable_segments is not None) == expandable
    bufs = [mm.malloc(n) for n in (4096, 3 * MiB, 40 * MiB)]
    bufs[0].free()
    assert dev.mem_get_info()[0] < dev.capacity
    ref = weakref.ref(mm)
    gc.disable()
    try:
        del mm, bufs
        assert ref() is None, "something keeps the manager alive"
        assert dev.mem_get_info()[0] == dev.capacity
        assert dev.live_segments == 0 and dev.live_reservations == 0
    finally:
        gc.enable()


def test_a_busy_manager_releases_nothing_for_a_peer_and_never_waits(sim_device):
    """release_idle_cache() (what a peer out of memory calls) returns 0 at once while another
    thread is inside the manager's slow path, and releases the idle cache otherwise."""
    import threading
    sim_device("1GiB")
    mm = MemoryManager("sim:0", MemoryConfig(min_free_bytes=0, cpu_fallback_enabled=False,
                                             expandable_segments=False,
                                             release_before_grow=False))
    try:
        mm.malloc(8 * MiB).free()
        cached = mm.pool.reserved_bytes
        assert cached > 0
        held, go = threading.Event(), threading.Event()

        def occupy():
            with mm._slow:                         # a miss in progress on another thread
                held.set()
                go.wait(10)
        t = threading.Thread(target=occupy)
        t.start()
        held.wait(10)
        try:
            assert mm.release_idle_cache("a peer") == 0
            assert mm.pool.reserved_bytes == cached
        finally:
            go.set()
            t.join()
        assert mm.release_idle_cache("a peer") == cached
        assert mm.pool.reserved_bytes == 0
    finally:
        mm.close()
    assert mm.release_idle_cache("a peer") == 0


def _private_calls(path: Path) -> list[str]:
    """``x._name(...)`` calls in ``path`` where ``x`` is not self/cls and ``_name`` is not
    defined in the same module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {n.name for n in ast.walk(tree)
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, target = node.func.attr, node.func.value
        if (not name.startswith("_") or name.startswith("__") or name in own
                or isinstance(target, ast.Name) and target.id in ("self", "cls")):
            continue
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_the_managers_parts_call_no_private_method_of_another_module():
    """Batches, expandable segments, the miss path, growth, streams, fallback, pressure and
    measure() talk through declared interfaces (Growth, SlowPath, CoreAccess, public methods):
    none calls an underscore method it does not define."""
    found = [c for path in sorted(MANAGER_PKG.glob("*.py")) for c in _private_calls(path)]
    assert not found, "private calls across modules:\n" + "\n".join(found)


def test_the_static_check_finds_a_private_call(tmp_path):
    """The check above can fail."""
    src = tmp_path / "part.py"
    src.write_text("def f(mm):\n    return mm._alloc_cached(1)\n\n"
                   "class A:\n    def g(self):\n        return self._h()\n")
    assert _private_calls(src) == ["part.py:2: mm._alloc_cached"]
