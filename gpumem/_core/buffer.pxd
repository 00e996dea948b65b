# cython: language_level=3
"""Layout of Buffer (buffer.pyx), cimported by manager_core.pyx, whose ManagerCore builds
Buffers on the hot path through ``new_buffer`` (no ``__init__``)."""
cimport cython
from libc.stdint cimport uint64_t

from gpumem._core.manager_base cimport ManagerBase
from gpumem._core.pool cimport gm_block


@cython.final
cdef class Buffer:
    cdef size_t _ptr                     # read through `ptr`, which refuses freed buffers
    cdef readonly size_t nbytes
    cdef readonly uint64_t id
    cdef readonly object tag
    cdef uint64_t _stream
    cdef gm_block* _block
    cdef ManagerBase _owner
    cdef list _used_on                   # other streams that use the bytes (record_stream)
    cdef bint _free_after_exports        # a `with` block ended while views lived
    cdef Py_ssize_t _exports             # live BufferViews: free() is refused while > 0;
                                         # changed only under the GIL (view.pyx)
    cdef object __weakref__

    cdef int _raise_dead(self) except -1
    cdef int _raise_asleep(self) except -1
    cdef object _host_bytes(self, object obj, str what)


# built here, where the type's allocator (with its free list) is called directly
cdef Buffer new_buffer(ManagerBase owner, gm_block* b, size_t n, uint64_t s, object tag)
