# cython: language_level=3
# Public C-level interface of the caching pool: structures and signatures only.
# Downstream Cython code may `from gpumem._core.pool cimport ...` and call gm_alloc/gm_free
# on `CachingPool._p` without the GIL (see tests/test_cython_api.py).
from libc.stdint cimport uint64_t, int64_t
# The enums and structures (gm_pool, gm_block, gm_segment, ...) live in pool_layout.pxd, which
# the pool's helper modules cimport without importing this module; re-exported here whole.
from gpumem._core.pool_layout cimport *


# --- the C API (each takes the pool's lock itself) --------------------------------------------
# gm_alloc/gm_free: for callers without the GIL. gm_alloc_gil/gm_free_gil: the same for callers
# that hold the GIL; they never spin with it (try the lock, else wait with the GIL released).
cdef size_t gm_round(const gm_pool* p, size_t nbytes) noexcept nogil
cdef int gm_alloc(gm_pool* p, size_t nbytes, uint64_t stream, gm_block** out) noexcept nogil
cdef int gm_free(gm_pool* p, gm_block* b, uint64_t serial) noexcept nogil
cdef int gm_alloc_gil(gm_pool* p, size_t nbytes, uint64_t stream, gm_block** out) noexcept
cdef int gm_free_gil(gm_pool* p, gm_block* b, uint64_t serial) noexcept
cdef inline size_t gm_block_address(const gm_block* b) noexcept nogil:
    return b.segment.base + b.offset


cdef class CachingPool:
    cdef gm_pool* _p
    cdef size_t segment_size_for(self, size_t rounded) noexcept nogil
    cdef int add_segment_and_alloc(self, uint64_t handle, size_t base, size_t seg_size,
                                   size_t nbytes, uint64_t stream, gm_block** out) except -1
    cdef int grow_segment_and_alloc(self, uint64_t handle, size_t extra, size_t nbytes,
                                    uint64_t stream, gm_block** out) except -1
