"""Harness: the argument checks of ``Buffer.view(dtype, shape, strides, offset, readonly=)`` and
of ``BufferView.__dlpack__(stream=, max_version=, dl_device=, copy=)``
(gpumem/_core/view.pyx, dlpack.pyx), on a 4 KiB buffer of host memory (the ``cpu`` device).

The input decodes (tests.fuzz.Bytes) into the arguments: dtypes from a list or free text,
shapes and strides from values around the limits (0, the buffer size, 2**62, 2**63, 2**64,
negatives), sometimes of the wrong type. Allowed outcomes: a view (and a capsule), or a
GpuMemoryError subclass; besides, as documented (docs/integrations.md) and as the protocols
require, ``TypeError`` when an argument has the wrong type (only then: the harness knows when
it passed one) and ``BufferError`` from ``__dlpack__`` (the array API's exception for an
export that cannot be made). Properties: every element of a view lies inside the buffer (numpy's
byte bounds of the array made from it), and when the view, its array and its capsule are
gone the buffer counts no export.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from fuzz import Bytes
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import GpuMemoryError

_MM = MemoryManager("cpu", MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                                        cpu_fallback_enabled=False))
_BUF = _MM.malloc(4096)
_DTYPES = ("uint8", "int16", "<i4", ">i4", "f8", "c16", "bool", "S3", "U2", "V7", "f16",
           "i4,f8", "(2,)i4", "O", "S0", "datetime64[ns]", "float128", "m8", "e", "xyz", "")
_INTS = (0, 1, 2, 3, 4, 7, 8, 16, 4095, 4096, 4097, -1, -8, 1 << 31, (1 << 62) - 1, 1 << 62,
         1 << 63, 1 << 64, -(1 << 63), 2048, 512)
_WRONG: tuple[Any, ...] = (1.5, "3", True, b"\x01", object(), [1, "2"], None)
_STREAMS: tuple[Any, ...] = (None, -1, 0, 1, 2, 5, "x", 1.5)
_MAX_VERSIONS: tuple[Any, ...] = (None, (1, 0), (0, 8), (2, 1), (1,), (), 5, "x", [1, 0])
_DL_DEVICES: tuple[Any, ...] = (None, (1, 0), (2, 0), (3, 0), (1,), (1, 0, 0), "x", 5,
                                (1.5, 0))
_COPIES: tuple[Any, ...] = (None, False, True, 1)
# numpy 2 moved it (numpy >= 1.22 is supported)
_byte_bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or \
    getattr(np, "byte_bounds")


def _ints(b: Bytes) -> tuple[Any, bool]:
    """A shape or strides argument, and whether its type is wrong."""
    k = b.byte()
    if k < 16:
        return None, False
    if k < 40:
        return b.pick(_INTS), False
    if k < 56:
        w = b.pick(_WRONG)
        return w, w is not None
    items = tuple(b.pick(_INTS) if b.byte() < 250 else b.pick(_WRONG)
                  for _ in range(b.below(5)))
    wrong = any(not isinstance(v, int) or isinstance(v, bool) for v in items)
    return (list(items) if b.flag() else items), wrong


def check(data: bytes) -> None:
    b = Bytes(data)
    dtype = b.pick(_DTYPES) if b.byte() < 230 else b.text(12)
    shape, wrong_shape = _ints(b)
    strides, wrong_strides = _ints(b)
    offset: Any = b.pick(_INTS) if b.byte() < 240 else b.pick(_WRONG)
    wrong_offset = not isinstance(offset, int) or isinstance(offset, bool)
    readonly = b.flag()
    try:
        view = _BUF.view(dtype, shape, strides, offset, readonly=readonly)
    except GpuMemoryError:
        return
    except TypeError:
        assert wrong_shape or wrong_strides or wrong_offset, (dtype, shape, strides, offset)
        return
    try:
        arr = np.asarray(view)
        assert arr.shape == view.shape and arr.dtype == view.dtype
        if arr.size:
            lo, hi = _byte_bounds(arr)
            assert _BUF.ptr <= lo and hi <= _BUF.ptr + _BUF.nbytes, (view, lo, hi)
        kwargs = dict(stream=b.pick(_STREAMS), max_version=b.pick(_MAX_VERSIONS),
                      dl_device=b.pick(_DL_DEVICES), copy=b.pick(_COPIES))
        try:
            capsule = view.__dlpack__(**kwargs)
        except (GpuMemoryError, BufferError):
            pass
        except TypeError:
            wrong = (kwargs["max_version"] in (5, "x", (1,), ()) or
                     kwargs["dl_device"] in ("x", 5, (1.5, 0)) or kwargs["copy"] == 1 and
                     kwargs["copy"] is not True)
            assert wrong, kwargs
        else:
            del capsule
        del arr
    finally:
        del view
    assert _BUF.exports == 0


def seeds() -> Iterable[bytes]:
    yield b""
    for d in range(len(_DTYPES)):
        yield bytes([d, 100, 3, 9, 8, 100, 2, 1, 0, 0, 0, 0])
    yield bytes([0, 20, 9, 20, 1, 3, 1, 1, 1, 1])
