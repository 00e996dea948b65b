"""The simulated device's virtual memory (gpumem_sim.vmm), level **real**: the sim is the
driver double every pool test runs on, so these tests pin down the rules it enforces (the
CUDA VMM rules gpumem's protocol keeps), its memory accounting and its fault injection."""
from __future__ import annotations

import pytest

from gpumem.backends.host import HostDevice
from gpumem.errors import (DriverError, DriverOutOfMemory, InvalidInputError,
                           UnsupportedOperationError)
from gpumem.units import MiB
from gpumem_sim import SimDevice

G = 2 * MiB


def test_reserved_space_is_free_and_pages_cost_memory():
    """A reservation far larger than the device leaves mem_get_info as it was; each page
    takes its bytes until released."""
    dev = SimDevice(64 * MiB)
    assert dev.supports_virtual_memory and dev.vm_granularity() == G
    va = dev.vm_reserve(512 * MiB)                    # 8x the capacity: address space only
    assert dev.mem_get_info() == (64 * MiB, 64 * MiB)
    h = dev.vm_create(4 * G)
    assert dev.mem_get_info()[0] == 64 * MiB - 4 * G
    dev.vm_map(va + G, 4 * G, h)
    assert dev.mapped_bytes == 4 * G and dev.live_mappings == 1
    assert dev.resolve(va, G + 10, 100) == va + G + 10
    dev.vm_unmap(va + G, 4 * G)
    dev.vm_release(h)
    dev.vm_free(va, 512 * MiB)
    assert dev.mem_get_info() == (64 * MiB, 64 * MiB)
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)
    assert [c.op for c in dev.calls] == ["vm_reserve", "vm_create", "vm_map", "vm_unmap",
                                        "vm_release", "vm_free"]


def test_pages_that_do_not_fit_fail_with_driver_oom():
    dev = SimDevice(8 * MiB)
    h = dev.vm_create(3 * G)
    with pytest.raises(DriverOutOfMemory, match="2.00 MiB free"):
        dev.vm_create(2 * G)
    assert dev.live_page_handles == 1 and dev.mem_get_info()[0] == G
    dev.vm_release(h)


@pytest.mark.parametrize("call, args, word", [
    ("vm_reserve", (G + 1,), "multiple of the granularity"),
    ("vm_create", (0,), ">= 1"),
    ("vm_create", ("2MiB",), "must be an int"),
    ("vm_free", (12345, G), "not the address of a live reservation"),
    ("vm_release", (99,), "unknown page handle"),
    ("vm_unmap", (12345, G), "no mapping starts"),
])
def test_bad_arguments_are_named(call, args, word):
    dev = SimDevice(64 * MiB)
    with pytest.raises(InvalidInputError, match=word):
        getattr(dev, call)(*args)
    assert dev.mem_get_info()[0] == 64 * MiB and not dev.calls


def test_driver_rules_are_enforced():
    """Map only inside a reservation, whole handles, no double mapping, no overlap, unmap
    before release and before freeing the range; each refusal changes nothing."""
    dev = SimDevice(64 * MiB)
    va = dev.vm_reserve(8 * G)
    h, k = dev.vm_create(2 * G), dev.vm_create(G)
    with pytest.raises(InvalidInputError, match="inside one reservation"):
        dev.vm_map(va + 7 * G, 2 * G, h)              # runs past the end
    with pytest.raises(InvalidInputError, match="inside one reservation"):
        dev.vm_map(va - 2 * G, 2 * G, h)
    with pytest.raises(InvalidInputError, match="mapped whole"):
        dev.vm_map(va, G, h)
    dev.vm_map(va, 2 * G, h)
    with pytest.raises(InvalidInputError, match="already mapped"):
        dev.vm_map(va + 4 * G, 2 * G, h)
    with pytest.raises(InvalidInputError, match="overlaps a mapping"):
        dev.vm_map(va + G, G, k)
    with pytest.raises(InvalidInputError, match="unmap it whole"):
        dev.vm_unmap(va, G)
    with pytest.raises(InvalidInputError, match="still mapped"):
        dev.vm_release(h)
    with pytest.raises(InvalidInputError, match="still has 1 mapping"):
        dev.vm_free(va, 8 * G)
    with pytest.raises(InvalidInputError, match="is 16777216 bytes"):
        dev.vm_free(va, 4 * G)
    assert (dev.live_page_handles, dev.live_mappings, dev.mapped_bytes) == (2, 1, 2 * G)
    dev.vm_map(va + 2 * G, G, k)                      # adjacent is fine
    for addr, n, handle in ((va, 2 * G, h), (va + 2 * G, G, k)):
        dev.vm_unmap(addr, n)
        dev.vm_release(handle)
    dev.vm_free(va, 8 * G)
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)


def test_unmapping_out_of_order_keeps_the_mapping_index_exact():
    """Pages unmapped from the middle and the ends of a reservation in any order (as trims and
    stitches do) leave the sim's sorted index of mappings exact: overlap checks still refuse
    the live neighbours, the holes take new pages, and every mapped page's bytes are found at
    its address. Level **real** (the sim's bookkeeping that every expandable test relies on)."""
    dev = SimDevice(64 * MiB, back_memory=True)
    va = dev.vm_reserve(8 * G)
    handles = [dev.vm_create(G) for _ in range(6)]
    for i, h in enumerate(handles):
        dev.vm_map(va + i * G, G, h)
        dev.memset(va, i * G, i + 1, 1)
    for i in (3, 0, 5):                                 # middle, first, last
        dev.vm_unmap(va + i * G, G)
    assert (dev.live_mappings, dev.mapped_bytes) == (3, 3 * G)
    for i in (1, 2, 4):
        with pytest.raises(InvalidInputError, match="overlaps a mapping"):
            dev.vm_map(va + i * G, G, handles[0])
        out = bytearray(1)
        dev.copy_to_host(va, i * G, memoryview(out))
        assert out[0] == i + 1
    with pytest.raises(InvalidInputError, match="no mapping starts"):
        dev.vm_unmap(va + 3 * G, G)
    dev.vm_map(va + 3 * G, G, handles[5])               # a moved page fills the hole
    out = bytearray(1)
    dev.copy_to_host(va, 3 * G, memoryview(out))
    assert out[0] == 6
    for i in (1, 2, 3, 4):
        dev.vm_unmap(va + i * G, G)
    for h in handles:
        dev.vm_release(h)
    dev.vm_free(va, 8 * G)
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)


def test_bytes_follow_the_page_and_unmapped_access_fails():
    """back_memory=True: data written through one mapping is read back across page borders;
    remapping a page elsewhere shows the same bytes (what stitching relies on); touching an
    unmapped address raises."""
    dev = SimDevice(64 * MiB, back_memory=True)
    va = dev.vm_reserve(8 * G)
    a, b = dev.vm_create(G), dev.vm_create(G)
    dev.vm_map(va, G, a)
    dev.vm_map(va + G, G, b)
    data = bytes(range(256)) * 64
    dev.copy_from_host(va, G - 8192, memoryview(data))          # spans both pages
    out = bytearray(len(data))
    dev.copy_to_host(va, G - 8192, memoryview(out))
    assert bytes(out) == data
    dev.memset(va, G - 1, 7, 2)
    with pytest.raises(InvalidInputError, match="not mapped"):
        dev.copy_to_host(va, 2 * G - 4, memoryview(bytearray(8)))
    with pytest.raises(InvalidInputError, match="outside the reservation"):
        dev.memset(va, 8 * G - 1, 0, 2)
    dev.vm_unmap(va + G, G)
    dev.vm_map(va + 5 * G, G, b)
    moved = bytearray(4)
    dev.copy_to_host(va, 5 * G, memoryview(moved))
    assert bytes(moved) == bytes([7]) + data[8193:8196]
    with pytest.raises(InvalidInputError, match="not mapped"):
        dev.memset(va, G, 0, 1)


def test_fault_injection_on_create_and_map():
    """create_after / map_after fail the calls after n more; rates are seeded and repeat; an
    injected map failure leaves the page unmapped and releasable."""
    dev = SimDevice(64 * MiB, seed=3)
    va = dev.vm_reserve(16 * G)
    dev.inject_vm(create_after=2)
    hs = [dev.vm_create(G), dev.vm_create(G)]
    with pytest.raises(DriverOutOfMemory) as err:
        dev.vm_create(G)
    assert err.value.injected and dev.live_page_handles == 2
    dev.inject_vm(create_after=None, map_after=1)
    dev.vm_map(va, G, hs[0])
    with pytest.raises(DriverError, match="injected failure mapping") as err:
        dev.vm_map(va + G, G, hs[1])
    assert err.value.injected and dev.live_mappings == 1
    dev.clear_faults()
    dev.vm_map(va + G, G, hs[1])

    def pattern(seed):
        d = SimDevice(64 * MiB, seed=seed)
        d.inject_vm(create_rate=0.5)
        out = []
        for _ in range(20):
            try:
                d.vm_release(d.vm_create(G))
                out.append(True)
            except DriverOutOfMemory:
                out.append(False)
        return out

    assert pattern(11) == pattern(11) and True in pattern(11) and False in pattern(11)
    with pytest.raises(InvalidInputError, match="create_rate"):
        dev.inject_vm(create_rate=2.0)


def test_backends_without_virtual_memory_say_so():
    """host (and OpenCL, through the same base class) report no support and refuse clearly."""
    dev = HostDevice()
    assert dev.supports_virtual_memory is False
    with pytest.raises(UnsupportedOperationError, match="cpu backend has no virtual-memory"):
        dev.vm_reserve(G)


def test_vm_granularity_is_configurable_and_checked():
    assert SimDevice(MiB, vm_granularity=65536).vm_granularity() == 65536
    with pytest.raises(InvalidInputError, match="vm_granularity must be a power of two"):
        SimDevice(MiB, vm_granularity=3000)


def test_map_many_maps_side_by_side_with_one_access_call_or_nothing():
    """vm_map_many maps handles next to each other and grants access once: the log has one
    vm_map_many entry per handle and one vm_set_access, and the cost model charges one
    cuMemMap per handle plus one cuMemSetAccess (not one per handle). A refused handle (an
    injected map fault at the 3rd) leaves none of the call's handles mapped, the counters as
    before, and the handles free to map again. Bad pairs are named, nothing mapped."""
    dev = SimDevice(64 * MiB, back_memory=True)
    va = dev.vm_reserve(16 * G)
    hs = [dev.vm_create(G), dev.vm_create(2 * G), dev.vm_create(G)]
    before = dev.modeled_driver_breakdown
    dev.vm_map_many(va, [(hs[0], G), (hs[1], 2 * G), (hs[2], G)])
    assert dev.mapped_bytes == 4 * G and dev.live_mappings == 3
    assert [c.op for c in dev.calls[-4:]] == ["vm_map_many"] * 3 + ["vm_set_access"]
    after = dev.modeled_driver_breakdown
    assert after["vm_map"][0] - before.get("vm_map", (0, 0.0))[0] == 3
    assert after["vm_set_access"][0] - before.get("vm_set_access", (0, 0.0))[0] == 1
    dev.copy_from_host(va, G - 4, memoryview(b"abcdefgh"))        # across two handles
    out = bytearray(8)
    dev.copy_to_host(va, G - 4, memoryview(out))
    assert bytes(out) == b"abcdefgh"
    for off, n in ((0, G), (G, 2 * G), (3 * G, G)):
        dev.vm_unmap(va + off, n)

    dev.inject_vm(map_after=2)
    with pytest.raises(DriverOutOfMemory, match="injected failure mapping") as err:
        dev.vm_map_many(va + 4 * G, [(hs[0], G), (hs[1], 2 * G), (hs[2], G)])
    assert err.value.injected
    assert dev.mapped_bytes == 0 and dev.live_mappings == 0 and dev.live_page_handles == 3
    dev.clear_faults()
    with pytest.raises(InvalidInputError, match="multiple of the granularity"):
        dev.vm_map_many(va, [(hs[0], G), (hs[1], G + 512)])
    with pytest.raises(InvalidInputError, match="mapped whole"):
        dev.vm_map_many(va, [(hs[0], G), (hs[1], G)])             # hs[1] is 2 pages
    with pytest.raises(InvalidInputError, match="pairs"):
        dev.vm_map_many(va, [hs[0]])
    with pytest.raises(InvalidInputError, match="at least one"):
        dev.vm_map_many(va, [])
    assert dev.live_mappings == 0
    dev.vm_map_many(va + 8 * G, [(hs[2], G), (hs[0], G)])         # and they map again
    assert dev.live_mappings == 2
    dev.vm_unmap(va + 8 * G, G)
    dev.vm_unmap(va + 9 * G, G)
    for h in hs:
        dev.vm_release(h)
    dev.vm_free(va, 16 * G)
    assert (dev.live_page_handles, dev.live_mappings, dev.live_reservations) == (0, 0, 0)
