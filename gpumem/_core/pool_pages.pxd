# cython: language_level=3
# Internal to gpumem: the pool's unmapped state (pool_pages.pyx), for expandable segments.
# Called by CachingPool (pool.pyx) through this module's capsule table; never on the hot path.
from libc.stdint cimport uint64_t
from gpumem._core.pool_layout cimport gm_pool

cdef list carve_free_pages(gm_pool* p, uint64_t handle, size_t page, const unsigned long long* bd,
                           size_t nb, size_t max_bytes, int any_stream, uint64_t stream,
                           size_t keep_lo, size_t keep_hi, size_t min_offset, double ratio,
                           bint overshoot)
cdef int fill_unmapped(gm_pool* p, uint64_t handle, size_t offset, size_t size,
                       uint64_t stream) except -1
cdef tuple plan_fill(gm_pool* p, uint64_t handle, uint64_t stream, size_t nbytes, size_t page,
                     size_t reservation)
cdef size_t free_page_bytes(gm_pool* p, uint64_t handle, size_t page, const unsigned long long* bd,
                            size_t nb) except? 0
