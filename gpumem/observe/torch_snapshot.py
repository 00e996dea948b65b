"""The PyTorch bridge: a PyTorch memory snapshot in, a PyTorch memory-viz pickle out.

PyTorch records a run with ``torch.cuda.memory._record_memory_history()`` and saves it with
``torch.cuda.memory._dump_snapshot("snap.pickle")``. The pickle is a dict::

    {"segments": [{"device", "address", "total_size", "stream", "segment_type",
                   "allocated_size", "active_size", "requested_size", "blocks": [
                       {"address", "size", "requested_size", "state", "frames"}], ...}],
     "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames"}, ...],
                       ...one list per device]}

with ``action`` one of ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map``, ``segment_unmap``, ``snapshot``, ``oom``.

:func:`read_torch_snapshot` turns one device's trace into a gpumem :class:`~gpumem.observe.trace.TraceData`
(``gpumem import-torch SNAP.pickle -o TRACE.csv.gz`` on the command line), so
``gpumem replay TRACE --device sim:24GiB`` tells whether the workload fits a 24 GiB card.
:func:`export_memory_viz` writes the same layout from a gpumem manager or snapshot, for
pytorch.org/memory_viz and ``torch.cuda._memory_viz``.

Neither needs torch: the pickles hold only dicts, lists, strings and numbers, and are read with
an unpickler that refuses every other type (a pickle can otherwise run code).
"""
from __future__ import annotations

import itertools
import os
import pickle
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from gpumem.errors import InvalidInputError, brief
from gpumem.observe.safe_pickle import load_data_pickle

if TYPE_CHECKING:
    from gpumem.observe.trace import TraceData

__all__ = ["read_torch_snapshot", "export_memory_viz", "to_memory_viz", "load_torch_pickle"]

#: actions of a PyTorch trace that gpumem's trace format does not carry (counted, not kept)
_SKIPPED_ACTIONS = ("free_requested", "segment_alloc", "segment_free", "segment_map",
                    "segment_unmap", "snapshot", "oom", "annotate")


def load_torch_pickle(source: str | os.PathLike[str] | BinaryIO) -> Any:
    """Unpickle a snapshot file (path or binary file object) without running any code, with
    time and memory proportional to the file's size (gpumem.observe.safe_pickle)."""
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else \
        getattr(source, "name", "<snapshot>")
    name = name if isinstance(name, str) else "<snapshot>"
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                data = f.read()
        else:
            data = source.read()
    except FileNotFoundError:
        raise InvalidInputError(f"{name}: no such snapshot file") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{name}: is a directory, not a snapshot file") from None
    if not isinstance(data, bytes):
        raise InvalidInputError(f"{name}: read() returned {type(data).__name__}; open the "
                                f"snapshot in binary mode")
    return load_data_pickle(data, name, what="a PyTorch memory snapshot")


_INT64_MAX = (1 << 63) - 1


def _int_field(entry: dict, key: str, where: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{where}: {key!r} must be an int, got {brief(value)}")
    if not 0 <= value <= _INT64_MAX:
        raise InvalidInputError(f"{where}: {key!r} must be in [0, 2**63), got {brief(value)}")
    return value


def _stream_field(entry: dict, where: str) -> str:
    value = entry.get("stream", 0)
    if isinstance(value, int) and not isinstance(value, bool) and \
            -(1 << 63) <= value < (1 << 64):
        return str(value)
    if isinstance(value, str) and len(value) <= 64:
        return value
    raise InvalidInputError(f"{where}: 'stream' must be an int (a CUDA stream), got "
                            f"{brief(value)}")


def read_torch_snapshot(source: str | os.PathLike[str] | BinaryIO | dict, *,
                        device: int | None = None, strict: bool = False) -> "TraceData":
    """One device's allocation history of a PyTorch memory snapshot, as a gpumem trace.

    `source` is the pickle (a path or binary file) or the dict ``torch.cuda.memory._snapshot()``
    returns. `device` picks the device (default: the only one with a recorded trace). Each
    ``alloc`` becomes an allocation and each ``free_completed`` (the block is back in the
    allocator) its free; the ``stream`` column keeps the stream, ``t_ns`` comes from
    ``time_us`` (or the event index where PyTorch recorded no time). Allocations still live at
    the end stay without a free.

    A free of an address allocated before recording started (the ring dropped it) is left out
    and counted in ``metadata["orphan_frees"]``; with ``strict`` it is an error. An ``alloc``
    at an address that is still live, or a free whose size differs from its allocation's, is
    always an error: the trace is inconsistent.
    """
    from gpumem.observe.trace import OP_ALLOC, OP_FREE, TraceData
    where = "<snapshot dict>" if isinstance(source, dict) else \
        os.fspath(source) if isinstance(source, (str, os.PathLike)) else \
        getattr(source, "name", "<snapshot>")
    from_file = isinstance(source, (str, os.PathLike)) or hasattr(source, "read")
    data = load_torch_pickle(source) if from_file else source
    if not isinstance(data, dict) or "device_traces" not in data:
        got = f"a dict with keys {', '.join(brief(k) for k in itertools.islice(data, 8))}" \
            if isinstance(data, dict) else brief(data)
        raise InvalidInputError(
            f"{where}: not a PyTorch memory snapshot (expected a dict with 'device_traces' "
            f"from torch.cuda.memory._snapshot(), got {got})")
    traces = data["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise InvalidInputError(f"{where}: 'device_traces' must be a list of lists")
    recorded = [i for i, t in enumerate(traces) if t]
    if device is None:
        if not recorded:
            raise InvalidInputError(
                f"{where}: no traces recorded (call torch.cuda.memory._record_memory_history() "
                f"before the workload, then _dump_snapshot())")
        if len(recorded) > 1:
            raise InvalidInputError(f"{where}: devices {recorded} have traces; choose one "
                                    f"with device=")
        device = recorded[0]
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < len(traces):
        raise InvalidInputError(f"{where}: device must be one of 0..{len(traces) - 1}, got "
                                f"{device!r}")
    entries = traces[device]
    if not entries:
        raise InvalidInputError(f"{where}: no trace recorded for device {device} (devices "
                                f"with traces: {recorded})")

    t_ns: list[int] = []
    ops: list[int] = []
    ids: list[int] = []
    sizes: list[int] = []
    streams: list[str] = []
    live: dict[int, tuple[int, int, int]] = {}      # addr -> (id, size, event index)
    skipped: dict[str, int] = {}
    orphan_frees = 0
    next_id = 0
    t0: int | None = None
    for k, e in enumerate(entries):
        at = f"{where}: device {device} event #{k}"
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            raise InvalidInputError(f"{at}: expected a dict with an 'action', got {brief(e)}")
        action = e["action"]
        if action not in ("alloc", "free_completed"):
            if action not in _SKIPPED_ACTIONS:
                raise InvalidInputError(f"{at}: unknown action {brief(action)}")
            skipped[action] = skipped.get(action, 0) + 1
            continue
        addr, size = _int_field(e, "addr", at), _int_field(e, "size", at)
        if size < 0:
            raise InvalidInputError(f"{at}: negative size {size}")
        t = _int_field(e, "time_us", at) if "time_us" in e else None
        if action == "alloc":
            if addr in live:
                raise InvalidInputError(
                    f"{at}: unpaired events: alloc at {addr:#x} while the allocation of event "
                    f"#{live[addr][2]} at that address has not been freed")
            new_id, next_id = next_id, next_id + 1
            live[addr] = (new_id, size, k)
            ops.append(OP_ALLOC)
        else:
            if addr not in live:
                if strict:
                    raise InvalidInputError(
                        f"{at}: unpaired events: free_completed at {addr:#x} without an "
                        f"alloc (recorded before the trace started? strict=False skips it)")
                orphan_frees += 1
                continue
            new_id, alloc_size, first = live.pop(addr)
            if alloc_size != size:
                raise InvalidInputError(
                    f"{at}: unpaired events: free of {size} bytes at {addr:#x}, allocated "
                    f"with {alloc_size} bytes at event #{first}")
            ops.append(OP_FREE)
        if t is None:
            when = k
        else:
            t0 = t if t0 is None else t0     # t_ns is 0 at the first event kept
            when = (t - t0) * 1000
            if not -_INT64_MAX <= when <= _INT64_MAX:
                raise InvalidInputError(f"{at}: 'time_us' {t} is {t - t0} us after the first "
                                        f"event: past 2**63 ns")
        t_ns.append(when)
        ids.append(new_id)
        sizes.append(size)
        streams.append(_stream_field(e, at))
    if not ops:
        raise InvalidInputError(f"{where}: device {device}'s trace has no alloc events")
    n = len(ops)
    name = os.path.basename(where) if not where.startswith("<") else "torch-snapshot"
    return TraceData(np.asarray(t_ns, np.int64), np.asarray(ops, np.uint8),
                     np.asarray(ids, np.int64), np.asarray(sizes, np.int64),
                     name=name, extra={"stream": streams},
                     metadata={"source": "torch memory snapshot", "device": device,
                               "events": n, "orphan_frees": orphan_frees,
                               "skipped_actions": skipped, "live_at_end": len(live)})


# --- export ---------------------------------------------------------------------------------------

def _device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def to_memory_viz(source: Any, history: Any = None) -> dict:
    """The PyTorch snapshot dict for a gpumem manager or snapshot dict (see
    :func:`export_memory_viz`)."""
    from gpumem.observe.history import HistoryRecorder
    from gpumem.observe.snapshot import take_snapshot
    if isinstance(source, dict):
        snap = source
        if snap.get("format") != "gpumem-snapshot":
            raise InvalidInputError("source must be a MemoryManager or a gpumem snapshot "
                                    "(MemoryManager.snapshot()), got a dict without "
                                    "format 'gpumem-snapshot'")
    elif hasattr(source, "pool") and hasattr(source, "device_string"):
        snap = take_snapshot(source)
        if history is None:     # the one recording, else the last one stopped (still held)
            history = next(iter(getattr(source, "_recorders", ())), None)
            last = getattr(source, "_last_recorder", None)
            if history is None and last is not None:
                history = last()
    else:
        raise InvalidInputError(f"source must be a MemoryManager or a gpumem snapshot dict, "
                                f"got {type(source).__name__}")
    if history is not None and not isinstance(history, HistoryRecorder):
        raise InvalidInputError(f"history must be a HistoryRecorder (manager.record_history()), "
                                f"got {type(history).__name__}")
    dev = _device_index(str(snap.get("device", "")))
    segments = []
    for seg in snap["segments"]:
        blocks = []
        for b in seg["blocks"]:
            if b["state"] == "unmapped":           # no memory behind it: torch lists none
                continue
            allocated = b["state"] == "allocated"
            # "active_pending_free" is what libtorch_python writes (torch's docstring says
            # "active_awaiting_free"; checked in the 2.14.1 binary)
            state = ("active_pending_free" if b.get("pending_free") else "active_allocated") \
                if allocated else "inactive"
            blocks.append({"address": seg["base"] + b["offset"], "size": b["size"],
                           "requested_size": b["requested"] if allocated else 0,
                           "state": state, "frames": []})
        allocated_size = sum(b["size"] for b in blocks if b["state"] != "inactive")
        segments.append({
            "device": dev, "address": seg["base"], "total_size": seg["size"],
            "stream": seg["stream"], "segment_type": seg["pool"],
            "segment_pool_id": (0, 0), "allocated_size": allocated_size,
            "active_size": allocated_size,
            "requested_size": sum(b["requested_size"] for b in blocks),
            "is_expandable": False, "frames": [], "blocks": blocks})
    traces: list[list[dict]] = [[] for _ in range(dev + 1)]
    if history is not None:
        addr_of: dict[int, int] = {}
        for ev in history.events():
            if ev.location == "cpu":
                continue                  # CPU-fallback memory is not the device's
            common = {"size": ev.size, "stream": ev.stream, "time_us": ev.t_ns // 1000,
                      "frames": []}
            if ev.op == "a":
                addr_of[ev.id] = ev.ptr
                traces[dev].append({"action": "alloc", "addr": ev.ptr, **common})
            elif ev.id in addr_of:
                addr = addr_of.pop(ev.id)
                traces[dev].append({"action": "free_requested", "addr": addr, **common})
                traces[dev].append({"action": "free_completed", "addr": addr, **common})
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"source": "gpumem", "device": snap.get("device")}}


def export_memory_viz(source: Any, path: str | os.PathLike[str] | BinaryIO, *,
                      history: Any = None) -> dict:
    """Write a pickle that pytorch.org/memory_viz and ``torch.cuda._memory_viz`` open.

    `source` is a MemoryManager (snapshotted now) or a snapshot dict from
    ``MemoryManager.snapshot()``. Segments and blocks become PyTorch's ``segments`` (freed
    blocks waiting for other streams are ``active_pending_free``); the events of `history` (a
    HistoryRecorder; by default the one recording on the manager, else the last one stopped,
    while the program still holds it) become its
    ``device_traces`` (``alloc``, ``free_requested``, ``free_completed``). gpumem does not record
    stack frames, so ``frames`` are empty. Returns the dict written.
    """
    data = to_memory_viz(source, history)
    if hasattr(path, "write"):
        pickle.dump(data, path)               # type: ignore[arg-type]
    else:
        with open(path, "wb") as f:
            pickle.dump(data, f)
    return data
