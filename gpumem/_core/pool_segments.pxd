# cython: language_level=3
# Internal to gpumem: the pool's cold paths over segments (pool_segments.pyx). Called by
# CachingPool (pool.pyx) through this module's capsule table; never on the hot path.
from libc.stdint cimport uint64_t
from gpumem._core.pool_layout cimport gm_pool, gm_segment

ctypedef struct segdesc:             # a detached segment, copied out under the lock
    uint64_t handle
    size_t base
    size_t size
    int is_small
    uint64_t stream

cdef gm_segment* link_new_segment(gm_pool* p, uint64_t handle, size_t base, size_t size,
                                  bint is_small, uint64_t stream, int* hi) noexcept nogil
cdef void detach_segment(gm_pool* p, gm_segment* seg, segdesc* desc) noexcept nogil
cdef size_t reclaim_idle(gm_pool* p, idle_streams, uint64_t into) except? 0
cdef list release_free_segments(gm_pool* p, size_t max_bytes, int small)
cdef list excess_free_segments(gm_pool* p, size_t per_class)
cdef size_t flush_front_caches(gm_pool* p) noexcept
cdef int restore_segment(gm_pool* p, uint64_t handle, size_t base, size_t size, bint is_small,
                         uint64_t stream) except -1
cdef list live_segment_handles(gm_pool* p)
cdef list streams_with_free(gm_pool* p, uint64_t stream)
cdef void destroy_pool(gm_pool* p) noexcept nogil
