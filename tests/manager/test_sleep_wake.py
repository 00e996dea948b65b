"""Sleep and wake: tagged memory given back to the device and restored at the same addresses
(gpumem.manager.sleep, tag_pools, sleep_backup, sleep_api; issue 40; docs/sleep_and_wake.md).

Level: **real** (the Cython pool and MemoryManager on a host-backed gpumem_sim device: bytes
are kept per physical handle, unmapped addresses fail, faults are injected at page creation
and mapping). The fake-driver runs are in test_sleep_wake_fake.py, the two-process shared
group in tests/placement/test_sleep_shared.py.
"""
from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import (GpuMemoryError, InvalidInputError, OutOfMemoryError,
                           UnsupportedOperationError)
from gpumem.units import MiB

CFG = dict(cpu_fallback_enabled=False, min_free_bytes=0, gpu_memory_fraction=1.0)


@pytest.fixture
def sim():
    """A 1 GiB host-backed sim device installed as sim:0 and a manager on it."""
    dev = gpumem_sim.SimDevice("1GiB", back_memory=True)
    gpumem_sim.install(dev)
    mm = MemoryManager("sim:0", MemoryConfig(**CFG))
    yield dev, mm
    mm.close()
    gpumem_sim.uninstall()


def used(dev) -> int:
    free, total = dev.mem_get_info()
    return total - free


def host_bytes(dev) -> int:
    """Host bytes Python holds now (tracemalloc), the simulator's (bounded) call log emptied."""
    dev.clear_calls()
    return tracemalloc.get_traced_memory()[0]


def pattern(i: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 2654435761 + i * 97) >> 7).astype(np.uint8)


def test_region_tags_allocations_of_its_thread_only(sim):
    """Real: inside region() malloc carries the tag and comes from the tag's own pool; another
    thread's allocations meanwhile are untagged and stay in the manager's pool."""
    dev, mm = sim
    other = {}
    started, go = threading.Event(), threading.Event()

    def elsewhere():
        started.set()
        go.wait(30)
        other["buf"] = mm.malloc(4 * MiB)

    t = threading.Thread(target=elsewhere)
    t.start()
    started.wait(30)
    with mm.region("weights"):
        a = mm.malloc(4 * MiB)
        b = mm.malloc(4 * MiB, tag="named")        # an explicit tag wins over the region's
        go.set()
        t.join(30)
    c = mm.malloc(4 * MiB)
    assert a.tag == "weights" and a.manager is not mm
    assert b.tag == "named" and b.manager is mm
    assert other["buf"].tag is None and other["buf"].manager is mm
    assert c.tag is None and c.manager is mm
    # malloc(tag=) of a sleep tag outside a region goes to its pool too
    d = mm.malloc(MiB, tag="weights")
    assert d.manager is a.manager
    assert mm.stats().in_use_bytes == sum(x.nbytes for x in (a, b, c, d, other["buf"]))
    for x in (a, b, c, d, other["buf"]):
        mm.free(x)                                  # the manager frees its tag pools' buffers
    assert mm.stats().in_use_bytes == 0


def test_sleep_700mib_two_tags_release_reuse_fault_wake_cycles(sim):
    """Real: 700 MiB across two tags: sleep gives >= 95 % back, another manager can use it,
    a wake failing on an injected fault leaves both tags asleep with the backup intact, the
    next wake restores the weights byte for byte at the same addresses, kv is usable, no host
    memory is left, 20 cycles grow neither device nor host memory, and freeing all plus
    empty_cache() leaves the device at 0."""
    dev, mm = sim
    with mm.region("weights"):
        weights = [mm.malloc(20 * MiB) for _ in range(20)]            # 400 MiB
    with mm.region("kv"):
        kv = [mm.malloc(100 * MiB) for _ in range(3)]                  # 300 MiB
    for i, w in enumerate(weights):
        w.copy_from_host(pattern(i, w.nbytes))
    ptrs = [w.ptr for w in weights] + [k.ptr for k in kv]
    untagged = mm.malloc(8 * MiB)
    untagged.copy_from_host(pattern(99, untagged.nbytes))
    before = used(dev)

    released = mm.sleep(["weights", "kv"], backup=["weights"])
    assert released >= 0.95 * 700 * MiB
    assert before - used(dev) >= 0.95 * 700 * MiB
    st = mm.stats()
    assert st.asleep_bytes >= 0.95 * 700 * MiB and st.backup_bytes == 400 * MiB
    assert st.reserved_bytes == st.in_use_bytes + st.cached_bytes + st.held_bytes
    assert st.reserved_bytes < 100 * MiB                  # only the untagged pool is held
    assert {s["tag"]: s["asleep"] for s in mm.sleeping_tags()} == {"weights": True, "kv": True}

    # another manager on the device takes the released memory, then gives it back
    with MemoryManager(dev, MemoryConfig(**CFG)) as other:
        big = other.malloc(650 * MiB)
        big.free()
        other.empty_cache()

    # touching a sleeping buffer raises, naming the tag
    for touch in (lambda: weights[0].copy_to_host(), lambda: weights[0].memset(0),
                  lambda: weights[0].view(), lambda: weights[0].__dlpack__(),
                  lambda: kv[0].copy_from_host(b"x")):
        with pytest.raises(GpuMemoryError, match="weights|kv"):
            touch()
    assert weights[0].ptr == ptrs[0] and weights[0].asleep_tag == "weights"
    with pytest.raises(GpuMemoryError, match="asleep"):
        mm.malloc(MiB, tag="kv")

    asleep_used = used(dev)
    dev.inject_vm(create_after=5)               # the sixth page creation fails
    with pytest.raises(OutOfMemoryError, match="stays asleep"):
        mm.wake()
    dev.inject_vm(create_after=None)
    assert used(dev) == asleep_used             # nothing of the failed wake stays mapped
    st = mm.stats()
    assert st.backup_bytes == 400 * MiB and st.asleep_bytes >= 0.95 * 700 * MiB
    with pytest.raises(GpuMemoryError):
        weights[1].copy_to_host()

    assert mm.wake() >= 0.95 * 700 * MiB
    assert [w.ptr for w in weights] + [k.ptr for k in kv] == ptrs
    for i, w in enumerate(weights):
        assert np.array_equal(w.copy_to_host(), pattern(i, w.nbytes))
    assert np.array_equal(untagged.copy_to_host(), pattern(99, untagged.nbytes))
    for k in kv:                                 # usable again
        k.memset(7)
        assert k.copy_to_host()[-1] == 7
    st = mm.stats()
    assert st.asleep_bytes == 0 and st.backup_bytes == 0
    assert used(dev) == before

    tracemalloc.start()
    try:
        for cycle in range(20):
            mm.sleep(["weights", "kv"], backup=["weights"])
            mm.wake(["weights", "kv"])
            if cycle == 0:
                host_after_first = host_bytes(dev)
                device_after_first = used(dev)
        host_after_last = host_bytes(dev)
    finally:
        tracemalloc.stop()
    assert used(dev) == device_after_first == before
    assert host_after_last - host_after_first < 1 * MiB      # no backup left behind
    assert np.array_equal(weights[7].copy_to_host(), pattern(7, weights[7].nbytes))

    for buf in weights + kv + [untagged]:
        mm.free(buf)
    mm.empty_cache()
    assert used(dev) == 0
    assert (dev.live_page_handles, dev.live_mappings) == (0, 0)


def test_wake_fault_at_map_keeps_tag_asleep(sim):
    """Real: a wake whose page mapping fails raises, maps and creates nothing that stays, and
    leaves the tag asleep with its backup; the next wake restores the content."""
    dev, mm = sim
    with mm.region("w"):
        bufs = [mm.malloc(6 * MiB) for _ in range(4)]
    for i, b in enumerate(bufs):
        b.copy_from_host(pattern(i, b.nbytes))
    mm.sleep("w")
    handles = dev.live_page_handles
    dev.inject_vm(map_after=1)
    with pytest.raises(OutOfMemoryError):
        mm.wake("w")
    dev.inject_vm(map_after=None)
    assert dev.live_page_handles == handles and mm.stats().backup_bytes == 24 * MiB
    assert mm.wake("w") > 0
    for i, b in enumerate(bufs):
        assert np.array_equal(b.copy_to_host(), pattern(i, b.nbytes))


def test_free_while_asleep_drops_backup_and_address(sim):
    """Real: a buffer freed while its tag sleeps drops its backup at once; the wake maps only
    what live buffers need and restores them; the freed range is not mapped again."""
    dev, mm = sim
    with mm.region("w"):
        keep = mm.malloc(40 * MiB)
        drop = mm.malloc(40 * MiB)
    keep.copy_from_host(pattern(1, keep.nbytes))
    drop.copy_from_host(pattern(2, drop.nbytes))
    mm.sleep("w")
    assert mm.stats().backup_bytes == 80 * MiB
    drop.free()
    assert mm.stats().backup_bytes == 40 * MiB
    mapped = mm.wake("w")
    assert 40 * MiB <= mapped < 80 * MiB
    assert np.array_equal(keep.copy_to_host(), pattern(1, keep.nbytes))
    assert used(dev) < 80 * MiB
    keep.free()
    mm.empty_cache()
    assert used(dev) == 0


def test_free_all_while_asleep_then_wake_and_close(sim):
    """Real: every buffer of a sleeping tag freed: empty_cache() frees its reservations, wake
    maps nothing, and close() leaves no page, mapping or reservation."""
    dev, mm = sim
    with mm.region("kv"):
        bufs = [mm.malloc(30 * MiB) for _ in range(3)]
    mm.sleep("kv", backup=False)
    assert mm.stats().backup_bytes == 0
    for b in bufs:
        b.free()
    mm.empty_cache()
    assert mm.wake("kv") == 0
    assert used(dev) == 0
    mm.close()
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)


def test_sleep_leaves_other_memory_untouched(sim):
    """Real: sleeping one tag changes neither the untagged pool nor another tag: their bytes,
    stats and device memory stay."""
    dev, mm = sim
    plain = mm.malloc(16 * MiB)
    plain.copy_from_host(pattern(3, plain.nbytes))
    with mm.region("a"):
        a = mm.malloc(16 * MiB)
    with mm.region("b"):
        b = mm.malloc(16 * MiB)
    b.copy_from_host(pattern(4, b.nbytes))
    in_use = mm.stats().in_use_bytes
    mm.sleep("a", backup=False)
    assert mm.stats().in_use_bytes == in_use - a.nbytes
    assert np.array_equal(plain.copy_to_host(), pattern(3, plain.nbytes))
    assert np.array_equal(b.copy_to_host(), pattern(4, b.nbytes))
    extra = mm.malloc(4 * MiB, tag="b")         # the awake tag still allocates
    assert mm.sleep("a") == 0                   # already asleep: nothing more
    assert mm.wake("b") == 0                    # awake: nothing to map
    mm.wake("a")
    a.memset(1)
    for buf in (plain, a, b, extra):
        mm.free(buf)


def test_stats_summary_snapshot_dask_show_sleep(sim):
    """Real: asleep_bytes and backup_bytes reach MemoryStats, memory_summary, snapshots and
    the Dask metrics while a tag sleeps."""
    from gpumem.dask.plugin import GpumemPlugin
    dev, mm = sim
    with mm.region("w"):
        w = mm.malloc(10 * MiB)
    mm.sleep("w")
    st = mm.stats()
    assert st.asleep_bytes >= 10 * MiB and st.backup_bytes == 10 * MiB
    assert "asleep" in mm.memory_summary()
    assert mm.snapshot()["stats"]["asleep_bytes"] == st.asleep_bytes
    plugin = GpumemPlugin()
    plugin.manager = mm
    metric = plugin._metric(None)
    assert metric["asleep_bytes"] == st.asleep_bytes and metric["backup_bytes"] == 10 * MiB
    mm.wake()
    w.free()


def test_bad_arguments_say_what_and_change_nothing(sim):
    """Real: unknown tags, a bad backup and bad region tags raise InvalidInputError naming
    the argument; nothing sleeps."""
    dev, mm = sim
    with mm.region("w"):
        w = mm.malloc(MiB)
    with pytest.raises(InvalidInputError, match="'nope' is not a sleep tag"):
        mm.sleep("nope")
    with pytest.raises(InvalidInputError, match="backup"):
        mm.sleep("w", backup="w")
    with pytest.raises(InvalidInputError, match="not being put to sleep"):
        mm.sleep("w", backup=["other"])
    with pytest.raises(InvalidInputError, match="at least one"):
        mm.sleep([])
    with pytest.raises(InvalidInputError, match="None"):
        mm.region(None).__enter__()
    with pytest.raises(InvalidInputError, match="hashable"):
        mm.region(["w"]).__enter__()
    assert mm.stats().asleep_bytes == 0
    w.copy_from_host(b"ok")


def test_no_virtual_memory_says_why(sim_device):
    """Real (host backend): sleep on a device without virtual memory raises
    UnsupportedOperationError saying why; region() still tags allocations."""
    with MemoryManager("cpu", MemoryConfig(**CFG)) as mm:
        with mm.region("w"):
            buf = mm.malloc(MiB)
        assert buf.tag == "w" and buf.manager is mm
        with pytest.raises(UnsupportedOperationError, match="virtual memory"):
            mm.sleep("w")
        with pytest.raises(UnsupportedOperationError, match="virtual memory"):
            mm.wake("w")
        buf.free()


def test_wake_refused_by_limit_then_succeeds(sim):
    """Real: a wake that the device cannot serve (another manager holds the memory) raises
    OutOfMemoryError naming the tag; once that memory is freed the wake succeeds."""
    dev, mm = sim
    with mm.region("w"):
        w = mm.malloc(400 * MiB)
    w.copy_from_host(pattern(5, w.nbytes))
    mm.sleep("w")
    other = MemoryManager(dev, MemoryConfig(**CFG))
    hog = other.malloc(800 * MiB)
    with pytest.raises(OutOfMemoryError, match="'w'"):
        mm.wake("w")
    assert w.asleep_tag == "w" and mm.stats().backup_bytes == 400 * MiB
    hog.free()
    other.close()
    assert mm.wake("w") >= 400 * MiB
    assert np.array_equal(w.copy_to_host(), pattern(5, w.nbytes))
    w.free()


def test_wake_takes_back_cached_memory_of_peers(sim):
    """Real: memory cached (free) by another manager of the process is released for a wake:
    the hand-back within one process (peers)."""
    dev, mm = sim
    with mm.region("w"):
        w = mm.malloc(400 * MiB)
    mm.sleep("w", backup=False)
    other = MemoryManager(dev, MemoryConfig(**CFG))
    other.malloc(800 * MiB).free()              # cached by the other manager
    assert mm.wake("w") >= 400 * MiB
    w.memset(3)
    w.free()
    other.close()


def test_gpumem_info_lists_sleeping_tags(sim, capsys):
    """Real (the CLI in process): `gpumem info` lists the sleeping tags of this process's
    managers, as text and in its JSON, and none once they woke."""
    import json
    from gpumem.cli import main
    dev, mm = sim
    with mm.region("weights"):
        w = mm.malloc(12 * MiB)
    mm.sleep("weights")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "sleeping tags" in out and "'weights'" in out
    assert main(["info", "--json"]) == 0
    (row,) = [r for r in json.loads(capsys.readouterr().out) if r["device"] == "sim:0"]
    (tag,) = row["sleeping_tags"]
    assert tag["tag"] == "weights" and tag["backup_bytes"] == 12 * MiB
    mm.wake()
    assert main(["info", "--json"]) == 0
    (row,) = [r for r in json.loads(capsys.readouterr().out) if r["device"] == "sim:0"]
    assert row["sleeping_tags"] == []
    w.free()


@pytest.mark.slow
@pytest.mark.parametrize("fail_rate,expandable", [(0.0, False), (0.05, True)],
                         ids=["plain-parent", "expandable-faults"])
def test_stress_with_a_sleeper_thread(sim_device, fail_rate, expandable):
    """Real: the stress harness's threads (allocators, device, maintenance with empty_cache,
    shrink, snapshots) beside a sleeper that sleeps and wakes a tag over and over (faults
    injected at page creation and mapping): every pattern survives each wake, counters end
    exact and the device ends empty."""
    from stress_harness import run
    res = run(ops=3000, seconds=8, workers=4, capacity="512MiB", fail_rate=fail_rate,
              cpu_fallback=True, seed=5, expandable=expandable, sleep=True)
    assert not res.failures, "\n".join(res.failures[:10])
    assert res.sleeps > 0
