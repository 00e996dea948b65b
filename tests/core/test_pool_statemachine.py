"""Stateful property test: random malloc/free/empty_cache/stream work against a small,
host-backed, fault-injecting simulated device, with every invariant checked after every step.

Each live buffer is filled with its own byte pattern when allocated (a value from its serial
number, plus its serial at both ends) and verified before it is freed and at the end, so two
buffers sharing bytes, or a block handed out while still live, is caught. A malloc that raises
OutOfMemoryError must not change anything a user holds: the allocation counters stay the same
(num_ooms grows by one); the out-of-memory ladder may only have returned cached segments.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import gpumem_sim
from gpumem import Buffer, FallbackBuffer, MemoryConfig, MemoryManager, OutOfMemoryError
from invariants import check

MiB = 1 << 20

SIZES = st.one_of(st.integers(0, 4096), st.integers(4097, 2 * MiB),
                  st.integers(2 * MiB + 1, 40 * MiB))

#: fields an out-of-memory error must leave exactly as they were
UNCHANGED_ON_OOM = ("in_use_bytes", "requested_bytes", "peak_in_use_bytes", "pool_hits",
                    "pool_misses", "cpu_fallbacks", "fallback_bytes", "active_buffers",
                    "num_allocs", "num_frees", "segments_created", "peak_reserved_bytes",
                    "hit_rate", "device")


def _pattern(serial: int) -> tuple[int, bytes]:
    return serial % 251 + 1, serial.to_bytes(8, "little")


class PoolMachine(RuleBasedStateMachine):
    fallback = False

    @initialize(seed=st.integers(0, 2**32 - 1),
                max_split_size=st.sampled_from([None, 8 * MiB]),
                max_pool_size=st.sampled_from([None, 16 * MiB]),
                max_pooled_per_bucket=st.sampled_from([8, 1]),
                release_before_grow=st.booleans())
    def setup(self, seed: int, **pool_knobs) -> None:
        self.dev = gpumem_sim.SimDevice("128MiB", back_memory=True, fail_rate=0.05, seed=seed)
        gpumem_sim.install(self.dev)
        self.mm = MemoryManager("sim:0", MemoryConfig(
            min_free_bytes=0, gpu_memory_fraction=1.0, track_allocations=False,
            cpu_fallback_enabled=self.fallback, **pool_knobs))
        self.streams = [0, self.dev.create_stream(), self.dev.create_stream()]
        self.live: list[tuple[object, int]] = []       # (buffer, serial for its pattern)
        self.serial = 0

    def teardown(self) -> None:
        mm = getattr(self, "mm", None)
        if mm is None:
            return
        try:
            for buf, serial in self.live:
                self._verify(buf, serial)
                buf.free()
            self.live = []
            check(mm, [])
            mm.empty_cache()
            assert self.dev.live_bytes == 0
        finally:
            mm.close()
            gpumem_sim.uninstall()

    # --- helpers ------------------------------------------------------------------------------------
    def _fill(self, buf, serial: int) -> None:
        value, tag = _pattern(serial)
        buf.memset(value)
        if buf.nbytes >= 16:
            buf.copy_from_host(tag)
            data = buf.copy_to_host()           # write the tail through a full-size copy
            data[-8:] = np.frombuffer(tag, np.uint8)
            buf.copy_from_host(data)

    def _verify(self, buf, serial: int) -> None:
        value, tag = _pattern(serial)
        data = buf.copy_to_host()
        assert data.size == buf.nbytes
        if buf.nbytes >= 16:
            assert bytes(data[:8]) == tag and bytes(data[-8:]) == tag, \
                f"buffer {buf!r}: its serial was overwritten"
            body = data[8:-8]
        else:
            body = data
        bad = np.flatnonzero(body != value)
        assert bad.size == 0, (f"buffer {buf!r}: {bad.size} bytes changed while it was live "
                               f"(first at {bad[0]})")

    # --- rules ------------------------------------------------------------------------------------
    @rule(n=SIZES, s=st.integers(0, 2))
    def malloc(self, n: int, s: int) -> None:
        before = self.mm.stats().as_dict()
        try:
            buf = self.mm.malloc(n, stream=self.streams[s])
        except OutOfMemoryError as exc:
            after = self.mm.stats().as_dict()
            assert not self.fallback or n > self.mm.total_memory, \
                f"OOM with CPU fallback on: {exc}"
            assert after["num_ooms"] == before["num_ooms"] + 1
            for name in UNCHANGED_ON_OOM:
                assert after[name] == before[name], (name, before[name], after[name])
            # the ladder may have returned cached segments to the driver, nothing else
            assert after["reserved_bytes"] <= before["reserved_bytes"]
            released = before["reserved_bytes"] - after["reserved_bytes"]
            assert after["cached_bytes"] == before["cached_bytes"] - released
            assert after["segments_released"] - before["segments_released"] == \
                before["num_segments"] - after["num_segments"]
            assert exc.requested == n
            return
        assert buf.nbytes == n and buf.alive
        if isinstance(buf, FallbackBuffer):
            assert self.fallback and buf.location == "cpu"
        else:
            assert type(buf) is Buffer and buf.location == "device"
            assert buf.stream == self.streams[s]
        self.serial += 1
        self._fill(buf, self.serial)
        self.live.append((buf, self.serial))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        i = data.draw(st.integers(0, len(self.live) - 1))
        buf, serial = self.live.pop(i)
        self._verify(buf, serial)
        buf.free()
        assert not buf.alive

    @rule()
    def empty_cache(self) -> None:
        before = self.mm.stats()
        released = self.mm.empty_cache()
        after = self.mm.stats()
        assert released == before.reserved_bytes - after.reserved_bytes
        assert after.in_use_bytes == before.in_use_bytes
        assert self.mm.pool.whole_free_bytes == 0

    @rule(keep=st.integers(0, 64 * MiB))
    def shrink(self, keep: int) -> None:
        before = self.mm.stats()
        released = self.mm.shrink(keep)
        after = self.mm.stats()
        assert released == before.reserved_bytes - after.reserved_bytes
        assert after.in_use_bytes == before.in_use_bytes
        if released == 0:
            assert after == before
        # what stays cached above the target is in segments that still hold live blocks
        if after.cached_bytes > keep:
            assert self.mm.pool.whole_free_bytes == 0

    @rule(s=st.integers(1, 2), n=st.integers(1, 3))
    def submit(self, s: int, n: int) -> None:
        self.dev.submit(self.streams[s], n)

    @rule(s=st.integers(0, 2))
    def complete(self, s: int) -> None:
        self.dev.complete(self.streams[s])

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "mm"):
            check(self.mm, [b for b, _ in self.live])


class FallbackPoolMachine(PoolMachine):
    fallback = True


class ExpandablePoolMachine(PoolMachine):
    """The same rules with expandable segments on, under each segment policy: auto (with a 4
    MiB quantum, so that on this 128 MiB card it grows in one handle while there is room and
    compacts near the limit), tight (one page per physical handle, or 6 MiB handles) and fast
    (one handle per growth), with handle creation and mapping failing at random (faults while
    compacting included): every rollback must leave the invariants (incl. mapped == pool
    bytes) intact."""

    @initialize(seed=st.integers(0, 2**32 - 1), max_pool_size=st.sampled_from([None, 16 * MiB]),
                policy=st.sampled_from([("auto", None), ("tight", None), ("tight", 6 * MiB),
                                        ("fast", None)]))
    def setup(self, seed: int, max_pool_size, policy: tuple) -> None:
        segments, handle_size = policy
        quantum = dict(large_segment=4 * MiB, large_threshold=2 * MiB) if segments == "auto" \
            else {}
        self.dev = gpumem_sim.SimDevice("128MiB", back_memory=True, fail_rate=0.05, seed=seed)
        self.dev.inject_vm(create_rate=0.03, map_rate=0.03)
        gpumem_sim.install(self.dev)
        self.mm = MemoryManager("sim:0", MemoryConfig(
            min_free_bytes=0, gpu_memory_fraction=1.0, track_allocations=False,
            cpu_fallback_enabled=False, segments=segments, max_pool_size=max_pool_size,
            expandable_handle_size=handle_size, **quantum))
        assert self.mm._expandable is not None
        self.streams = [0, self.dev.create_stream(), self.dev.create_stream()]
        self.live = []
        self.serial = 0


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = _SETTINGS
TestFallbackPoolMachine = FallbackPoolMachine.TestCase
TestFallbackPoolMachine.settings = _SETTINGS
TestExpandablePoolMachine = ExpandablePoolMachine.TestCase
TestExpandablePoolMachine.settings = _SETTINGS
