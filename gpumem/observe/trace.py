"""Allocation traces: read, validate, slice and write the ``t_ns,op,id,size`` CSV format.

The format is the one of ``gpumem/data/traces`` (real PyTorch allocation streams) and of
:meth:`gpumem.MemoryManager.record_history`:

- a header whose first four columns are ``t_ns,op,id,size``; more columns may follow (gpumem
  writes ``stream``, ``device``, ``tag`` when asked), and readers keep them as strings;
- one row per event, in event order: ``op`` is ``a`` (allocation) or ``f`` (free), ``id`` pairs a
  free with its allocation, ``size`` is the requested byte count (repeated on the free);
- plain text, or gzip when the file starts with the gzip magic bytes (``.csv.gz``).

:func:`read_trace` validates everything a replay relies on and raises
:class:`gpumem.errors.TraceFormatError` naming the file and the line: a bad header, an unknown op,
a non-integer or negative field, an allocation of an id that is still live, a free of an id that
is not live, a free whose size differs from its allocation, a truncated or corrupt gzip stream.

A trace may end with live allocations (``allocs_never_freed``); a replay frees them at the end.
Phases (``materialize``, ``step0``...) come from the ``.json`` sidecar next to the file when there
is one (:func:`load_phases`); :meth:`TraceData.select` cuts a self-contained slice out of a trace.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import os
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, NamedTuple, Sequence, Union

import numpy as np

from gpumem.errors import InvalidInputError, TraceFormatError, brief

__all__ = ["TraceEvent", "Phase", "TraceData", "read_trace", "write_trace", "load_phases",
           "HEADER", "OP_ALLOC", "OP_FREE"]

HEADER = ("t_ns", "op", "id", "size")
#: values of :attr:`TraceData.ops`
OP_ALLOC = 0
OP_FREE = 1
_GZIP_MAGIC = b"\x1f\x8b"
_INT64 = (-(1 << 63), 1 << 63)
#: a gzip trace may inflate this many times its size (plus 1 MiB): reading a file of N bytes
#: then takes time and memory proportional to N, whatever it holds (docs/testing.md)
MAX_EXPANSION = 64

PathOrFile = Union[str, "os.PathLike[str]", IO[str], IO[bytes]]


class TraceEvent(NamedTuple):
    """One row: ``op`` is ``"a"`` or ``"f"``."""

    t_ns: int
    op: str
    id: int
    size: int


@dataclass(frozen=True)
class Phase:
    """A named row range ``[first_row, end_row)`` of a trace (rows count data lines from 0)."""

    name: str
    first_row: int
    end_row: int

    def __len__(self) -> int:
        return self.end_row - self.first_row


@dataclass
class TraceData:
    """A validated trace as numpy arrays (one element per event, in event order).

    ``ops`` holds :data:`OP_ALLOC` (0) / :data:`OP_FREE` (1); ``extra`` maps each extra column
    name to a list of strings. ``name`` is the file's name (or ``"<trace>"``).
    """

    t_ns: np.ndarray
    ops: np.ndarray
    ids: np.ndarray
    sizes: np.ndarray
    name: str = "<trace>"
    path: str | None = None
    extra: dict[str, list[str]] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    # --- basic views ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[TraceEvent]:
        opname = ("a", "f")
        for t, o, i, s in zip(self.t_ns.tolist(), self.ops.tolist(), self.ids.tolist(),
                              self.sizes.tolist()):
            yield TraceEvent(t, opname[o], i, s)

    def __repr__(self) -> str:
        return (f"<TraceData {self.name}: {len(self)} events, {self.n_allocs} allocs, "
                f"peak live {self.peak_live_bytes} B>")

    @property
    def n_allocs(self) -> int:
        return int(np.count_nonzero(self.ops == OP_ALLOC))

    @property
    def n_frees(self) -> int:
        return int(np.count_nonzero(self.ops == OP_FREE))

    def live_bytes(self) -> np.ndarray:
        """Live requested bytes after each event (int64 array)."""
        signed = np.where(self.ops == OP_ALLOC, self.sizes, -self.sizes)
        return np.cumsum(signed, dtype=np.int64)

    @property
    def peak_live_bytes(self) -> int:
        return int(self.live_bytes().max()) if len(self) else 0

    @property
    def peak_index(self) -> int:
        """The event after which live bytes peak (first one if several); -1 for no events."""
        return int(np.argmax(self.live_bytes())) if len(self) else -1

    @property
    def total_bytes_allocated(self) -> int:
        return int(self.sizes[self.ops == OP_ALLOC].sum())

    def phase_names(self) -> list[str]:
        return [p.name for p in self.phases]

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "events": len(self), "allocs": self.n_allocs,
                "frees": self.n_frees, "peak_live_bytes": self.peak_live_bytes,
                "total_bytes_allocated": self.total_bytes_allocated,
                "distinct_sizes": int(len(np.unique(self.sizes))) if len(self) else 0,
                "phases": self.phase_names()}

    # --- slicing -----------------------------------------------------------------------------------
    def phase(self, name: str) -> Phase:
        """The phase called ``name`` (InvalidInputError listing the phases otherwise)."""
        for p in self.phases:
            if p.name == name:
                return p
        known = ", ".join(self.phase_names()) or "none (no .json sidecar was found)"
        raise InvalidInputError(f"{self.name} has no phase {name!r}; phases: {known}")

    def select(self, phase: str | Phase | tuple[int, int], *, include_live: bool = True,
               free_at_end: bool = True) -> "TraceData":
        """A self-contained trace of one phase (a name, a :class:`Phase` or ``(first, end)``
        rows), valid on its own:

        - ``include_live``: it starts with one allocation per buffer that is live when the phase
          begins (weights, optimizer state...), in allocation order, stamped with the phase's
          first time, so the phase runs with the memory it really ran with;
          without it, frees of buffers allocated before the phase are dropped;
        - ``free_at_end``: it ends with a free of every buffer still live after the phase.

        Ids keep their original values; events keep their extra columns (synthetic ones get
        empty strings).
        """
        if isinstance(phase, str):
            phase = self.phase(phase)
        elif not isinstance(phase, Phase):
            first, end = phase
            phase = Phase(f"rows {first}:{end}", int(first), int(end))
        first, end = phase.first_row, phase.end_row
        n = len(self)
        if not 0 <= first <= end <= n:
            raise InvalidInputError(
                f"phase {phase.name!r} rows [{first}, {end}) are outside the trace's {n} events")
        ops, ids = self.ops, self.ids
        # which ids are live at `first`: allocated before and not freed before
        before_alloc = ids[:first][ops[:first] == OP_ALLOC]
        before_free = ids[:first][ops[:first] == OP_FREE]
        live_before = np.setdiff1d(before_alloc, before_free, assume_unique=False)
        seg_ops = ops[first:end]
        seg_ids = ids[first:end]
        keep = np.ones(end - first, dtype=bool)
        if not include_live:
            keep &= ~((seg_ops == OP_FREE) & np.isin(seg_ids, live_before))
        parts_t, parts_o, parts_i, parts_s = [], [], [], []
        extra_parts: dict[str, list[str]] = {k: [] for k in self.extra}
        t0 = self.t_ns[first] if first < n else (self.t_ns[-1] if n else 0)
        if include_live and len(live_before):
            # allocation order == order of first appearance in the trace
            alloc_rows = np.nonzero(ops[:first] == OP_ALLOC)[0]
            mask = np.isin(ids[alloc_rows], live_before)
            rows = alloc_rows[mask]
            parts_t.append(np.full(len(rows), t0, dtype=np.int64))
            parts_o.append(np.full(len(rows), OP_ALLOC, dtype=np.uint8))
            parts_i.append(ids[rows])
            parts_s.append(self.sizes[rows])
            for k, col in self.extra.items():
                extra_parts[k].extend(col[r] for r in rows.tolist())
        parts_t.append(self.t_ns[first:end][keep])
        parts_o.append(seg_ops[keep])
        parts_i.append(seg_ids[keep])
        parts_s.append(self.sizes[first:end][keep])
        for k, col in self.extra.items():
            sub = col[first:end]
            extra_parts[k].extend(v for v, ok in zip(sub, keep.tolist()) if ok)
        out = TraceData(np.concatenate(parts_t), np.concatenate(parts_o),
                        np.concatenate(parts_i), np.concatenate(parts_s),
                        name=f"{self.name}[{phase.name}]", path=self.path,
                        extra=extra_parts, phases=[], metadata={"selected_from": self.name,
                                                               "phase": phase.name})
        if free_at_end:
            live_sizes = _live_at_end(out.ops, out.ids, out.sizes)
            if live_sizes:
                t_end = int(out.t_ns[-1]) if len(out) else int(t0)
                k = len(live_sizes)
                out.t_ns = np.concatenate([out.t_ns, np.full(k, t_end, dtype=np.int64)])
                out.ops = np.concatenate([out.ops, np.full(k, OP_FREE, dtype=np.uint8)])
                out.ids = np.concatenate([out.ids, np.fromiter(live_sizes.keys(), np.int64, k)])
                out.sizes = np.concatenate([out.sizes,
                                            np.fromiter(live_sizes.values(), np.int64, k)])
                for col in out.extra.values():
                    col.extend([""] * k)
        return out

    def renumbered(self) -> "TraceData":
        """A copy with ids 0..N-1 in allocation order (the shared traces' numbering) and
        ``t_ns`` starting at 0."""
        new_ids = np.empty(len(self), dtype=np.int64)
        current: dict[int, int] = {}
        nxt = 0
        for k, (o, i) in enumerate(zip(self.ops.tolist(), self.ids.tolist())):
            if o == OP_ALLOC:
                current[i] = new_ids[k] = nxt
                nxt += 1
            else:
                new_ids[k] = current.pop(i)
        t = self.t_ns - self.t_ns[0] if len(self) else self.t_ns.copy()
        return TraceData(t, self.ops.copy(), new_ids, self.sizes.copy(), name=self.name,
                         path=self.path, extra={k: list(v) for k, v in self.extra.items()},
                         phases=list(self.phases), metadata=dict(self.metadata))

    def head(self, n_events: int) -> "TraceData":
        """The first ``n_events`` rows, made self-contained (live buffers freed at the end)."""
        return self.select((0, min(n_events, len(self))), include_live=False)


def _live_at_end(ops: np.ndarray, ids: np.ndarray, sizes: np.ndarray) -> dict[int, int]:
    live: dict[int, int] = {}
    for o, i, s in zip(ops.tolist(), ids.tolist(), sizes.tolist()):
        if o == OP_ALLOC:
            live[i] = s
        else:
            live.pop(i, None)
    return live


# --- reading -------------------------------------------------------------------------------------------
def _open_text(source: PathOrFile) -> tuple[IO[str], str, str | None, list]:
    """A text stream over the trace (gunzipping when the data starts with the gzip magic), the
    name for messages, the path, and the objects to close."""
    to_close: list = []
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            raw = open(path, "rb")
        except FileNotFoundError:
            raise TraceFormatError(f"{path}: no such trace file") from None
        except IsADirectoryError:
            raise TraceFormatError(f"{path}: is a directory, not a trace file") from None
        except OSError as exc:
            raise TraceFormatError(f"{path}: cannot open: {exc.strerror or exc}") from None
        to_close.append(raw)
        name = path
    elif hasattr(source, "read"):
        path = None
        name = getattr(source, "name", None)
        name = name if isinstance(name, str) else "<trace>"
        data = source.read()
        if isinstance(data, str):
            return io.StringIO(data), name, path, to_close
        if not isinstance(data, (bytes, bytearray)):
            raise InvalidInputError(f"{name}: read() returned {type(data).__name__}, "
                                    f"expected str or bytes")
        raw = io.BytesIO(data)
    else:
        raise InvalidInputError(f"read_trace takes a path or an open file, got "
                                f"{type(source).__name__} {source!r}")
    head = raw.read(2)
    raw.seek(0)
    if head == _GZIP_MAGIC:
        _check_expansion(raw, name)
        binary: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb")
        to_close.append(binary)
    else:
        binary = raw
    text = io.TextIOWrapper(binary, encoding="utf-8", newline="")
    to_close.insert(0, text)
    return text, name, path, to_close


def _check_expansion(raw: IO[bytes], name: str) -> None:
    """Refuse a gzip stream that inflates past MAX_EXPANSION times its size (a decompression
    bomb), counting without keeping anything; corrupt data is left to the reader (it names
    the line)."""
    size = raw.seek(0, io.SEEK_END)
    raw.seek(0)
    limit = MAX_EXPANSION * size + (1 << 20)
    total = 0
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            while chunk := gz.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    raise TraceFormatError(
                        f"{name}: the gzip data inflates more than {MAX_EXPANSION}-fold (real "
                        f"traces: under 10-fold); refused as a decompression bomb")
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError):
        pass
    raw.seek(0)


def read_trace(source: PathOrFile, *, phases: bool = True) -> TraceData:
    """Read and validate a trace (a path, or a file object open in text or binary mode).

    Raises :class:`TraceFormatError` naming the file and line for any malformed content (see the
    module docstring). With ``phases`` (default) the ``.json`` sidecar next to a path, if any,
    provides :attr:`TraceData.phases` and :attr:`TraceData.metadata`.
    """
    text, name, path, to_close = _open_text(source)
    line = 1
    try:
        reader = csv.reader(text)
        try:
            header = next(reader, None)
        except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
            raise _gzip_error(name, 1, exc) from None
        except UnicodeDecodeError:
            raise TraceFormatError(f"{name}:1: not a UTF-8 text file") from None
        if header is None:
            raise TraceFormatError(f"{name}:1: empty file; expected the header "
                                   f"'{','.join(HEADER)}'")
        cols = [c.strip() for c in header]
        if cols and cols[0].startswith("\ufeff"):
            cols[0] = cols[0][1:]
        if tuple(cols[:4]) != HEADER:
            raise TraceFormatError(
                f"{name}:1: bad header {brief(','.join(header))}; the first columns must be "
                f"'{','.join(HEADER)}'")
        extra_names = cols[4:]
        if len(set(extra_names)) != len(extra_names) or any(not c for c in extra_names):
            raise TraceFormatError(f"{name}:1: extra column names must be unique and non-empty, "
                                   f"got {extra_names}")
        ncols = len(cols)
        # 8 bytes a value, not a Python int each: memory stays a small multiple of the file
        t_col, id_col, size_col = array("q"), array("q"), array("q")
        op_col = bytearray()
        extra_cols: list[list[str]] = [[] for _ in extra_names]
        live: dict[int, int] = {}
        append_t, append_o, append_i, append_s = (t_col.append, op_col.append, id_col.append,
                                                  size_col.append)
        try:
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                if len(row) != ncols:
                    if len(row) < 4:
                        raise TraceFormatError(
                            f"{name}:{line}: expected {ncols} columns "
                            f"({','.join(cols)}), got {len(row)}: {brief(','.join(row))}")
                    if len(row) > ncols:
                        raise TraceFormatError(
                            f"{name}:{line}: {len(row)} columns but the header has {ncols}")
                    row = row + [""] * (ncols - len(row))
                t, op, i, s = row[0], row[1], row[2], row[3]
                try:
                    t = int(t)
                except ValueError:
                    raise TraceFormatError(
                        f"{name}:{line}: t_ns must be an integer, got {brief(row[0])}") from None
                try:
                    i = int(i)
                except ValueError:
                    raise TraceFormatError(
                        f"{name}:{line}: id must be an integer, got {brief(row[2])}") from None
                try:
                    s = int(s)
                except ValueError:
                    raise TraceFormatError(
                        f"{name}:{line}: size must be a non-negative integer, got "
                        f"{brief(row[3])}") from None
                if not (_INT64[0] <= t < _INT64[1] and i < _INT64[1] and s < _INT64[1]):
                    raise TraceFormatError(f"{name}:{line}: a value does not fit in 64 bits")
                if s < 0:
                    raise TraceFormatError(
                        f"{name}:{line}: size must be a non-negative integer, got {s}")
                if i < 0:
                    raise TraceFormatError(f"{name}:{line}: id must be >= 0, got {i}")
                if op == "a":
                    if i in live:
                        raise TraceFormatError(
                            f"{name}:{line}: allocation of id {i}, which is already live "
                            f"(allocated and not freed)")
                    live[i] = s
                    append_o(OP_ALLOC)
                elif op == "f":
                    was = live.pop(i, None)
                    if was is None:
                        raise TraceFormatError(
                            f"{name}:{line}: free of unknown id {i} (not allocated, or "
                            f"already freed)")
                    if was != s:
                        raise TraceFormatError(
                            f"{name}:{line}: free of id {i} with size {s}, but it was "
                            f"allocated with size {was}")
                    append_o(OP_FREE)
                else:
                    raise TraceFormatError(f"{name}:{line}: unknown op {brief(op)}; expected "
                                           f"'a' (alloc) or 'f' (free)")
                append_t(t)
                append_i(i)
                append_s(s)
                for k in range(ncols - 4):
                    extra_cols[k].append(row[4 + k])
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise _gzip_error(name, reader.line_num + 1, exc) from None
        except csv.Error as exc:
            raise TraceFormatError(f"{name}:{reader.line_num}: {exc}") from None
        except UnicodeDecodeError:
            raise TraceFormatError(f"{name}:{reader.line_num + 1}: not UTF-8 text") from None
        except OSError as exc:
            raise _gzip_error(name, reader.line_num + 1, exc) from None
    finally:
        for obj in to_close:
            try:
                obj.close()
            except Exception:
                pass
    data = TraceData(np.frombuffer(t_col, np.int64), np.frombuffer(op_col, np.uint8),
                     np.frombuffer(id_col, np.int64), np.frombuffer(size_col, np.int64),
                     name=os.path.basename(name) if path else name, path=path,
                     extra=dict(zip(extra_names, extra_cols)))
    if phases and path is not None:
        meta = _load_sidecar(path)
        if meta is not None:
            data.metadata = meta
            data.phases = _phases_from(meta, path, len(data))
    return data


def _gzip_error(name: str, line: int, exc: BaseException) -> TraceFormatError:
    if isinstance(exc, EOFError):
        what = "truncated gzip file (the compressed stream ends early)"
    else:
        what = f"corrupt gzip data ({exc})"
    return TraceFormatError(f"{name}:{line}: {what}")


# --- phases ---------------------------------------------------------------------------------------------
def _sidecar_path(path: str) -> Path:
    p = Path(path)
    name = p.name
    for suffix in (".csv.gz", ".csv", ".gz"):
        if name.endswith(suffix):
            return p.with_name(name[: -len(suffix)] + ".json")
    return p.with_name(name + ".json")


def _load_sidecar(path: str) -> dict | None:
    side = _sidecar_path(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TraceFormatError(f"{side}: cannot read the trace's metadata: {exc}") from None
    except RecursionError:      # json's decoder recurses once per level of nesting
        raise TraceFormatError(f"{side}: cannot read the trace's metadata: nested too "
                               f"deeply") from None
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{side}: the metadata must be a JSON object")
    return meta


def _phases_from(meta: dict, where: str, n_events: int | None) -> list[Phase]:
    raw = meta.get("phases", [])
    if not isinstance(raw, list):
        raise TraceFormatError(f"{where}: 'phases' in the metadata must be a list")
    out = []
    for k, p in enumerate(raw):
        try:
            if not isinstance(p["name"], (str, int)):
                raise TypeError("a phase's name is a string")
            ph = Phase(str(p["name"]), int(p["first_row"]), int(p["end_row"]))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise TraceFormatError(f"{where}: phase #{k} needs name, first_row and end_row, "
                                   f"got {brief(p)}") from None
        if ph.first_row < 0 or ph.end_row < ph.first_row or (
                n_events is not None and ph.end_row > n_events):
            raise TraceFormatError(f"{where}: phase {ph.name!r} has bad rows "
                                   f"[{ph.first_row}, {ph.end_row}) for {n_events} events")
        out.append(ph)
    return out


def load_phases(path: str | os.PathLike[str]) -> list[Phase]:
    """The phases listed in the ``.json`` sidecar of a trace (``x.csv.gz`` -> ``x.json``), or of
    the ``.json`` file itself; ``[]`` when there is no sidecar."""
    p = os.fspath(path)
    if p.endswith(".json"):
        if not os.path.isfile(p):
            raise TraceFormatError(f"{p}: no such metadata file")
        meta = _load_sidecar(p[:-5] + ".csv")
    else:
        meta = _load_sidecar(p)
    return [] if meta is None else _phases_from(meta, p, None)


# --- writing ----------------------------------------------------------------------------------------------
EXTRA_COLUMNS = ("stream", "device", "tag")


def write_trace(path: str | os.PathLike[str] | IO[str], events: TraceData | Iterable[Sequence[Any]],
                *, extra_columns: Sequence[str] | None = None) -> int:
    """Write events in the trace format; gzip when the path ends with ``.gz``. Returns the
    number of events written.

    ``events`` is a :class:`TraceData` (its extra columns are written too) or an iterable of
    rows ``(t_ns, op, id, size, *extras)`` with ``op`` ``"a"``/``"f"`` (or 0/1), where
    ``extras`` fill ``extra_columns`` in order (e.g. ``("stream", "device", "tag")``); ``None``
    extras are written as empty fields. The rows are written as given: call
    :func:`read_trace` on the result to validate it.
    """
    if isinstance(events, TraceData):
        names = list(events.extra) if extra_columns is None else list(extra_columns)
        missing = [c for c in names if c not in events.extra]
        if missing:
            raise InvalidInputError(f"the trace has no column(s) {missing}")
        cols = [events.extra[c] for c in names]
        rows: Iterable[Sequence[Any]] = (
            (t, "a" if o == OP_ALLOC else "f", i, s, *(c[k] for c in cols))
            for k, (t, o, i, s) in enumerate(zip(events.t_ns.tolist(), events.ops.tolist(),
                                                 events.ids.tolist(), events.sizes.tolist())))
    else:
        names = list(extra_columns or ())
        rows = events
    for c in names:
        if not isinstance(c, str) or not c or c in HEADER or "," in c:
            raise InvalidInputError(f"bad extra column name {c!r}")
    own = not hasattr(path, "write")
    if own:
        p = os.fspath(path)  # type: ignore[arg-type]
        if p.endswith(".gz"):
            # mtime=0: the same events give the same bytes
            raw = open(p, "wb")
            gz = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="")
            out: IO[str] = io.TextIOWrapper(gz, encoding="utf-8", newline="")
            closers: list = [out, gz, raw]
        else:
            out = open(p, "w", encoding="utf-8", newline="")
            closers = [out]
    else:
        out = path  # type: ignore[assignment]
        closers = []
    n = 0
    ncols = 4 + len(names)
    try:
        w = csv.writer(out, lineterminator="\n")
        w.writerow([*HEADER, *names])
        for row in rows:
            if len(row) < 4 or len(row) > ncols:
                raise InvalidInputError(f"event #{n}: expected 4 to {ncols} fields "
                                        f"(t_ns, op, id, size{''.join(', ' + c for c in names)}),"
                                        f" got {tuple(row)!r}")
            t, op, i, s = row[0], row[1], row[2], row[3]
            if op in (0, "a"):
                op = "a"
            elif op in (1, "f"):
                op = "f"
            else:
                raise InvalidInputError(f"event #{n}: op must be 'a' or 'f', got {op!r}")
            extras = ["" if v is None else v for v in row[4:]]
            w.writerow([int(t), op, int(i), int(s), *extras])
            n += 1
    finally:
        for obj in closers:
            obj.close()
    return n
