"""The exceptions gpumem raises. Every public error derives from :class:`GpuMemoryError`."""
from __future__ import annotations

import functools
import itertools
from typing import Any

__all__ = [
    "GpuMemoryError",
    "OutOfMemoryError",
    "InvalidInputError",
    "InvalidDeviceError",
    "DoubleFreeError",
    "ForeignBufferError",
    "BufferInUseError",
    "ClosedManagerError",
    "BackendUnavailableError",
    "DriverError",
    "DriverOutOfMemory",
    "TraceFormatError",
    "SharedLedgerError",
    "UnsupportedOperationError",
    "GpumemWarning",
    "CpuFallbackWarning",
    "UnknownSettingWarning",
    "brief",
]


class GpuMemoryError(Exception):
    """Base class of every gpumem error."""


class OutOfMemoryError(GpuMemoryError, MemoryError):
    """A request could not be served by the device, its cache, or a fallback.

    The attributes give the state at the moment of failure so a user can tell an honest
    out-of-memory from fragmentation (``largest_free_block`` far below ``cached``).
    ``history``: the pool's alloc/free events up to the failure (to the history clock's tick,
    a few ms) as a
    ``gpumem.observe.trace.TraceData`` (None when the pool's history is off). It is built on first
    access, so code that catches OutOfMemoryError and retries pays nothing for it.
    ``dump_files``: (trace, snapshot) paths when :func:`gpumem.dump_on_oom` or
    ``GPUMEM_DUMP_ON_OOM`` asked for a dump.
    """

    dump_files = None
    _history = None
    _history_source = None          # a callable building `history` (set by the manager)

    @property
    def history(self) -> Any:
        source = self._history_source
        if source is not None:
            self._history_source = None
            try:
                self._history = source()
            except Exception:       # the error must stay readable whatever the history does
                self._history = None
        return self._history

    @history.setter
    def history(self, value: Any) -> None:
        self._history, self._history_source = value, None

    def __init__(self, requested: int, *, device: str = "?", free: int | None = None,
                 total: int | None = None, in_use: int = 0, cached: int = 0,
                 limit: int | None = None, largest_free_block: int = 0, reason: str = "") -> None:
        self.requested = requested
        self.device = device
        self.free = free
        self.total = total
        self.in_use = in_use
        self.cached = cached
        self.limit = limit
        self.largest_free_block = largest_free_block
        self.reason = reason
        from gpumem.units import format_bytes as fb, sized_device

        def opt(v: int | None) -> str:
            return "unknown" if v is None else fb(v)

        msg = (f"out of memory on {sized_device(device, total)}: requested {fb(requested)}; device free {opt(free)} of "
               f"total {opt(total)}; in use {fb(in_use)}, cached {fb(cached)} "
               f"(largest free block {fb(largest_free_block)}), limit {opt(limit)}")
        if reason:
            msg += f" ({reason})"
        super().__init__(msg)

    def __reduce__(self):
        # rebuilt from its fields, not from the message (the default): a Dask worker sends a
        # task's exception to the client by pickling it
        fields = {k: getattr(self, k) for k in ("device", "free", "total", "in_use", "cached",
                                                 "limit", "largest_free_block", "reason")}
        state = {k: v for k, v in self.__dict__.items() if k != "_history_source"}
        if self._history_source is not None:
            state["_history"] = None            # not built here: it would need the pool
        return functools.partial(type(self), **fields), (self.requested,), state


class InvalidInputError(GpuMemoryError, ValueError):
    """An argument had a value gpumem cannot accept; the message names it and what is allowed."""


class InvalidDeviceError(GpuMemoryError, ValueError):
    """A device string or index names no device; the message lists the devices that exist."""


class DoubleFreeError(InvalidInputError):
    """A buffer was freed twice."""


class ForeignBufferError(InvalidInputError):
    """A buffer was handed to a manager that did not allocate it (or that has been closed)."""


class BufferInUseError(InvalidInputError):
    """A buffer was freed while views of it (``Buffer.view()``, arrays made from its
    ``__array_interface__`` or ``__cuda_array_interface__`` through a view, DLPack capsules) are
    still alive; ``Buffer.exports`` counts them. Drop them first, or drop the buffer instead of
    freeing it: its block then goes back to the pool when the last view dies."""


class ClosedManagerError(InvalidInputError):
    """A manager was used (malloc, free, snapshot...) after close()."""


class BackendUnavailableError(GpuMemoryError):
    """A backend's driver or Python package is missing; the message says which and why."""


class DriverError(GpuMemoryError):
    """A driver call failed. ``code`` is the driver's numeric code and ``code_name`` its name."""

    def __init__(self, message: str, *, code: int | None = None, code_name: str | None = None) -> None:
        self.code = code
        self.code_name = code_name
        super().__init__(message)


class DriverOutOfMemory(DriverError, MemoryError):
    """The driver itself refused a raw segment allocation for lack of memory.

    Backends raise this; the manager turns it into its OOM recovery ladder and, at the end,
    into :class:`OutOfMemoryError`.
    """


class UnsupportedOperationError(GpuMemoryError, NotImplementedError):
    """The backend's driver cannot do what was asked (e.g. virtual-memory mapping on OpenCL);
    the message names the backend and the call. Callers check the capability flag first."""


class TraceFormatError(InvalidInputError):
    """A trace file is malformed; the message names the file and line."""


class SharedLedgerError(InvalidInputError):
    """A shared-budget ledger that cannot be trusted or used (the message names the file and
    says why), or a shared-budget setting that disagrees with the group's
    (docs/shared_budget.md)."""


class GpumemWarning(UserWarning):
    """Base class of every warning gpumem emits; filter it (``warnings.simplefilter("error",
    gpumem.GpumemWarning)``) to turn them all into errors."""


class CpuFallbackWarning(GpumemWarning):
    """A manager served a request from host memory because its device, or a hard limit the
    user set, refused it; the message says which (emitted once per manager, on its first
    fallback; each fallback is also logged)."""


class UnknownSettingWarning(GpumemWarning):
    """A ``GPUMEM_*`` environment variable that gpumem does not know (likely misspelled)."""


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, float)) or (
        isinstance(value, int) and value.bit_length() <= 64) or (
        isinstance(value, (str, bytes)) and len(value) <= 40)


def brief(value: Any, limit: int = 60) -> str:
    """A short description of a value read from a file, for an error message: its repr when
    that is short, else its type and size. It never walks into a container (a file may nest or
    share them without bound) nor prints a huge int (CPython refuses past 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
        return text if len(value) <= limit else f"{text[:-1]}...{text[-1]} ({len(value)} long)"
    if isinstance(value, (list, tuple, dict)):
        items = list(itertools.islice(value.items(), 7)) if isinstance(value, dict) \
            else list(value[:7])
        flat = [x for kv in items for x in kv] if isinstance(value, dict) else items
        if len(value) <= 6 and all(_is_scalar(x) for x in flat):
            return repr(value)
        return f"a {type(value).__name__} of {len(value)} items"
    if _is_scalar(value):
        return repr(value)
    return f"a value of type {type(value).__name__}"
