"""Reading a file someone else wrote takes time and memory proportional to its size, whatever
it says (issue 24). Level: real (gpumem's readers and its command line on crafted files).

The stated bounds (docs/testing.md), each tested here:

- a trace (``read_trace``) of N bytes: at most ``TRACE_BYTES_PER_BYTE`` bytes of memory per
  byte of text, one pass; a gzip trace may inflate at most ``MAX_EXPANSION`` (64) times (real
  traces: 3 to 9 times), and a larger inflation is refused before any row is kept;
- a PyTorch snapshot (``read_torch_snapshot``): at most ``PICKLE_BYTES_PER_BYTE`` bytes per
  byte of pickle, one pass to check the opcodes and one to unpickle; what would take more
  (a memo index past the file, a dict key that is a shared nested tuple, a declared length
  past the data) is refused; nesting depth and integer size cost nothing extra;
- ``gpumem import-torch`` and ``gpumem replay`` answer such a file with one line and exit 2.

Memory is measured with tracemalloc (numpy's and the pickle module's allocations included);
a bomb "answered quickly" takes well under the 10 s given here where the unbounded reading
would take hours or exhaust memory.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import time
import tracemalloc

import pytest

from gpumem import read_torch_snapshot, read_trace
from gpumem.cli import main
from gpumem.errors import InvalidInputError, TraceFormatError

TRACE_BYTES_PER_BYTE = 24
PICKLE_BYTES_PER_BYTE = 120
# seconds a bomb may take; under ci/sanitize.sh (GPUMEM_TEST_SANITIZED=1, every malloc checked
# and traced) four times as long
QUICK_S = 10 * (4 if os.environ.get("GPUMEM_TEST_SANITIZED") else 1)


def _peak(fn) -> tuple[int, float, object]:
    """(peak traced bytes, seconds, result or the exception raised) of fn()."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        out = fn()
    except Exception as exc:        # the caller checks which
        out = exc
    took = time.monotonic() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, took, out


def _u(text: str) -> bytes:         # a BINUNICODE opcode
    b = text.encode()
    return b"X" + struct.pack("<I", len(b)) + b


# --- traces ---------------------------------------------------------------------------------
def test_trace_memory_is_a_small_multiple_of_its_size():
    """The costliest rows per byte: short allocations never freed (every id stays live). 2 MB
    of them take at most TRACE_BYTES_PER_BYTE bytes of memory per byte."""
    rows = b"".join(b"%d,a,%d,0\n" % (i % 10, i) for i in range(200_000))
    data = b"t_ns,op,id,size\n" + rows
    peak, _, trace = _peak(lambda: read_trace(io.BytesIO(data)))
    assert len(trace) == 200_000
    assert peak <= TRACE_BYTES_PER_BYTE * len(data), peak / len(data)


def test_gzip_bomb_is_refused_before_any_row_is_kept():
    """200 MB of one row repeated compress to ~200 KB (1,000-fold): refused, quickly, with
    memory far below what its rows would take (the check inflates and counts, keeping
    nothing). A real trace inflates 3 to 9 times (gpumem/data/traces) and is read."""
    bomb = gzip.compress(b"t_ns,op,id,size\n" + b"\n" * (200 << 20), compresslevel=9, mtime=0)
    peak, took, out = _peak(lambda: read_trace(io.BytesIO(bomb)))
    assert isinstance(out, TraceFormatError) and "64-fold" in str(out)
    assert took < QUICK_S and peak < 8 << 20


def test_numbers_of_any_length_are_answered_per_line():
    """A 4,000-digit t_ns, a 100,000-digit size: one error naming the line, a short message."""
    for row in (b"9" * 4000 + b",a,0,1", b"1,a,0," + b"9" * 100_000, b"1,a,0,9223372036854775808"):
        with pytest.raises(TraceFormatError, match="<trace>:2: ") as err:
            read_trace(io.BytesIO(b"t_ns,op,id,size\n" + row + b"\n"))
        assert len(str(err.value)) < 300


# --- PyTorch snapshots ------------------------------------------------------------------------
def test_snapshot_memory_is_a_small_multiple_of_its_size():
    """The costliest objects per pickle byte: a list of 500,000 empty dicts (one opcode byte
    each). Unpickled and refused as not a snapshot, within PICKLE_BYTES_PER_BYTE per byte."""
    data = b"\x80\x04(" + b"}" * 500_000 + b"l."
    peak, _, out = _peak(lambda: read_torch_snapshot(io.BytesIO(data)))
    assert isinstance(out, InvalidInputError) and "a list of 500000 items" in str(out)
    assert peak <= PICKLE_BYTES_PER_BYTE * len(data), peak / len(data)


def _bombs() -> dict[str, bytes]:
    shared = bytearray(b"\x80\x02)q\x000")                    # t0 = (); t_k = (t_k-1, t_k-1)
    for k in range(1, 81):
        shared += b"h" + bytes([k - 1]) + b"h" + bytes([k - 1]) + b"\x86q" + bytes([k]) + b"0"
    return {
        # {t_80: 1}: hashing the key walks 2**80 leaves
        "shared tuple key": bytes(shared) + b"}hPK\x01s.",
        # the same tuple as a set item
        "shared tuple in a set": bytes(shared) + b"\x8f(hP\x90.",
        # CPython's unpickler would allocate and zero a 16 GiB memo array
        "memo index 2**31": b"\x80\x02]r" + struct.pack("<I", 1 << 31) + b".",
        # 2**62 bytes declared, 10 present
        "declared length": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"0123456789.",
        # a 1 MB int used as a dict key 100,000 times: its hash is not cached (quadratic)
        "big int key": b"\x80\x02}\x8b" + struct.pack("<I", 1 << 20) + b"\x01" * (1 << 20)
                       + b"q\x00(" + b"h\x00K\x01" * 100_000 + b"u.",
    }


@pytest.mark.parametrize("name", list(_bombs()))
def test_snapshot_bombs_are_refused_quickly(name, tmp_path):
    """Each pickle would make an unchecked unpickler run for hours or exhaust memory; it is an
    InvalidInputError within a second or so, using memory of the order of the file."""
    data = _bombs()[name]
    peak, took, out = _peak(lambda: read_torch_snapshot(io.BytesIO(data)))
    assert isinstance(out, InvalidInputError), out
    assert "not a PyTorch memory snapshot" in str(out) and len(str(out)) < 400
    assert took < QUICK_S and peak < 16 * len(data) + (4 << 20), (took, peak)


def test_deep_nesting_and_huge_ints_cost_nothing_extra():
    """A stream value nested 100,000 lists deep and an address of 8 million bits: answered
    (no RecursionError, no 4,300-digit limit hit while describing them) with short messages."""
    deep = b"]" * 100_000 + b"a" * 99_999
    head = b"\x80\x02}" + _u("device_traces") + b"]]}(" + _u("action") + _u("alloc")
    nested = head + _u("addr") + b"K\x10" + _u("size") + b"K\x08" + _u("stream") + deep + \
        b"uaas."
    huge = head + _u("addr") + b"\x8b" + struct.pack("<I", 1 << 20) + b"\x01" * (1 << 20) + \
        _u("size") + b"K\x08uaas."
    for data, message in ((nested, "'stream' must be an int"), (huge, "an int of")):
        started = time.monotonic()
        with pytest.raises(InvalidInputError, match=message) as err:
            read_torch_snapshot(io.BytesIO(data))
        assert time.monotonic() - started < QUICK_S and len(str(err.value)) < 400


# --- the command line ---------------------------------------------------------------------------
def test_cli_answers_bad_files_with_one_line_and_exit_2(tmp_path, capsys):
    """import-torch of each bomb, and replay of the gzip bomb: exit 2, one line on stderr."""
    out = tmp_path / "out.csv"
    for name, data in _bombs().items():
        snap = tmp_path / "snap.pickle"
        snap.write_bytes(data)
        assert main(["import-torch", str(snap), "-o", str(out)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gpumem: error: ") and "snap.pickle" in err[0]
    assert not out.exists()
    trace = tmp_path / "bomb.csv.gz"
    trace.write_bytes(gzip.compress(b"t_ns,op,id,size\n" + b"\n" * (100 << 20), mtime=0))
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decompression bomb" in err[0]
    ok = tmp_path / "snap.pickle"
    ok.write_bytes(pickle.dumps({"device_traces": [[
        {"action": "alloc", "addr": 16, "size": 512, "stream": 0, "time_us": 1}]]}))
    assert main(["import-torch", str(ok), "-o", str(out)]) == 0
