"""Harness: a trace's ``.json`` sidecar (phases and metadata, read by ``gpumem.read_trace``
next to ``x.csv.gz``).

The input is the sidecar's bytes, written next to a small valid trace in a private folder.
Allowed outcomes: the trace with its phases, or TraceFormatError (GpuMemoryError). Properties:
every phase lies inside the trace, and ``select`` of each phase gives a valid trace.
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from fuzz import shared_trace_files
from gpumem import read_trace
from gpumem.errors import GpuMemoryError

_DIR = Path(tempfile.mkdtemp(prefix="gpumem-fuzz-sidecar-"))
atexit.register(shutil.rmtree, _DIR, True)
_TRACE = _DIR / "t.csv"
_TRACE.write_text("t_ns,op,id,size\n0,a,0,512\n1,a,1,1024\n2,f,0,512\n3,a,2,64\n4,f,1,1024\n")
_SIDECAR = _DIR / "t.json"


def check(data: bytes) -> None:
    _SIDECAR.write_bytes(data)
    try:
        trace = read_trace(_TRACE)
    except GpuMemoryError:
        return
    for p in trace.phases:
        assert 0 <= p.first_row <= p.end_row <= len(trace)
        part = trace.select(p)
        assert len(part.renumbered()) == len(part)


def seeds() -> Iterable[bytes]:
    for path in shared_trace_files():
        side = path.with_name(path.name[:-len(".csv.gz")] + ".json")
        if side.is_file():
            meta = json.loads(side.read_text())
            meta["phases"] = [{"name": "a", "first_row": 0, "end_row": 3},
                              {"name": "b", "first_row": 2, "end_row": 5}]
            yield json.dumps(meta).encode()
    yield b'{"phases": [{"name": "x", "first_row": 1, "end_row": 1e400}]}'
    yield b'{"phases": [{"name": "x", "first_row": 1, "end_row": Infinity}]}'
    yield b"[" * 5000
    yield b'{"phases": {}}'
