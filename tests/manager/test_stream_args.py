"""``stream=`` accepts a stream from any framework (malloc, record_stream, allocate_batch...).

Level: real (the sim device and the real pool). The framework streams are small stand-in
classes shaped like each framework's stream object, not the frameworks themselves:
PyTorch's ``torch.cuda.Stream`` (``.cuda_stream``), CuPy's ``cupy.cuda.Stream`` (``.ptr``),
cuda.core's ``Stream`` (the ``__cuda_stream__()`` protocol: ``(version, handle)``; its
``.handle`` is a ``CUstream``, which has ``__index__``), and any object with an int
``.handle``.
"""
from __future__ import annotations

import numpy as np
import pytest

from gpumem import InvalidInputError


class TorchLikeStream:
    def __init__(self, h: int) -> None:
        self.cuda_stream = h
        self.device = "cuda:0"


class CupyLikeStream:
    def __init__(self, h: int) -> None:
        self.ptr = h


class CudaCoreLikeStream:
    def __init__(self, h: int, version: int = 0) -> None:
        self._h, self._v = h, version
        self.handle = CUstreamLike(h + 1)    # must lose to __cuda_stream__

    def __cuda_stream__(self):
        return (self._v, self._h)


class CUstreamLike:
    """Like cuda.bindings.driver.CUstream: an opaque handle with __index__/__int__."""

    def __init__(self, h: int) -> None:
        self._h = h

    def __index__(self) -> int:
        return self._h


class HandleStream:
    def __init__(self, h) -> None:
        self.handle = h


FORMS = {
    "torch .cuda_stream": TorchLikeStream,
    "cupy .ptr": CupyLikeStream,
    "cuda.core __cuda_stream__": CudaCoreLikeStream,
    ".handle int": HandleStream,
    ".handle CUstream": lambda h: HandleStream(CUstreamLike(h)),
    "CUstream itself": CUstreamLike,
    "numpy integer": np.uint64,
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_framework_stream_names_the_same_stream(manager, form):
    s = manager.device.create_stream()
    obj = FORMS[form](s)
    buf = manager.malloc(4096, stream=obj)
    assert buf.stream == s
    other = manager.device.create_stream()
    buf.record_stream(FORMS[form](other))
    assert buf.used_on_streams == (other,)
    buf.free()
    assert manager._stream_handle(obj) == s


@pytest.mark.parametrize("stream, exc, words", [
    (object(), TypeError, r"__cuda_stream__\(\) \(cuda.core\), .cuda_stream \(PyTorch\), "
                          r".ptr \(CuPy\), .handle \(gpumem, cuda.core\); got object"),
    ("3", TypeError, "got str"),
    (2.0, TypeError, "got float"),
    (True, TypeError, "not a bool"),
    (CupyLikeStream("abc"), TypeError, r"CupyLikeStream.ptr must be an int, got str"),
    (TorchLikeStream(1.5), TypeError, r"TorchLikeStream.cuda_stream must be an int"),
    (HandleStream(True), TypeError, r"HandleStream.handle must be an int, got bool"),
    (CudaCoreLikeStream(5, version=1), InvalidInputError, "protocol version 1"),
    (type("Bad", (), {"__cuda_stream__": lambda self: 5})(), InvalidInputError,
     r"must return a \(version, handle\) tuple, got 5"),
    (type("Bad", (), {"__cuda_stream__": lambda self: (0, "x")})(), TypeError,
     r"__cuda_stream__\(\) must be an int, got str"),
    (-1, InvalidInputError, r"\[0, 2\*\*64\)"),
    (CupyLikeStream(1 << 64), InvalidInputError, r"\[0, 2\*\*64\)"),
])
def test_wrong_stream_objects_are_refused_and_change_nothing(manager, stream, exc, words):
    in_use = manager.pool.in_use_bytes
    with pytest.raises(exc, match=words):
        manager.malloc(64, stream=stream)
    assert manager.pool.in_use_bytes == in_use
    buf = manager.malloc(64)
    with pytest.raises(exc, match=words):
        buf.record_stream(stream)
    assert buf.used_on_streams == ()
    buf.free()


def test_an_unknown_handle_is_refused_by_the_device(manager):
    with pytest.raises(InvalidInputError, match="not a stream of sim:0"):
        manager.malloc(64, stream=CupyLikeStream(987654))
