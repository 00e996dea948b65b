# cython: language_level=3
"""DLPack capsules: the C half of ``__dlpack__`` for gpumem views.

The structs below follow ``dlpack.h`` version 1.0 (github.com/dmlc/dlpack) field for field; the
capsule names and the ownership rules are the Python specification's
(dmlc.github.io/dlpack/latest/python_spec.html):

- ``max_version >= (1, 0)`` asked by the consumer: a ``DLManagedTensorVersioned`` in a capsule
  named ``"dltensor_versioned"``; otherwise the legacy ``DLManagedTensor`` in ``"dltensor"``.
- A consumer renames the capsule ``"used_..."`` and calls the tensor's ``deleter`` when it is
  done. A capsule destroyed without being consumed calls the deleter itself.
- ``manager_ctx`` holds one strong reference to the producer's owner object (a BufferView, which
  keeps its Buffer alive and counted as exported). The deleter drops it, taking the GIL: a
  consumer may call it from any thread, with or without the GIL. After interpreter shutdown it
  frees only the C memory (the reference is leaked: nothing can run Python code then).

One malloc per capsule holds the managed tensor and its shape and strides arrays.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

__all__ = ["make_capsule", "DLPACK_VERSION", "FLAG_READ_ONLY"]

DLPACK_VERSION = (1, 0)
FLAG_READ_ONLY = 1            # DLPACK_FLAG_BITMASK_READ_ONLY

cdef struct DLDevice:
    int32_t device_type       # DLDeviceType, a C enum (int-sized)
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides          # in elements, not bytes
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor*) noexcept nogil

cdef struct DLPackVersion:
    uint32_t major
    uint32_t minor

cdef struct DLManagedTensorVersioned:
    DLPackVersion version
    void* manager_ctx
    void (*deleter)(DLManagedTensorVersioned*) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor


cdef void _drop_owner(void* ctx) noexcept nogil:
    if ctx == NULL or not Py_IsInitialized():
        return
    with gil:
        Py_XDECREF(<PyObject*>ctx)


cdef void _delete_legacy(DLManagedTensor* t) noexcept nogil:
    if t == NULL:
        return
    _drop_owner(t.manager_ctx)
    free(t)


cdef void _delete_versioned(DLManagedTensorVersioned* t) noexcept nogil:
    if t == NULL:
        return
    _drop_owner(t.manager_ctx)
    free(t)


cdef void _legacy_capsule_gone(object capsule) noexcept:
    # Renamed "used_dltensor" by a consumer: the consumer owns the tensor now.
    if PyCapsule_IsValid(capsule, b"dltensor"):
        _delete_legacy(<DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor"))


cdef void _versioned_capsule_gone(object capsule) noexcept:
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        _delete_versioned(<DLManagedTensorVersioned*>PyCapsule_GetPointer(
            capsule, b"dltensor_versioned"))


cdef int _fill(DLTensor* t, int64_t* arrays, size_t data, int device_type, int device_id,
               tuple shape, tuple strides, int code, int bits) except -1:
    cdef Py_ssize_t i, ndim = len(shape)
    t.data = <void*>data
    t.device.device_type = device_type
    t.device.device_id = device_id
    t.ndim = <int32_t>ndim
    t.dtype.code = <uint8_t>code
    t.dtype.bits = <uint8_t>bits
    t.dtype.lanes = 1
    t.shape = arrays
    t.strides = arrays + ndim
    t.byte_offset = 0
    for i in range(ndim):
        arrays[i] = shape[i]
        arrays[ndim + i] = strides[i]
    return 0


def make_capsule(object owner, size_t data, int device_type, int device_id, tuple shape,
                 tuple strides, int code, int bits, bint readonly, bint versioned):
    """A DLPack capsule for ``shape`` elements of (``code``, ``bits``) at address ``data``.

    ``strides`` are in elements, one per dimension; ``owner`` is kept alive until the
    consumer's deleter runs (or the unconsumed capsule is destroyed). ``readonly`` can only be
    signalled by a versioned capsule (the caller refuses it for a legacy one)."""
    cdef Py_ssize_t ndim = len(shape)
    cdef size_t arrays = 2 * ndim * sizeof(int64_t)
    cdef DLManagedTensorVersioned* v
    cdef DLManagedTensor* t
    if len(strides) != ndim:
        raise ValueError(f"strides has {len(strides)} entries for {ndim} dimensions")
    if bits <= 0 or bits > 255:
        raise ValueError(f"DLPack element width must be 1..255 bits, got {bits}")
    if versioned:
        v = <DLManagedTensorVersioned*>malloc(sizeof(DLManagedTensorVersioned) + arrays)
        if v == NULL:
            raise MemoryError("no host memory for a DLPack tensor")
        memset(v, 0, sizeof(DLManagedTensorVersioned))
        try:
            _fill(&v.dl_tensor, <int64_t*>(v + 1), data, device_type, device_id, shape,
                  strides, code, bits)
            capsule = PyCapsule_New(v, b"dltensor_versioned", _versioned_capsule_gone)
        except BaseException:     # nothing owns v yet
            free(v)
            raise
        v.version.major = DLPACK_VERSION[0]
        v.version.minor = DLPACK_VERSION[1]
        v.flags = FLAG_READ_ONLY if readonly else 0
        v.deleter = _delete_versioned
        Py_INCREF(owner)
        v.manager_ctx = <void*>owner
        return capsule
    t = <DLManagedTensor*>malloc(sizeof(DLManagedTensor) + arrays)
    if t == NULL:
        raise MemoryError("no host memory for a DLPack tensor")
    memset(t, 0, sizeof(DLManagedTensor))
    try:
        _fill(&t.dl_tensor, <int64_t*>(t + 1), data, device_type, device_id, shape, strides,
              code, bits)
        capsule = PyCapsule_New(t, b"dltensor", _legacy_capsule_gone)
    except BaseException:
        free(t)
        raise
    t.deleter = _delete_legacy
    Py_INCREF(owner)
    t.manager_ctx = <void*>owner
    return capsule
