"""DLPack's C structs read through ctypes, written from dlpack.h (v1.0) independently of
gpumem's Cython declarations: a test that reads a capsule with these checks gpumem's layout
against the header's, and ``consume`` does what a C consumer does with a capsule."""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64
from ctypes import c_void_p, py_object
from typing import Any

__all__ = ["DLManagedTensor", "DLManagedTensorVersioned", "capsule_name", "tensor_of",
           "consume", "summary"]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p),
                            ("deleter", ctypes.CFUNCTYPE(None, POINTER(DLManagedTensor)))]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion), ("manager_ctx", c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))),
    ("flags", c_uint64), ("dl_tensor", DLTensor)]

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = c_char_p
_api.PyCapsule_GetName.argtypes = [py_object]
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [py_object, c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [py_object, c_char_p]

_USED = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}


def capsule_name(capsule: Any) -> str:
    return _api.PyCapsule_GetName(capsule).decode()


def tensor_of(capsule: Any) -> Any:
    """The DLManagedTensor(Versioned) a fresh capsule points to (by its name)."""
    name = _api.PyCapsule_GetName(capsule)
    kind = DLManagedTensorVersioned if name == b"dltensor_versioned" else DLManagedTensor
    return ctypes.cast(_api.PyCapsule_GetPointer(capsule, name), POINTER(kind)).contents


def summary(capsule: Any) -> dict[str, Any]:
    """The fields of a fresh capsule's tensor as Python values."""
    m = tensor_of(capsule)
    t = m.dl_tensor
    out = {"data": t.data or 0, "device": (t.device.device_type, t.device.device_id),
           "ndim": t.ndim, "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
           "shape": tuple(t.shape[i] for i in range(t.ndim)),
           "strides": tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None,
           "byte_offset": t.byte_offset, "has_deleter": bool(m.deleter)}
    if isinstance(m, DLManagedTensorVersioned):
        out["version"] = (m.version.major, m.version.minor)
        out["flags"] = m.flags
    return out


def consume(capsule: Any) -> None:
    """What a consumer does: rename the capsule "used_...", then (when done with the data)
    call the tensor's deleter. ctypes calls the deleter without the GIL."""
    m = tensor_of(capsule)
    assert _api.PyCapsule_SetName(capsule, _USED[_api.PyCapsule_GetName(capsule)]) == 0
    m.deleter(ctypes.pointer(m))
