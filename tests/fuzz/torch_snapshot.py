"""Harness: PyTorch memory snapshots (``gpumem.read_torch_snapshot``: the pickle
``torch.cuda.memory._dump_snapshot`` writes; what ``gpumem import-torch`` reads).

Input: first byte even: the rest is the file's bytes (any pickle, or none); odd: the rest
decodes (tests.fuzz.Bytes) into a snapshot-shaped dict of events, pickled with protocol 0-5,
so the fuzzer also reaches the event checks behind a valid pickle. Allowed outcomes: a
TraceData, or InvalidInputError. Property of a result: it is a valid trace (``write_trace``
then ``read_trace`` gives it back).
"""
from __future__ import annotations

import gzip
import io
import pickle
import struct
from typing import Any, Iterable

import numpy as np

from fuzz import Bytes, shared_trace_files
from gpumem import read_torch_snapshot, read_trace, write_trace
from gpumem.errors import GpuMemoryError

_ACTIONS = ("alloc", "free_completed", "free_requested", "segment_alloc", "segment_free",
            "snapshot", "oom", "teleport")
_VALUES: tuple[Any, ...] = (0, 1, 512, 4096, 1 << 20, 1 << 40, (1 << 63) - 1, 1 << 63,
                            1 << 64, -1, -(1 << 63), 2.5, True, None, "0x10", b"\x00", [], {})


def _value(b: Bytes) -> Any:
    k = b.byte()
    if k < 160:
        return (k % 16) * 512                 # a few addresses and sizes, so pairs match
    if k < 200:
        return _VALUES[k % len(_VALUES)]
    if k < 230:
        return b.uint(8)
    return b.text(16)


def _structured(b: Bytes) -> bytes:
    events = []
    for _ in range(b.below(40)):
        e: dict[Any, Any] = {"action": _ACTIONS[b.below(len(_ACTIONS))]}
        for key in ("addr", "size", "time_us", "stream"):
            if b.byte() % 8:                  # mostly present
                e[key] = _value(b)
        if b.flag():
            e["frames"] = [{"filename": "a.py", "line": b.byte(), "name": "f"}]
        events.append(e)
    ndev = b.below(3) + 1
    traces: list[list] = [[] for _ in range(ndev)]
    traces[b.below(ndev)] = events
    snap: Any = {"segments": [], "device_traces": traces}
    if b.byte() == 255:
        snap = events                         # not a dict at all
    return pickle.dumps(snap, protocol=b.below(6))


def check(data: bytes) -> None:
    b = Bytes(data)
    raw = _structured(b) if b.byte() % 2 else b.rest()
    try:
        trace = read_torch_snapshot(io.BytesIO(raw))
    except GpuMemoryError:
        return
    out = io.StringIO()
    write_trace(out, trace)
    again = read_trace(io.StringIO(out.getvalue()))
    for name in ("t_ns", "ops", "ids", "sizes"):
        assert np.array_equal(getattr(again, name), getattr(trace, name)), name


def snapshot_of(rows: list[tuple[int, str, int, int]], protocol: int) -> bytes:
    """A PyTorch-layout snapshot pickle of trace rows (t_ns, op, id, size): each allocation at
    its own address, each free as free_requested + free_completed, with a stack frame."""
    addr: dict[int, int] = {}
    top = 1 << 32
    events = []
    frame = [{"filename": "train.py", "line": 12, "name": "forward"}]
    for t, op, i, size in rows:
        common = {"size": size, "stream": 0, "time_us": t // 1000, "frames": frame}
        if op == "a":
            addr[i], top = top, top + max(512, size)
            events.append({"action": "alloc", "addr": addr[i], **common})
        elif i in addr:
            a = addr.pop(i)
            events.append({"action": "free_requested", "addr": a, **common})
            events.append({"action": "free_completed", "addr": a, **common})
    snap = {"segments": [], "device_traces": [events],
            "allocator_settings": {"segment_pool_id": (0, 0)}}
    return pickle.dumps(snap, protocol=protocol)


def bombs() -> Iterable[bytes]:
    """Pickles whose unpickling would not be proportional to their size: a 2**80-leaf tuple
    shared through the memo used as a dict key (exponential hashing), and a memo index of
    2**31 (CPython's unpickler would zero a 16 GiB memo array)."""
    ops = bytearray(b"\x80\x02)q\x000")                 # t0 = () in memo 0
    for k in range(1, 81):                               # t_k = (t_k-1, t_k-1) in memo k
        ops += b"h" + bytes([k - 1]) + b"h" + bytes([k - 1]) + b"\x86q" + bytes([k]) + b"0"
    yield bytes(ops) + b"}hPK\x01s."                     # {t_80: 1}
    yield b"\x80\x02]r" + struct.pack("<I", 1 << 31) + b"."


def seeds() -> Iterable[bytes]:
    for path in shared_trace_files():
        with gzip.open(path, "rt") as f:
            next(f)
            rows = []
            for line in f:
                t, op, i, size = line.strip().split(",")[:4]
                rows.append((int(t), op, int(i), int(size)))
                if len(rows) == 60:
                    break
        for protocol in (2, 4):
            yield b"\x00" + snapshot_of(rows, protocol)
    for bomb in bombs():
        yield b"\x00" + bomb
    yield b"\x01" + bytes(range(64))
