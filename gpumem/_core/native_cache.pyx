# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""NativeCache: a device's cache of backend objects for pool blocks (OpenCL sub-buffers).

It is a mapping ``address -> (nbytes, object, segment handle)`` kept in insertion order (the
device drops the oldest entry first), with a C index beside it so that ``Buffer.native`` finds
an entry by the block's address and size with no Python object built (a dict lookup would
build a Python int for the key on every call); the last hit is tried before the index. The
dict owns the entries; the index and the last hit hold borrowed pointers to their objects, and
every method below keeps them in step: an entry leaves the index (and the last hit is
forgotten) before the dict may drop (and deallocate) its object, and enters the index only
after the dict holds it, so no borrowed pointer outlives its object even if a deallocation
runs other code in between.

Thread safety: the owning device serializes writers with its lock (``OpenCLDevice._lock``);
readers hold the GIL, and no method here releases it between the index and the dict.
"""
from cython.operator cimport dereference as deref
from cpython.ref cimport PyObject
from libcpp.unordered_map cimport unordered_map

from gpumem.errors import InvalidInputError

cdef object _MISSING = object()


cdef class NativeCache:
    """``{address: (nbytes, object, segment handle)}``, oldest first, indexed in C."""

    def __init__(self, entries=()) -> None:
        self._entries = {}
        for ptr, entry in dict(entries).items():
            self[ptr] = entry

    cdef PyObject* find(self, size_t ptr, size_t nbytes) noexcept:
        """The object cached for exactly ``nbytes`` at ``ptr`` (borrowed), or NULL."""
        cdef unordered_map[size_t, native_slot].iterator it
        if self._last.obj != NULL and ptr == self._last_ptr and nbytes == self._last.nbytes:
            return self._last.obj          # the same block again: no hashing
        it = self._index.find(ptr)
        if it == self._index.end() or deref(it).second.nbytes != nbytes:
            return NULL
        self._last_ptr = ptr
        self._last = deref(it).second
        return self._last.obj

    cdef size_t find_int_ptr(self, size_t ptr, size_t nbytes) except? 0:
        """The ``int_ptr`` of the object cached for exactly ``nbytes`` at ``ptr`` (its OpenCL
        cl_mem, for pyopencl's ``Buffer.from_int_ptr``), read from the object once and then
        kept in the index; 0 when nothing is cached there."""
        cdef unordered_map[size_t, native_slot].iterator it = self._index.find(ptr)
        cdef size_t value
        if it == self._index.end() or deref(it).second.nbytes != nbytes:
            return 0
        value = deref(it).second.int_ptr
        if value == 0:
            value = getattr(<object>deref(it).second.obj, "int_ptr")
            it = self._index.find(ptr)     # the read ran Python code (a GC pass may drop
            if it != self._index.end() and deref(it).second.nbytes == nbytes:   # entries)
                deref(it).second.int_ptr = value
            self._last.obj = NULL
        return value

    def __setitem__(self, ptr, entry) -> None:
        cdef size_t key = _address(ptr)
        cdef native_slot slot
        if type(entry) is not tuple or len(entry) != 3:
            raise InvalidInputError(f"a native cache entry must be a tuple (nbytes, object, "
                                    f"segment handle), got {entry!r}")
        slot.nbytes = _nbytes(entry[0])
        slot.obj = <PyObject*>entry[1]
        slot.int_ptr = 0
        self._last.obj = NULL
        self._index.erase(key)           # first: the dict may free the entry it replaces
        self._entries[ptr] = entry
        self._index[key] = slot

    def __delitem__(self, ptr) -> None:
        self._last.obj = NULL
        self._index.erase(_address(ptr))
        del self._entries[ptr]

    def pop(self, ptr, default=_MISSING):
        """Remove and return the entry at ``ptr`` (``default``, or KeyError, when absent)."""
        self._last.obj = NULL
        if type(ptr) is int and 0 <= ptr < (1 << 64):
            self._index.erase(<size_t>ptr)
        if default is _MISSING:
            return self._entries.pop(ptr)
        return self._entries.pop(ptr, default)

    def clear(self) -> None:
        self._last.obj = NULL
        self._index.clear()
        self._entries.clear()

    def get(self, ptr, default=None):
        return self._entries.get(ptr, default)

    def __getitem__(self, ptr):
        return self._entries[ptr]

    def __contains__(self, ptr) -> bool:
        return ptr in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def keys(self):
        return self._entries.keys()

    def values(self):
        return self._entries.values()

    def items(self):
        return self._entries.items()

    def __eq__(self, other):
        if isinstance(other, NativeCache):
            return self._entries == (<NativeCache>other)._entries
        if isinstance(other, dict):
            return self._entries == other
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"NativeCache({self._entries!r})"

    def _index_size(self) -> int:
        """Entries in the C index (equals len(self); for tests)."""
        return self._index.size()

    def _find_int_ptr(self, size_t ptr, size_t nbytes) -> int:
        """find_int_ptr for tests: the cached object's int_ptr, 0 when nothing is cached."""
        return self.find_int_ptr(ptr, nbytes)

    def _find(self, size_t ptr, size_t nbytes):
        """What ``Buffer.native`` finds for (ptr, nbytes) through the C index, or None (for
        tests: it must agree with the mapping)."""
        cdef PyObject* obj = self.find(ptr, nbytes)
        return None if obj == NULL else <object>obj


cdef size_t _address(object ptr) except? 0:
    if type(ptr) is not int or not 0 <= ptr < (1 << 64):
        raise InvalidInputError(f"a native cache key must be a block address, an int in "
                                f"[0, 2**64), got {ptr!r}")
    return <size_t>ptr


cdef size_t _nbytes(object n) except? 0:
    if type(n) is not int or not 0 <= n < (1 << 64):
        raise InvalidInputError(f"a native cache entry's nbytes must be an int in [0, 2**64), "
                                f"got {n!r}")
    return <size_t>n
