"""Managers with expandable segments on sim and on the fake driver, for the tests of holes,
stitching and handle sizes (tests/manager/test_expandable_stitch.py, test_expandable_handles.py).

The ``vm`` fixture runs a test twice: level **real** on the simulated device (back_memory=True:
bytes are kept per physical handle, so memory moved elsewhere shows its bytes there and unmapped
addresses fail), and level **fake driver** (the real cuda-python against tests/fake_cuda, whose
VMM block enforces the driver's rules; it runs in ci/test.sh's cuda passes and skips
elsewhere). A test marked ``@pytest.mark.handle_size(n)`` gets
``MemoryConfig(expandable_handle_size=n)``. After the test the manager is closed and no
physical handle, mapping or reservation may be left.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import DriverOutOfMemory
from gpumem.units import MiB
from invariants import check, sim_manager

PAGE = 2 * MiB      # sim's and the fake's granularity


@dataclass
class VM:
    mm: MemoryManager
    leaks: Callable[[], tuple[int, int, int]]      # live physical handles, mappings, reservations
    base: tuple[int, int, int]                     # what was live before the manager

    @property
    def physical(self) -> int:
        """Device memory in use (total - free): the mapped handles, nothing else here."""
        free, total = self.mm.device.mem_get_info()
        return total - free


@pytest.fixture(params=["sim", "cuda"])
def vm(request) -> Any:
    marker = request.node.get_closest_marker("handle_size")
    # a handle size names the policy (0: tight, one page; "growth": fast); None: auto
    handle_size = marker.args[0] if marker else 0
    if request.param == "sim":
        dev, mm = sim_manager("1GiB", back_memory=True, segments="auto", expandable_segments=True,
                              expandable_handle_size=handle_size)
        leaks = lambda: (dev.live_page_handles, dev.live_mappings, dev.live_reservations)  # noqa
    else:
        f = request.getfixturevalue("fake")
        leaks = lambda: (f.fake_cuda_live_vmm_handles(), f.fake_cuda_live_vmm_mappings(),  # noqa
                         f.fake_cuda_live_vmm_reservations())
        base = leaks()
        mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0,
                                                  gpu_memory_fraction=1.0,
                                                  expandable_segments=True,
                                                  expandable_handle_size=handle_size))
    assert mm._expandable is not None
    v = VM(mm, leaks, base if request.param == "cuda" else (0, 0, 0))
    yield v
    mm.close()
    assert leaks() == v.base, "a physical handle, mapping or reservation leaked"


def refusing_nth(dev: Any, name: str, nth: int) -> tuple[Callable[..., Any], list[Any]]:
    """``(stand-in, calls)``: a stand-in for ``dev.<name>`` that passes calls through but
    refuses the ``nth`` with DriverOutOfMemory, and the list of the calls it saw."""
    real = getattr(dev, name)
    calls: list[Any] = []

    def refuse(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == nth:
            raise DriverOutOfMemory(f"{name} refused (test)")
        return real(*args)
    return refuse, calls


def fill(buf: Any, tag: int) -> bytes:
    data = bytes((tag + i) % 251 for i in range(4096)) * 4
    buf.copy_from_host(data)
    return data


def intact(bufs_and_data: Any) -> None:
    for buf, data in bufs_and_data:
        assert bytes(buf.copy_to_host()[:len(data)]) == data, f"buffer {buf.id} lost its bytes"


def layout(mm: MemoryManager) -> list[tuple[int, int, str]]:
    [seg] = [s for s in mm.pool.segments() if s["pool"] == "large"]
    return [(b["offset"], b["size"], b["state"]) for b in seg["blocks"]]


def random_walk(mm: MemoryManager, steps: int = 300, seed: int = 7, *,
                stitches: bool | None = True) -> None:
    """A seeded random walk of large and small mallocs, frees, empty_cache and shrink: after
    every step the invariant checker passes (physical = mapped, holes whole pages, counters
    exact) and every live buffer still holds the bytes written into it; holes happen, and
    stitching too when ``stitches`` (never when False; None: either), the walk being long
    enough; at the end everything goes back."""
    rng = random.Random(seed)
    live: list[tuple[Any, bytes]] = []
    holes_seen = False
    for step in range(steps):
        r = rng.random()
        if r < 0.5 or not live:
            n = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 24 * MiB)])
            buf = mm.malloc(n)
            data = bytes([step % 251]) * min(n, 4096)
            buf.copy_from_host(data)
            live.append((buf, data))
        elif r < 0.9:
            buf, data = live.pop(rng.randrange(len(live)))
            assert bytes(buf.copy_to_host()[:len(data)]) == data
            buf.free()
        elif r < 0.95:
            mm.empty_cache()
        else:
            mm.shrink(rng.randrange(0, 64 * MiB))
        holes_seen |= any(b["state"] == "unmapped" for s in mm.pool.segments()
                          for b in s["blocks"])
        check(mm, [b for b, _ in live])
    intact(live)
    assert holes_seen
    assert stitches is None or (mm._expandable.stitched_bytes > 0) == stitches
    for buf, _ in live:
        buf.free()
    assert mm.empty_cache() >= 0 and mm.pool.reserved_bytes == 0
    check(mm, [])
