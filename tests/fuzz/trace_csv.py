"""Harness: trace files (``gpumem.read_trace``: the ``t_ns,op,id,size`` CSV, plain or gzip).

The input is the file's bytes, read through a binary file object. Allowed outcomes: a
TraceData, or TraceFormatError/InvalidInputError (gpumem.errors.GpuMemoryError). Properties of
a result: the columns agree in length; sizes and ids are >= 0; each free matches a live
allocation of the same size; and writing it with ``write_trace`` and reading that back gives
the same trace (what gpumem accepts, it can write).
"""
from __future__ import annotations

import gzip
import io
from typing import Iterable

import numpy as np

from fuzz import shared_trace_files
from gpumem import read_trace, write_trace
from gpumem.errors import GpuMemoryError


def check(data: bytes) -> None:
    try:
        trace = read_trace(io.BytesIO(data))
    except GpuMemoryError:
        return
    n = len(trace)
    assert len(trace.t_ns) == len(trace.ids) == len(trace.sizes) == n
    assert all(len(col) == n for col in trace.extra.values())
    assert (trace.sizes >= 0).all() and (trace.ids >= 0).all()
    live: dict[int, int] = {}
    for op, i, s in zip(trace.ops.tolist(), trace.ids.tolist(), trace.sizes.tolist()):
        if op == 0:
            assert i not in live
            live[i] = s
        else:
            assert live.pop(i) == s
    out = io.StringIO()
    write_trace(out, trace)
    again = read_trace(io.StringIO(out.getvalue()))
    for name in ("t_ns", "ops", "ids", "sizes"):
        assert np.array_equal(getattr(again, name), getattr(trace, name)), name
    assert again.extra == trace.extra


def seeds() -> Iterable[bytes]:
    """The first rows of every shipped trace (plain and gzip), and a few edge cases."""
    for path in shared_trace_files():
        with gzip.open(path, "rb") as f:
            head = b"".join(f.readline() for _ in range(40))
        yield head
        yield gzip.compress(head, mtime=0)
    yield b"t_ns,op,id,size,stream,device,tag\n0,a,1,512,0,sim:0,x\n5,f,1,512,0,sim:0,\n"
    yield b"\xef\xbb\xbft_ns,op,id,size\r\n1,a,0,0\r\n"
    yield b"t_ns,op,id,size\n"
