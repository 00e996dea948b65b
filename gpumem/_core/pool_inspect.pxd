# cython: language_level=3
# Internal to gpumem: the pool's introspection (pool_inspect.pyx), called by CachingPool
# (pool.pyx) through this module's capsule table; never on the hot path.
from gpumem._core.pool_layout cimport gm_pool

cdef object counters(gm_pool* p, bint consistent)
cdef size_t in_use_bytes(gm_pool* p) noexcept nogil
cdef size_t largest_free_block(gm_pool* p) noexcept
cdef list segments(gm_pool* p)
cdef int check_invariants(gm_pool* p) except -1
