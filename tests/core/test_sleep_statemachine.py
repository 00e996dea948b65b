"""Stateful property test of sleep and wake (issue 40): the rules of the pool state machine
(tests/core/test_pool_statemachine.py, expandable segments, faults at page creation and mapping
and at random raw allocations) plus tagged allocations in two sleep tags, sleep with and without
backup, wake (which the injected faults may refuse: the tag must then stay asleep with its
backup), frees while asleep, and touching a sleeping buffer.

Every backed-up buffer must hold its pattern after each wake, at the same address; a discarded
one is filled again. After every step: the pool invariants of the manager and of each tag pool,
the stats identity ``reserved == in_use + cached + held``, and on the device exactly the pages
the awake pools map (no page of a sleeping tag mapped, no handle leaked, one reservation per
expandable segment). Level: **real** (the Cython pool on a host-backed, fault-injecting
gpumem_sim device).
"""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import gpumem_sim
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import GpuMemoryError, OutOfMemoryError
from test_pool_statemachine import _SETTINGS, ExpandablePoolMachine

MiB = 1 << 20
TAGS = ("a", "b")
TAGGED_SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 6 * MiB))


def check_sleep(mm: MemoryManager, dev) -> None:
    """The invariants across the manager and its tag pools (module docstring)."""
    pools = mm._tag_pools.pools() if mm._tag_pools is not None else []
    mapped = reservations = held_pages = asleep = 0
    for m in [mm] + pools:
        m.pool.check_invariants()
        exp = m._expandable
        if exp is None:
            continue
        sleeping = getattr(exp, "sleeping", False)
        mapped += sum(n for n, _ in exp.layout().values()) - (exp.asleep_bytes if sleeping else 0)
        reservations += len(exp.layout())
        held_pages += exp.held_pages
        if sleeping:
            asleep += exp.asleep_bytes
            assert m._asleep_tag is not None
        else:
            assert getattr(exp, "asleep_bytes", 0) == 0
    st_ = mm.stats()
    assert st_.reserved_bytes == st_.in_use_bytes + st_.cached_bytes + st_.held_bytes, st_
    assert st_.asleep_bytes == asleep, (st_.asleep_bytes, asleep)
    assert dev.mapped_bytes == mapped, (dev.mapped_bytes, mapped)
    assert dev.live_mappings + held_pages == dev.live_page_handles
    assert dev.live_reservations == reservations


class SleepMachine(ExpandablePoolMachine):
    """ExpandablePoolMachine's rules and set-up, plus two sleep tags."""

    @initialize(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["auto", "tight", "fast"]))
    def setup(self, seed: int, policy: str) -> None:
        self.dev = gpumem_sim.SimDevice("128MiB", back_memory=True, fail_rate=0.03, seed=seed)
        self.dev.inject_vm(create_rate=0.03, map_rate=0.03)
        gpumem_sim.install(self.dev)
        self.mm = MemoryManager("sim:0", MemoryConfig(
            min_free_bytes=0, gpu_memory_fraction=1.0, track_allocations=False,
            cpu_fallback_enabled=False, segments=policy))
        self.streams = [0, self.dev.create_stream(), self.dev.create_stream()]
        self.live = []
        self.serial = 0
        self.tagged: list[tuple[object, int, str]] = []     # (buffer, serial, tag)
        self.asleep: dict[str, bool] = {}                   # tag -> backed up

    def teardown(self) -> None:
        mm = getattr(self, "mm", None)
        if mm is None:
            return
        try:
            self.dev.inject_vm(create_rate=0.0, map_rate=0.0)
            if self.asleep:
                mm.wake()
                self._after_wake(list(self.asleep))
            for buf, serial, _ in self.tagged:
                self._verify(buf, serial)
                buf.free()
            self.tagged = []
            if mm._tag_pools is not None:
                mm._tag_pools.empty_cache()     # check() then sees the manager's pool alone
        finally:
            super().teardown()

    # --- tagged rules -----------------------------------------------------------------------
    @rule(n=TAGGED_SIZES, tag=st.sampled_from(TAGS))
    def malloc_tagged(self, n: int, tag: str) -> None:
        try:
            with self.mm.region(tag):
                buf = self.mm.malloc(n)
        except OutOfMemoryError:
            return                                # an injected fault refused the growth
        except GpuMemoryError as exc:
            assert tag in self.asleep and "asleep" in str(exc)
            return
        assert tag not in self.asleep and buf.tag == tag and buf.manager is not self.mm
        self.serial += 1
        self._fill(buf, self.serial)
        self.tagged.append((buf, self.serial, tag))

    @precondition(lambda self: self.tagged)
    @rule(data=st.data())
    def free_tagged(self, data) -> None:
        i = data.draw(st.integers(0, len(self.tagged) - 1))
        buf, serial, tag = self.tagged.pop(i)
        if tag not in self.asleep:
            self._verify(buf, serial)
        else:
            try:
                buf.copy_to_host()
                raise AssertionError("a sleeping buffer was readable")
            except GpuMemoryError as exc:
                assert repr(tag) in str(exc)
        self.mm.free(buf)                       # allowed while asleep
        assert not buf.alive

    @rule(tags=st.sets(st.sampled_from(TAGS), min_size=1), backup=st.sampled_from(
        [True, False, ("a",), ("b",)]))
    def sleep(self, tags: set, backup) -> None:
        if self.mm._tag_pools is None or any(t not in self.mm._tag_pools._tags for t in tags):
            return                                # a tag never used in a region: refused
        chosen = (set(tags) if backup is True else set() if backup is False
                  else set(backup) & set(tags))
        before = self.dev.mem_get_info()[0]
        released = self.mm.sleep(sorted(tags), backup=sorted(chosen))
        assert self.dev.mem_get_info()[0] - before == released
        for t in tags:
            if t not in self.asleep and t in self.mm._tag_pools._pools:
                self.asleep[t] = t in chosen

    @precondition(lambda self: self.asleep)
    @rule(which=st.sampled_from([None, "a", "b"]))
    def wake(self, which) -> None:
        tags = list(self.asleep) if which is None else [which]
        woken = []
        try:
            for t in tags:
                if t in self.asleep:
                    self.mm.wake(t)
                    woken.append(t)
        except OutOfMemoryError:
            failed = tags[len(woken)]
            pool = self.mm._tag_pools._pools[failed]
            assert pool._asleep_tag == failed   # all or nothing: still asleep
        self._after_wake(woken)

    def _after_wake(self, woken: list) -> None:
        for t in woken:
            backed = self.asleep.pop(t)
            for buf, serial, tag in self.tagged:
                if tag != t:
                    continue
                assert buf.asleep_tag is None
                if backed:
                    self._verify(buf, serial)
                else:
                    self._fill(buf, serial)       # discarded: its bytes are undefined

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "mm"):
            check_sleep(self.mm, self.dev)


TestSleepMachine = SleepMachine.TestCase
TestSleepMachine.settings = _SETTINGS
