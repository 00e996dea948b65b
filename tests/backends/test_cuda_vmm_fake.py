"""The cuda backend's virtual-memory calls (gpumem.backends.cuda_vmm), level **fake driver**:
the real cuda-python against tests/fake_cuda's VMM block, which enforces the driver's rules
(granularity, mapping only inside reservations, access set before use, unmap before free) and
counts live handles, mappings and reservations. They run in ci/test.sh's second pass
(GPUMEM_TEST_BACKENDS=cuda with the fake loaded) and skip elsewhere. What a GPU would add
(real page tables, real cuMemSetAccess semantics across devices) is not proved here."""
from __future__ import annotations

import pytest

from gpumem.backends import cuda as cuda_mod
from gpumem.errors import DriverError, DriverOutOfMemory, InvalidInputError

MiB = 1 << 20
G = 2 * MiB          # the fake's granularity


@pytest.fixture
def dev(fake):  # noqa: F811
    d = cuda_mod.BACKEND.open(0)
    before = _vmm(fake)
    yield d
    d.close()
    assert _vmm(fake) == before, "the device left VMM handles, mappings or reservations behind"


def _vmm(fake) -> tuple[int, int, int]:
    return (fake.fake_cuda_live_vmm_handles(), fake.fake_cuda_live_vmm_mappings(),
            fake.fake_cuda_live_vmm_reservations())


def test_map_copy_unmap_release_free(dev, fake):  # noqa: F811
    """A reservation costs no device memory, a page does; bytes written through the mapping
    read back; every call's effect shows in the fake's counters."""
    assert dev.supports_virtual_memory and dev.vm_granularity() == G
    base = _vmm(fake)
    free0 = dev.mem_get_info()[0]
    va = dev.vm_reserve(64 * G)
    assert dev.mem_get_info()[0] == free0
    h = dev.vm_create(2 * G)
    assert dev.mem_get_info()[0] == free0 - 2 * G
    dev.vm_map(va + 4 * G, 2 * G, h)
    assert _vmm(fake) == (base[0] + 1, base[1] + 1, base[2] + 1)
    data = bytes(range(256)) * 32
    dev.copy_from_host(va, 4 * G + G - 100, memoryview(data))
    out = bytearray(len(data))
    dev.copy_to_host(va, 4 * G + G - 100, memoryview(out))
    assert bytes(out) == data
    assert dev.resolve(va, 4 * G, 16) == va + 4 * G
    dev.vm_unmap(va + 4 * G, 2 * G)
    dev.vm_release(h)
    dev.vm_free(va, 64 * G)
    assert _vmm(fake) == base and dev.mem_get_info()[0] == free0


def test_remapped_page_keeps_its_bytes(dev):
    """One physical page mapped at a new address shows the bytes written at the old one (the
    fake backs pages with a memfd), which stitching relies on."""
    va = dev.vm_reserve(8 * G)
    h = dev.vm_create(G)
    dev.vm_map(va, G, h)
    dev.memset(va, 123, 0x5A, 4)
    dev.vm_unmap(va, G)
    dev.vm_map(va + 6 * G, G, h)
    out = bytearray(4)
    dev.copy_to_host(va, 6 * G + 123, memoryview(out))
    assert bytes(out) == b"\x5a" * 4
    dev.vm_unmap(va + 6 * G, G)
    dev.vm_release(h)
    dev.vm_free(va, 8 * G)


def test_driver_rules_are_enforced(dev, fake):  # noqa: F811
    """Misaligned sizes are refused before the driver; a mapping outside a reservation, over
    another mapping, a copy into unmapped bytes and freeing a range that still has mappings
    are refused by the driver with CUDA_ERROR_INVALID_VALUE, and change nothing."""
    with pytest.raises(InvalidInputError, match="multiple of the VMM granularity"):
        dev.vm_create(G + 4096)
    va = dev.vm_reserve(4 * G)
    h, k = dev.vm_create(2 * G), dev.vm_create(G)
    before = _vmm(fake)
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        dev.vm_map(va + 3 * G, 2 * G, h)                  # runs past the reservation
    dev.vm_map(va, 2 * G, h)
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        dev.vm_map(va + G, G, k)                          # overlaps
    with pytest.raises(DriverError, match="cuMemcpyHtoDAsync"):
        dev.copy_from_host(va, 3 * G, memoryview(b"x"))   # unmapped
    with pytest.raises(DriverError, match="cuMemAddressFree"):
        dev.vm_free(va, 4 * G)                            # unmap before free
    assert _vmm(fake) == (before[0], before[1] + 1, before[2])
    dev.vm_unmap(va, 2 * G)
    for handle in (h, k):
        dev.vm_release(handle)
    dev.vm_free(va, 4 * G)


def test_access_must_be_set_before_use(dev):
    """cuMemMap alone leaves the range inaccessible: a copy fails until cuMemSetAccess."""
    drv = dev._drv
    va = dev.vm_reserve(2 * G)
    h = dev.vm_create(G)
    handle = dev._pages[h]
    with dev._current():
        cuda_mod.check(drv, drv.cuMemMap(va, G, 0, handle, 0), "cuMemMap")
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        dev.memset(va, 0, 1, 8)
    with dev._current():
        cuda_mod.check(drv, drv.cuMemUnmap(va, G), "cuMemUnmap")
    dev.vm_map(va, G, h)                                  # map + set access
    dev.memset(va, 0, 1, 8)
    dev.vm_unmap(va, G)
    dev.vm_release(h)
    dev.vm_free(va, 2 * G)


def test_pages_beyond_the_device_fail_with_driver_oom(dev):
    total = dev.mem_get_info()[1]
    with pytest.raises(DriverOutOfMemory, match="cuMemCreate"):
        dev.vm_create((total // G + 1) * G)


def test_close_returns_whatever_is_left(fake):  # noqa: F811
    """A device closed with mapped pages and a reservation unmaps, releases and frees them."""
    before = _vmm(fake)
    d = cuda_mod.BACKEND.open(0)
    va = d.vm_reserve(4 * G)
    h = d.vm_create(G)
    d.vm_map(va, G, h)
    assert _vmm(fake) != before
    d.close()
    assert _vmm(fake) == before


def test_manager_with_expandable_segments_on_the_fake_driver(fake):  # noqa: F811
    """The pool's expandable segments through the real cuda-python: one reservation grows,
    bytes written to blocks read back, empty_cache returns the free tail, close() leaves no
    handle, mapping or reservation behind."""
    from gpumem import MemoryConfig, MemoryManager
    from invariants import check
    before = _vmm(fake)
    mm = MemoryManager("cuda:0", MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0,
                                              segments="tight"))
    try:
        assert mm._expandable is not None
        a = mm.malloc(30 * MiB)
        b = mm.malloc(50 * MiB)
        a.copy_from_host(b"abc" * 1000)
        assert bytes(a.copy_to_host()[:3000]) == b"abc" * 1000
        assert fake.fake_cuda_live_vmm_reservations() == before[2] + 1
        b.free()
        assert mm.empty_cache() > 0
        assert mm.pool.reserved_bytes == mm._expandable.mapped_bytes() < 80 * MiB
        check(mm, [a])
        a.free()
    finally:
        mm.close()
    assert _vmm(fake) == before


def test_map_many_sets_access_once_over_several_mappings(dev, fake):  # noqa: F811
    """vm_map_many maps handles side by side with one cuMemSetAccess over the range (the fake
    accepts a range that holds whole mappings, as the driver documents): a copy across the
    boundary works. When a cuMemMap midway is refused (the 2nd handle's range is already
    mapped), the mapping the call made before it is undone and the error propagates."""
    base = _vmm(fake)
    va = dev.vm_reserve(8 * G)
    h1, h2, h3 = dev.vm_create(G), dev.vm_create(2 * G), dev.vm_create(G)
    dev.vm_map_many(va, [(h1, G), (h2, 2 * G)])
    assert _vmm(fake) == (base[0] + 3, base[1] + 2, base[2] + 1)
    data = bytes(range(64))
    dev.copy_from_host(va, G - 32, memoryview(data))
    out = bytearray(64)
    dev.copy_to_host(va, G - 32, memoryview(out))
    assert bytes(out) == data
    h4 = dev.vm_create(G)
    dev.vm_map(va + 4 * G, G, h4)
    with pytest.raises(DriverError):
        dev.vm_map_many(va + 3 * G, [(h3, G), (h3, G)])     # the 2nd lands on h4: refused
    assert _vmm(fake) == (base[0] + 4, base[1] + 3, base[2] + 1)
    dev.vm_map_many(va + 3 * G, [(h3, G)])                 # h3 was unmapped again
    for off, n in ((0, G), (G, 2 * G), (3 * G, G), (4 * G, G)):
        dev.vm_unmap(va + off, n)
    for h in (h1, h2, h3, h4):
        dev.vm_release(h)
    dev.vm_free(va, 8 * G)
    assert _vmm(fake) == base
