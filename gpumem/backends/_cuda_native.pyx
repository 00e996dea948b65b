# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""The CUDA calls on gpumem's busy paths, made from Cython through ``cuda.bindings.cydriver``
with the GIL released.

Built only where the CUDA headers and cuda-python were present at build time (setup.py decides);
``gpumem.backends.cuda`` uses it when it imports and falls back to the Python-level
``cuda.bindings.driver`` otherwise. The driver library itself is loaded by cuda-python on the
first call, never at import, so this module imports on machines without a GPU.

`NativeDriver` has the calling conventions of ``cuda.bindings.driver``: each function returns
``(CUresult, *outputs)``, with handles and pointers as plain ints. It implements the calls a
device makes per segment, copy, event or context switch, and hands every other attribute (enums,
device queries made once) to the Python module it wraps. A failing call returns the Python
module's ``CUresult`` enum member, so ``gpumem.backends.cuda.check`` names it exactly as before.
"""
from libc.stdint cimport uintptr_t
from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport (CUresult, CUdeviceptr, CUcontext, CUstream, CUevent,
                                     CUDA_SUCCESS)

#: the CUDA version of the headers this module was compiled against (cuda.h's CUDA_VERSION)
cdef extern from "cuda.h":
    int CUDA_VERSION
HEADER_VERSION = CUDA_VERSION


cdef inline uintptr_t _handle(object h) except? 0:
    """A pointer or handle given as an int or as a cuda-python object (CUstream, CUevent...)."""
    return <uintptr_t>int(h) if h is not None else 0


cdef class NativeDriver:
    """``cuda.bindings.driver`` with the per-segment and per-copy calls done in Cython."""

    cdef object _py
    cdef object _result             # the Python module's CUresult enum

    def __init__(self, py_driver) -> None:
        self._py = py_driver
        self._result = py_driver.CUresult

    def __getattr__(self, name):
        return getattr(self._py, name)

    cdef inline object _rc(self, CUresult rc):
        return 0 if rc == CUDA_SUCCESS else self._result(<int>rc)

    # --- contexts -----------------------------------------------------------------------------
    def cuCtxGetCurrent(self):
        cdef CUcontext ctx = NULL
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuCtxGetCurrent(&ctx)
        return self._rc(rc), (None if ctx == NULL else <uintptr_t>ctx)

    def cuCtxPushCurrent(self, ctx):
        cdef CUcontext c = <CUcontext>_handle(ctx)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuCtxPushCurrent(c)
        return (self._rc(rc),)

    def cuCtxPopCurrent(self):
        cdef CUcontext ctx = NULL
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuCtxPopCurrent(&ctx)
        return self._rc(rc), <uintptr_t>ctx

    def cuCtxSynchronize(self):
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuCtxSynchronize()
        return (self._rc(rc),)

    # --- memory -------------------------------------------------------------------------------
    def cuMemGetInfo(self):
        cdef size_t free = 0, total = 0
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuMemGetInfo(&free, &total)
        return self._rc(rc), free, total

    def cuMemAlloc(self, size_t nbytes):
        cdef CUdeviceptr ptr = 0
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuMemAlloc(&ptr, nbytes)
        return self._rc(rc), <uintptr_t>ptr

    def cuMemFree(self, ptr):
        cdef CUdeviceptr p = <CUdeviceptr>_handle(ptr)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuMemFree(p)
        return (self._rc(rc),)

    def cuMemcpyHtoDAsync(self, dst, src, size_t nbytes, stream):
        cdef CUdeviceptr d = <CUdeviceptr>_handle(dst)
        cdef void* s = <void*>_handle(src)
        cdef CUstream st = <CUstream>_handle(stream)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuMemcpyHtoDAsync(d, s, nbytes, st)
        return (self._rc(rc),)

    def cuMemcpyDtoHAsync(self, dst, src, size_t nbytes, stream):
        cdef void* d = <void*>_handle(dst)
        cdef CUdeviceptr s = <CUdeviceptr>_handle(src)
        cdef CUstream st = <CUstream>_handle(stream)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuMemcpyDtoHAsync(d, s, nbytes, st)
        return (self._rc(rc),)

    def cuMemsetD8Async(self, dst, unsigned char value, size_t nbytes, stream):
        cdef CUdeviceptr d = <CUdeviceptr>_handle(dst)
        cdef CUstream st = <CUstream>_handle(stream)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuMemsetD8Async(d, value, nbytes, st)
        return (self._rc(rc),)

    # --- streams and events -------------------------------------------------------------------
    def cuStreamSynchronize(self, stream):
        cdef CUstream st = <CUstream>_handle(stream)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuStreamSynchronize(st)
        return (self._rc(rc),)

    def cuStreamQuery(self, stream):
        cdef CUstream st = <CUstream>_handle(stream)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuStreamQuery(st)
        return (self._rc(rc),)

    def cuEventCreate(self, unsigned int flags):
        cdef CUevent ev = NULL
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuEventCreate(&ev, flags)
        return self._rc(rc), <uintptr_t>ev

    def cuEventRecord(self, event, stream):
        cdef CUevent ev = <CUevent>_handle(event)
        cdef CUstream st = <CUstream>_handle(stream)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuEventRecord(ev, st)
        return (self._rc(rc),)

    def cuEventQuery(self, event):
        cdef CUevent ev = <CUevent>_handle(event)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuEventQuery(ev)
        return (self._rc(rc),)

    def cuEventDestroy(self, event):
        cdef CUevent ev = <CUevent>_handle(event)
        cdef CUresult rc
        with nogil:
            rc = cydriver.cuEventDestroy(ev)
        return (self._rc(rc),)
