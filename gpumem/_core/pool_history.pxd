# cython: language_level=3
# Internal to gpumem: the pool's history rings, set up and exported (pool_history.pyx); called
# by CachingPool (pool.pyx) through this module's capsule table, never on the hot path.
from gpumem._core.pool_layout cimport gm_pool

cdef int set_history(gm_pool* p, events) except -1
cdef dict history(gm_pool* p, last)
