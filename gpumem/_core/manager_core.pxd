# cython: language_level=3
"""Layout of ManagerCore (manager_core.pyx): its C-level malloc, cimported by integrations that
build a framework's memory object around a Buffer with no Python call in between
(gpumem/integrations/_cupy_alloc.pyx)."""
from libc.stdint cimport uint64_t

from gpumem._core.buffer cimport Buffer
from gpumem._core.manager_base cimport ManagerBase
from gpumem._core.pool cimport gm_block


cdef class ManagerCore(ManagerBase):
    # malloc after its argument checks: `n` in [0, 2**62), `s` a stream handle; a Buffer, or
    # (`fallback` True and CPU fallback on) a FallbackBuffer; raises OutOfMemoryError
    cdef object _malloc_c(self, long long n, uint64_t s, object tag, bint fallback=*)
    cdef object _malloc_pool(self, long long n, uint64_t s, object tag, bint fallback=*)
    cdef Buffer _wrap(self, gm_block* b, size_t n, uint64_t s, object tag)
