# cython: language_level=3
# distutils: language = c++
"""Layout of NativeCache (see native_cache.pyx); buffer.pyx cimports it for `Buffer.native`."""
from cpython.ref cimport PyObject
from libcpp.unordered_map cimport unordered_map


cdef struct native_slot:
    size_t nbytes
    PyObject* obj           # borrowed: the tuple in NativeCache._entries owns it
    size_t int_ptr          # obj.int_ptr (an OpenCL cl_mem), read on first use; 0: not yet


cdef class NativeCache:
    cdef dict _entries                              # ptr -> (nbytes, object, handle), oldest first
    cdef unordered_map[size_t, native_slot] _index  # ptr -> (nbytes, object) of every entry
    cdef size_t _last_ptr                           # the last hit, tried before the index
    cdef native_slot _last                          # (obj NULL: none; reset by every write)

    cdef PyObject* find(self, size_t ptr, size_t nbytes) noexcept
    cdef size_t find_int_ptr(self, size_t ptr, size_t nbytes) except? 0
