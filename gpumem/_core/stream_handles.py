"""How a stream object of another framework becomes gpumem's integer stream handle.

``ManagerCore._stream_handle`` (buffer.pyx) takes ints itself and calls
:func:`foreign_stream_handle` for anything else. Stateless, so safe from any thread.
"""
from __future__ import annotations

import operator
from typing import Any

from gpumem.errors import InvalidInputError

__all__ = ["foreign_stream_handle"]

#: Attributes holding a stream's handle, in the order they are tried after ``__cuda_stream__``.
HANDLE_ATTRIBUTES = (("cuda_stream", "PyTorch"), ("ptr", "CuPy"), ("handle", "gpumem, cuda.core"))


def foreign_stream_handle(stream: Any) -> int:
    """The handle of another framework's stream object, tried in this order:
    ``__cuda_stream__()`` (cuda.core's protocol: ``(version 0, handle)``), ``.cuda_stream``
    (PyTorch), ``.ptr`` (CuPy), ``.handle`` (gpumem, cuda.core; may be a ``CUstream``, which
    has ``__index__``). TypeError when none is there or the handle is no int;
    InvalidInputError for a malformed ``__cuda_stream__`` answer. The range is the caller's
    check."""
    kind = type(stream).__name__
    method = getattr(stream, "__cuda_stream__", None)
    if method is not None:
        source = "__cuda_stream__()"
        answer = method()
        if (type(answer) is not tuple or len(answer) != 2 or isinstance(answer[0], bool)
                or not hasattr(answer[0], "__index__")):
            raise InvalidInputError(f"{kind}.__cuda_stream__() must return a (version, handle) "
                                    f"tuple, got {answer!r}")
        if answer[0] != 0:
            raise InvalidInputError(f"{kind}.__cuda_stream__() has protocol version "
                                    f"{answer[0]}; gpumem understands version 0")
        value = answer[1]
    else:
        for attr, _framework in HANDLE_ATTRIBUTES:
            value = getattr(stream, attr, None)
            if value is not None:
                source = "." + attr
                break
        else:
            forms = ", ".join(f".{a} ({f})" for a, f in HANDLE_ATTRIBUTES)
            raise TypeError(f"stream must be None, an int handle or a stream object with "
                            f"__cuda_stream__() (cuda.core), {forms}; got {kind}")
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"the stream handle from {kind}{source} must be an int, got "
                        f"{type(value).__name__} {value!r}")
    return operator.index(value)
