"""NativeCache, the OpenCL device's sub-buffer cache: a mapping with a C index that
``Buffer.native`` reads without building Python objects.

Level: **real** (pure Python objects stand in for sub-buffers; the OpenCL side, with kernels
writing and reading through the cached sub-buffers on PoCL, is tests/backends/test_opencl_native.py).
What a user relies on: the C index finds exactly what the mapping holds (same object, only for
the exact size), it never keeps an object the mapping has dropped, and bad keys or entries are
refused with InvalidInputError and leave the cache unchanged.
"""
from __future__ import annotations

import gc
import random
import weakref

import pytest

from gpumem._core.native_cache import NativeCache
from gpumem.errors import InvalidInputError


class Sub:
    """Stands in for a pyopencl sub-buffer (weak-referenceable, so its death is observable)."""


def agrees(cache: NativeCache, ref: dict) -> None:
    assert cache == ref
    assert list(cache) == list(ref)                     # insertion order: oldest first
    assert cache._index_size() == len(ref)
    for ptr, (nbytes, obj, _handle) in ref.items():
        assert cache._find(ptr, nbytes) is obj
        assert cache._find(ptr, nbytes + 1) is None     # only the exact size hits
        assert cache._find(ptr + 1, nbytes) is None


def test_random_operations_keep_index_and_mapping_in_step():
    """Thousands of random set/replace/pop/del/clear operations against a plain dict."""
    rng = random.Random(12)
    cache, ref = NativeCache(), {}
    for step in range(5000):
        ptr = (1 << 48) + 256 * rng.randrange(64)
        op = rng.random()
        if op < 0.5:
            entry = (256 * rng.randrange(1, 8), Sub(), rng.randrange(4))
            if rng.random() < 0.5:           # what OpenCLDevice.resolve does: pop, then add
                cache.pop(ptr, None)
                ref.pop(ptr, None)
            cache[ptr] = entry
            ref[ptr] = entry
        elif op < 0.75:
            if ptr in ref:
                assert cache._find(ptr, ref[ptr][0]) is ref[ptr][1]     # now the last hit
            old = ref.pop(ptr, None)
            assert cache.pop(ptr, None) == old
            if old is not None:
                assert cache._find(ptr, old[0]) is None                 # the last hit forgotten
        elif op < 0.9 and ptr in ref:
            nbytes = ref[ptr][0]
            assert cache._find(ptr, nbytes) is ref[ptr][1]
            del cache[ptr]
            del ref[ptr]
            assert cache._find(ptr, nbytes) is None
        elif op < 0.9:
            with pytest.raises(KeyError):
                del cache[ptr]
        elif op < 0.92:
            for p, (n, obj, _) in ref.items():
                assert cache._find(p, n) is obj
            cache.clear()
            ref.clear()
            assert cache._find(ptr, 256) is None and cache._index_size() == 0
        elif ref:                            # eviction as the device does it: oldest first
            oldest = next(iter(cache))
            assert oldest == next(iter(ref))
            assert cache.pop(oldest) == ref.pop(oldest)
        if step % 50 == 0:
            agrees(cache, ref)
    agrees(cache, ref)


class SubWithHandle(Sub):
    """A stand-in with an ``int_ptr`` (a pyopencl buffer's cl_mem), counting its reads."""

    def __init__(self, handle: int):
        self.handle, self.reads = handle, 0

    @property
    def int_ptr(self) -> int:
        self.reads += 1
        return self.handle


def test_int_ptr_is_read_once_per_entry_and_only_for_the_exact_size():
    """find_int_ptr (the pyopencl allocator's lookup, issue 21) gives the cached object's
    int_ptr, reading the attribute once per entry; a replaced entry is read afresh; a missing
    or other-size entry gives 0. Level: real (Python stand-ins)."""
    cache = NativeCache()
    a = SubWithHandle(0xA000)
    cache[4096] = (512, a, 1)
    assert [cache._find_int_ptr(4096, 512) for _ in range(3)] == [0xA000] * 3 and a.reads == 1
    assert cache._find_int_ptr(4096, 513) == 0 and cache._find_int_ptr(8192, 512) == 0
    assert cache._find(4096, 512) is a                  # the object lookup is unchanged
    b = SubWithHandle(0xB000)
    cache[4096] = (512, b, 1)                           # replaced: the new object's handle
    assert cache._find_int_ptr(4096, 512) == 0xB000 and b.reads == 1
    cache.pop(4096)
    assert cache._find_int_ptr(4096, 512) == 0
    cache[4096] = (512, Sub(), 1)                       # an object without int_ptr
    with pytest.raises(AttributeError):
        cache._find_int_ptr(4096, 512)


def test_dropped_objects_are_freed_and_not_found():
    """The index holds no reference: an object the mapping drops dies, and is not found."""
    cache = NativeCache()
    sub = Sub()
    dead = weakref.ref(sub)
    cache[4096] = (512, sub, 1)
    del sub
    assert cache._find(4096, 512) is not None
    cache[4096] = (512, Sub(), 1)            # replaced at the same address
    gc.collect()
    assert dead() is None
    keep = cache[4096][1]
    cache.clear()
    assert cache._find(4096, 512) is None and len(cache) == 0
    assert keep is not None


@pytest.mark.parametrize("ptr, entry, match", [
    (-1, (512, Sub(), 1), "key must be a block address"),
    (1 << 64, (512, Sub(), 1), "key must be a block address"),
    ("4096", (512, Sub(), 1), "key must be a block address"),
    (4096, [512, Sub(), 1], "must be a tuple"),
    (4096, (512, Sub()), "must be a tuple"),
    (4096, (-5, Sub(), 1), "nbytes must be an int"),
    (4096, (1.5, Sub(), 1), "nbytes must be an int"),
])
def test_bad_keys_and_entries_are_refused_without_change(ptr, entry, match):
    cache = NativeCache({8192: (256, "kept", 2)})
    with pytest.raises(InvalidInputError, match=match):
        cache[ptr] = entry
    agrees(cache, {8192: (256, "kept", 2)})
