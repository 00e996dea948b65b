"""SimDevice: a deterministic fake GPU driver implementing :class:`gpumem.backends.base.Device`.

It is a test double of a *driver*, not of the pool: it hands out raw segments (address ranges in
its own address window), reports ``mem_get_info`` exactly, and fails on demand, so the real
Cython pool and the manager can be tested without a GPU. Everything is deterministic: addresses
depend only on the order of calls, and random faults come from ``random.Random(seed)``.

Fault injection (armed at construction or later with :meth:`SimDevice.inject`):

``fail_after=n``
    Counting the raw allocations made after the fault was armed: :meth:`~SimDevice.alloc_segment`
    calls and the page creations of :meth:`~SimDevice.vm_create` (expandable segments take their
    memory that way; calls with invalid arguments are not counted): the first ``n`` go through as usual
    (they may still fail for real lack of room), and every later call raises
    :class:`~gpumem.errors.DriverOutOfMemory`. ``fail_after=0`` fails every allocation;
    ``None`` disarms it.
``fail_rate=p``
    Every counted allocation call draws exactly one number ``u`` from ``random.Random(seed)``
    (whether or not a fault is armed) and fails when ``u < p``. The same seed therefore fails
    the same call numbers, and a higher rate fails a superset of the calls a lower rate fails.
``fail_free=True`` / ``fail_free=n``
    ``True`` makes every :meth:`~SimDevice.free_segment` and :meth:`~SimDevice.vm_release`
    raise :class:`~gpumem.errors.DriverError` until cleared; an int ``n`` fails only the next
    ``n`` calls. A failed free leaves the segment (the page) allocated (the driver did not free
    it), so a retry can succeed.
``fail_kind``
    ``"oom"`` (default): injected allocation failures raise ``DriverOutOfMemory``; ``"error"``:
    they raise a plain ``DriverError`` (code ``SIM_ERROR_INJECTED``), to test that a non-OOM
    driver failure is not mistaken for memory pressure.

Injected exceptions carry ``exc.injected = True``; genuine ones ``exc.injected = False``.
"""
from __future__ import annotations

import mmap
import random
import threading
from collections import deque
from typing import Any, NamedTuple

from gpumem.backends.base import Device, DeviceKind, DeviceProperties
from gpumem.errors import DriverError, DriverOutOfMemory, InvalidInputError
from gpumem.units import format_bytes
from gpumem_sim._common import (_MMAP_KW, _UNSET, SimCall, _bytes_view, _fail_after_arg,
                                _fail_free_arg, _fail_kind_arg, _int_arg, _rate_arg,
                                _reserve_window, _size_arg)
from gpumem_sim._ranges import RangeAllocator
from gpumem_sim.driver_costs import ModeledDriverTime, make_meter
from gpumem_sim.shared_card import SharedCardUser
from gpumem_sim.streams import SimStreams
from gpumem_sim.vmm import DEFAULT_VM_GRANULARITY, VA_WINDOW_FACTOR, VirtualMemory

__all__ = [
    "SimDevice", "SimCall", "SimSegment",
    "SIM_ERROR_OUT_OF_MEMORY", "SIM_ERROR_INJECTED", "MAX_CAPACITY", "MAX_ALIGNMENT",
]

#: Driver codes carried by the exceptions (numbers chosen to match CUDA's OOM / UNKNOWN).
SIM_ERROR_OUT_OF_MEMORY = (2, "SIM_ERROR_OUT_OF_MEMORY")
SIM_ERROR_INJECTED = (999, "SIM_ERROR_INJECTED")

#: Largest simulated device (256 TiB) and largest segment alignment (1 GiB): sanity bounds that
#: keep every address inside 63 bits.
MAX_CAPACITY = 1 << 48
MAX_ALIGNMENT = 1 << 30

#: How many entries :attr:`SimDevice.calls` keeps (the oldest are dropped), so long replays do
#: not grow the log without bound.
CALL_LOG_LIMIT = 100_000


class SimSegment(NamedTuple):
    """A live segment: ``base`` is its address, ``nbytes`` what was asked for, ``reserved`` the
    bytes it takes from the device (``nbytes`` rounded up to the alignment)."""

    handle: int
    base: int
    nbytes: int
    reserved: int


class _Segment:
    __slots__ = ("handle", "offset", "nbytes", "reserved", "store")

    def __init__(self, handle: int, offset: int, nbytes: int, reserved: int,
                 store: mmap.mmap | None) -> None:
        self.handle = handle
        self.offset = offset        # from the device base
        self.nbytes = nbytes
        self.reserved = reserved
        self.store = store


class SimDevice(SimStreams, VirtualMemory, ModeledDriverTime, SharedCardUser, Device):
    """A simulated GPU with ``capacity`` bytes (an int or a string such as ``"16GiB"``).

    - Segments are ranges of a private address window starting at :attr:`base_address`; each
      starts on an ``alignment`` boundary and reserves its size rounded up to ``alignment``.
      Placement is best-fit, so the address space fragments and an allocation fails with
      ``DriverOutOfMemory`` when no *contiguous* range fits, even if enough bytes are free.
    - ``mem_get_info()`` is exact: ``(capacity - other_process_bytes - live reserved bytes,
      capacity)``. ``other_process_bytes`` is memory held by other processes (not in this
      address window), changeable with :meth:`set_other_process_bytes`.
    - ``back_memory=True`` backs each segment with zero-filled host bytes, so copies and memset
      work and tests can detect overlap; otherwise those calls raise ``InvalidInputError``.
    - Streams are ints (0 is the default stream). Work is simulated: :meth:`submit` queues work
      items on a stream, :meth:`complete` finishes them, :meth:`stream_idle` reports whether any
      remain (:mod:`gpumem_sim.streams`). Copies are synchronous and never advance these
      queues: tests drive them.
    - Shared card (:meth:`share_card`): the devices of several processes may be one card; the
      bytes the others hold count as taken (``mem_get_info``, ``alloc_segment``). Without a
      shared card nothing outside this object is read, so a device stays deterministic.
    - Fault injection: see the module docstring (``fail_after``, ``fail_rate`` with ``seed``,
      ``fail_free``, ``fail_kind``).
    - Counters (``alloc_calls``, ``free_calls``, ``failed_allocs``, ``injected_failures``,
      ``failed_frees``, ``synchronize_calls``, ``mem_get_info_calls``, ``stream_query_calls``,
      ``peak_live_bytes``,
      ``live_segments``, ``live_bytes``) and the :attr:`calls` log let tests observe the
      driver traffic of the code under test.
    - Driver time is modeled (never slept): each call is charged what it would cost on a GPU
      (:mod:`gpumem_sim.driver_costs`), summed in :attr:`modeled_driver_seconds` with a per-call
      :attr:`modeled_driver_breakdown`. ``driver_costs=None`` charges the CUDA table,
      ``False`` turns the model off, a mapping overrides entries (``{"vm_map": 2e-6}``,
      ``{"vm_create": (0.0, 1e-10)}``), a :class:`~gpumem_sim.driver_costs.DriverCostModel`
      is used as is.

    ``index`` is -1 until :func:`gpumem_sim.install` gives the device its ``sim:N`` name. All
    methods are thread-safe (one lock per device).
    """

    backend = "sim"
    kind = DeviceKind.SIMULATED

    def __init__(self, capacity: int | str, *, alignment: int = 256, name: str | None = None,
                 other_process_bytes: int | str = 0, back_memory: bool = False, seed: int = 0,
                 fail_after: int | None = None, fail_rate: float = 0.0,
                 fail_free: bool | int = False, fail_kind: str = "oom",
                 vm_granularity: int = DEFAULT_VM_GRANULARITY,
                 driver_costs: Any = None) -> None:
        cap = _size_arg(capacity, "capacity")
        if cap <= 0:
            raise InvalidInputError(f"capacity must be > 0 bytes, got {cap}")
        if cap > MAX_CAPACITY:
            raise InvalidInputError(
                f"capacity must be at most {format_bytes(MAX_CAPACITY)}, got {format_bytes(cap)}")
        align = _int_arg(alignment, "alignment", minimum=1)
        if align & (align - 1) or align > MAX_ALIGNMENT:
            raise InvalidInputError(
                f"alignment must be a power of two between 1 and {MAX_ALIGNMENT}, got {align}")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise InvalidInputError(f"name must be a non-empty string or None, got {name!r}")
        other = _size_arg(other_process_bytes, "other_process_bytes")
        if other > cap:
            raise InvalidInputError(
                f"other_process_bytes ({other}) cannot exceed capacity ({cap})")
        if not isinstance(back_memory, bool):
            raise InvalidInputError(f"back_memory must be True or False, got {back_memory!r}")
        seed_v = _int_arg(seed, "seed", minimum=None)
        vm_gran = _int_arg(vm_granularity, "vm_granularity", minimum=1)
        if vm_gran & (vm_gran - 1) or vm_gran > MAX_ALIGNMENT:
            raise InvalidInputError(f"vm_granularity must be a power of two between 1 and "
                                    f"{MAX_ALIGNMENT}, got {vm_gran}")
        meter = make_meter(driver_costs)

        self._lock = threading.Lock()
        self.index: int = -1
        self._capacity = cap
        self._alignment = align
        self._name = name if name is not None else f"SimDevice {format_bytes(cap)}"
        self._back_memory = back_memory
        self._base = _reserve_window(cap)
        self._ranges = RangeAllocator(cap)
        self._segments: dict[int, _Segment] = {}
        self._next_handle = 1
        self._other = other
        self._live_bytes = 0
        self._card = None                    # a SharedCard (gpumem_sim.shared_card)

        self._seed = seed_v
        self._rng = random.Random(seed_v)
        self._fail_after_left: int | None = _fail_after_arg(fail_after)
        self._fail_rate = _rate_arg(fail_rate)
        self._fail_free_left: float = _fail_free_arg(fail_free)
        self._fail_kind = _fail_kind_arg(fail_kind)

        self._streams_init()

        self._calls: deque[SimCall] = deque(maxlen=CALL_LOG_LIMIT)
        self._meter = meter
        self.alloc_calls = 0
        self.free_calls = 0
        self.failed_allocs = 0
        self.injected_failures = 0
        self.failed_frees = 0
        self.synchronize_calls = 0
        self.mem_get_info_calls = 0
        self.stream_query_calls = 0          # stream_idle(): charged, not logged
        self.peak_live_bytes = 0
        self._vm_init(vm_gran, seed_v, _reserve_window(cap * VA_WINDOW_FACTOR))

    # --- read-only configuration --------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def name(self) -> str:
        return self._name

    @property
    def back_memory(self) -> bool:
        return self._back_memory

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def base_address(self) -> int:
        """First address of this device's window; segments lie in ``[base, base + capacity)``."""
        return self._base

    @property
    def other_process_bytes(self) -> int:
        return self._other

    @property
    def device_string(self) -> str:
        return f"sim:{self.index}" if self.index >= 0 else "sim:? (not installed)"

    def __repr__(self) -> str:
        return (f"<SimDevice {self.device_string} {self._name!r} capacity={self._capacity} "
                f"live_segments={len(self._segments)} live_bytes={self._live_bytes}>")

    # --- observation ------------------------------------------------------------------------------
    @property
    def live_segments(self) -> int:
        """Number of segments allocated and not yet freed."""
        return len(self._segments)

    @property
    def live_bytes(self) -> int:
        """Bytes reserved by live segments (each rounded up to the alignment)."""
        return self._live_bytes

    @property
    def calls(self) -> list[SimCall]:
        """The driver calls that change state so far (alloc, free, synchronize and the
        ``vm_*`` calls), oldest first; the last ``CALL_LOG_LIMIT`` are kept. Queries
        (mem_get_info, events) are counted, not logged, so polling cannot push the allocation
        history out of the log."""
        with self._lock:
            return list(self._calls)

    def clear_calls(self) -> None:
        """Empty :attr:`calls` (counters are kept; see :meth:`reset_counters`)."""
        with self._lock:
            self._calls.clear()

    def reset_counters(self) -> None:
        """Zero every call counter and empty :attr:`calls`; live state is untouched."""
        with self._lock:
            self._calls.clear()
            self.alloc_calls = self.free_calls = self.failed_allocs = 0
            self.injected_failures = self.failed_frees = 0
            self.synchronize_calls = self.mem_get_info_calls = self.stream_query_calls = 0
            self.peak_live_bytes = self._live_bytes
            if self._meter is not None:
                self._meter.reset()

    def segments(self) -> list[SimSegment]:
        """Every live segment, in address order."""
        with self._lock:
            segs = sorted(self._segments.values(), key=lambda s: s.offset)
            return [SimSegment(s.handle, self._base + s.offset, s.nbytes, s.reserved) for s in segs]

    def largest_free_range(self) -> int:
        """Largest contiguous free part of the address window: the biggest segment that could
        be placed if physical memory allowed it."""
        with self._lock:
            return self._ranges.largest()

    @property
    def faults(self) -> dict[str, Any]:
        """The armed faults: ``fail_after_left`` (allocations still allowed, or None),
        ``fail_rate``, ``fail_free_left`` (inf, a count, or 0) and ``fail_kind``."""
        with self._lock:
            return {"fail_after_left": self._fail_after_left, "fail_rate": self._fail_rate,
                    "fail_free_left": self._fail_free_left, "fail_kind": self._fail_kind}

    # --- test controls --------------------------------------------------------------------------
    def inject(self, *, fail_after: int | None = _UNSET, fail_rate: float = _UNSET,
               fail_free: bool | int = _UNSET, fail_kind: str = _UNSET,
               seed: int = _UNSET) -> None:
        """Arm faults at run time; only the arguments given change. ``fail_after=n`` starts a
        new count (the next ``n`` allocation calls pass); ``seed`` restarts the random stream.
        All arguments are validated before anything changes."""
        after = _fail_after_arg(fail_after) if fail_after is not _UNSET else _UNSET
        rate = _rate_arg(fail_rate) if fail_rate is not _UNSET else _UNSET
        free = _fail_free_arg(fail_free) if fail_free is not _UNSET else _UNSET
        kind = _fail_kind_arg(fail_kind) if fail_kind is not _UNSET else _UNSET
        seed_v = _int_arg(seed, "seed", minimum=None) if seed is not _UNSET else _UNSET
        with self._lock:
            if after is not _UNSET:
                self._fail_after_left = after
            if rate is not _UNSET:
                self._fail_rate = rate
            if free is not _UNSET:
                self._fail_free_left = free
            if kind is not _UNSET:
                self._fail_kind = kind
            if seed_v is not _UNSET:
                self._seed = seed_v
                self._rng = random.Random(seed_v)

    def clear_faults(self) -> None:
        """Disarm every injected fault (the random stream keeps its position)."""
        with self._lock:
            self._fail_after_left = None
            self._fail_rate = 0.0
            self._fail_free_left = 0
            self._fail_kind = "oom"
            self._vm_clear_faults()

    def set_other_process_bytes(self, nbytes: int | str) -> None:
        """Simulate other processes taking (or releasing) device memory. They can only take
        what is free: ``nbytes`` may not exceed ``capacity - live_bytes``."""
        n = _size_arg(nbytes, "other_process_bytes")
        with self._lock:
            room = self._capacity - self._live_bytes
            if n > room:
                raise InvalidInputError(
                    f"other_process_bytes={n} does not fit on {self.device_string}: capacity "
                    f"{self._capacity} minus {self._live_bytes} bytes in live segments leaves {room}")
            self._other = n

    # --- Device protocol: queries ------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        return DeviceProperties(
            name=self._name, total_memory=self._capacity, alignment=self._alignment,
            extra={"simulated": True, "seed": self._seed, "back_memory": self._back_memory,
                   "base_address": self._base,
                   "vm_granularity": self._vm_gran})

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            self.mem_get_info_calls += 1
            if self._meter is not None:
                self._meter.charge("mem_get_info")
            free = self._capacity - self._other - self._live_bytes - self._card_others()
            return max(free, 0), self._capacity

    # --- Device protocol: segments -----------------------------------------------------------
    def alloc_segment(self, nbytes: int) -> tuple[int, int]:
        """Reserve ``nbytes`` (rounded up to the alignment) at an aligned address; returns
        ``(handle, base)``. Handles are never reused, so a stale handle is always detected."""
        n = _int_arg(nbytes, "nbytes", minimum=1)
        reserved = -(-n // self._alignment) * self._alignment
        with self._lock:
            self.alloc_calls += 1
            injected = self._alloc_fault(f"call {self.alloc_calls}")
            if injected is not None:
                self.failed_allocs += 1
                self.injected_failures += 1
                if self._fail_kind == "error":
                    self._record(SimCall("alloc", n, None, "injected_error"))
                    exc: DriverError = DriverError(
                        f"{self.device_string}: injected driver error allocating {n} bytes "
                        f"({injected})", code=SIM_ERROR_INJECTED[0],
                        code_name=SIM_ERROR_INJECTED[1])
                else:
                    self._record(SimCall("alloc", n, None, "injected_oom"))
                    exc = DriverOutOfMemory(
                        f"{self.device_string}: out of memory allocating {n} bytes (injected: "
                        f"{injected})", code=SIM_ERROR_OUT_OF_MEMORY[0],
                        code_name=SIM_ERROR_OUT_OF_MEMORY[1])
                exc.injected = True  # type: ignore[attr-defined]
                raise exc

            free = self._capacity - self._other - self._live_bytes - self._card_others()
            offset = self._ranges.alloc(reserved) if reserved <= free else None
            if offset is not None and self._card is not None and not self._card.charge(reserved):
                self._ranges.free(offset, reserved)      # another process took it meanwhile
                offset, free = None, 0
            if offset is None:
                self.failed_allocs += 1
                self._record(SimCall("alloc", n, None, "oom"))
                if reserved > free:
                    why = f"{format_bytes(free)} free of {format_bytes(self._capacity)}"
                else:
                    why = (f"{format_bytes(free)} free but the address space is fragmented: the "
                           f"largest contiguous range is {format_bytes(self._ranges.largest())}")
                oom = DriverOutOfMemory(
                    f"{self.device_string}: out of memory allocating {format_bytes(n)} "
                    f"({reserved} bytes reserved): {why}",
                    code=SIM_ERROR_OUT_OF_MEMORY[0], code_name=SIM_ERROR_OUT_OF_MEMORY[1])
                oom.injected = False  # type: ignore[attr-defined]
                raise oom

            store = None
            if self._back_memory:
                try:
                    store = mmap.mmap(-1, reserved, **_MMAP_KW)
                except (OSError, ValueError, OverflowError) as e:
                    self._ranges.free(offset, reserved)
                    if self._card is not None:
                        self._card.charge(-reserved)
                    self.failed_allocs += 1
                    self._record(SimCall("alloc", n, None, "oom"))
                    oom = DriverOutOfMemory(
                        f"{self.device_string}: cannot back {format_bytes(reserved)} with host "
                        f"memory ({e}); use back_memory=False for large simulated segments",
                        code=SIM_ERROR_OUT_OF_MEMORY[0], code_name=SIM_ERROR_OUT_OF_MEMORY[1])
                    oom.injected = False  # type: ignore[attr-defined]
                    raise oom from e
            handle = self._next_handle
            self._next_handle += 1
            self._segments[handle] = _Segment(handle, offset, n, reserved, store)
            self._live_bytes += reserved
            if self._live_bytes > self.peak_live_bytes:
                self.peak_live_bytes = self._live_bytes
            self._record(SimCall("alloc", n, handle, "ok"))
            return handle, self._base + offset

    def free_segment(self, handle: int) -> None:
        """Return a segment; its bytes are discarded and its handle becomes unknown. Raises
        InvalidInputError for an unknown (e.g. already freed) handle and DriverError when a
        failing free is injected (the segment then stays allocated)."""
        h = _int_arg(handle, "handle", minimum=None)
        with self._lock:
            seg = self._segment(h)
            self.free_calls += 1
            if self._fail_free_left > 0:
                self._fail_free_left -= 1
                self.failed_frees += 1
                self._record(SimCall("free", seg.nbytes, h, "injected_error"))
                exc = DriverError(
                    f"{self.device_string}: injected failure freeing segment {h} "
                    f"({seg.nbytes} bytes); the segment is still allocated",
                    code=SIM_ERROR_INJECTED[0], code_name=SIM_ERROR_INJECTED[1])
                exc.injected = True  # type: ignore[attr-defined]
                raise exc
            if self._card is not None:
                # first: a card that raises (its ledger's lock) leaves the segment allocated
                self._card.charge(-seg.reserved)
            del self._segments[h]
            self._ranges.free(seg.offset, seg.reserved)
            self._live_bytes -= seg.reserved
            if seg.store is not None:
                seg.store.close()
                seg.store = None
            self._record(SimCall("free", seg.nbytes, h, "ok"))

    def segment_size(self, handle: int) -> int:
        """The byte count of a live segment (InvalidInputError for an unknown handle)."""
        with self._lock:
            return self._segment(handle).nbytes

    def resolve(self, handle: int, offset: int, nbytes: int) -> int:
        """The address of ``nbytes`` at ``offset`` in the segment (checked to lie inside it)."""
        with self._lock:
            res = self._vm_span(handle, offset, nbytes)
            if res is not None:
                return res.address + offset
            seg = self._checked(handle, offset, nbytes)
            return self._base + seg.offset + offset

    # --- Device protocol: data movement ----------------------------------------------------
    def copy_from_host(self, handle: int, offset: int, src: memoryview, stream: int = 0) -> None:
        mv = _bytes_view(src, "src", writable=False)
        with self._lock:
            self._stream(stream)
            res = self._vm_span(handle, offset, mv.nbytes)
            if res is not None:
                return self._vm_write(res, offset, mv)
            seg = self._checked(handle, offset, mv.nbytes)
            store = self._store(seg)
            store[offset:offset + mv.nbytes] = mv

    def copy_to_host(self, handle: int, offset: int, dst: memoryview, stream: int = 0) -> None:
        mv = _bytes_view(dst, "dst", writable=True)
        with self._lock:
            self._stream(stream)
            res = self._vm_span(handle, offset, mv.nbytes)
            if res is not None:
                return self._vm_read(res, offset, mv)
            seg = self._checked(handle, offset, mv.nbytes)
            store = self._store(seg)
            mv[:] = store[offset:offset + mv.nbytes]

    def memset(self, handle: int, offset: int, value: int, nbytes: int, stream: int = 0) -> None:
        v = _int_arg(value, "value")
        if v > 255:
            raise InvalidInputError(f"value must be a byte (0..255), got {v}")
        with self._lock:
            self._stream(stream)
            res = self._vm_span(handle, offset, _int_arg(nbytes, "nbytes"))
            if res is not None:
                return self._vm_fill(res, offset, v, nbytes)
            seg = self._checked(handle, offset, nbytes)
            store = self._store(seg)
            chunk = 1 << 20
            pattern = bytes([v]) * min(chunk, max(nbytes, 1))
            pos, end = offset, offset + nbytes
            while pos < end:
                step = min(chunk, end - pos)
                store[pos:pos + step] = pattern[:step]
                pos += step

    def close(self) -> None:
        """Nothing to release: segments stay allocated until freed (idempotent)."""

    # --- helpers (call with the lock held) ---------------------------------------------------
    def _alloc_fault(self, call: str) -> str | None:
        """The armed fail_after / fail_rate fault of one raw allocation (a segment, or a page
        created by vm_create): why it fails, or None. One draw per call, whatever is armed."""
        u = self._rng.random()
        if self._fail_after_left is not None:
            if self._fail_after_left == 0:
                return f"fail_after: the allowed allocations are used up ({call})"
            self._fail_after_left -= 1
        if u < self._fail_rate:
            return f"fail_rate={self._fail_rate} (seed {self._seed}, {call})"
        return None

    def _record(self, call: SimCall) -> None:
        """Log a driver call and charge its modeled time (the fixed part only when it
        failed: the driver spent the call's overhead, not the per-byte work)."""
        self._calls.append(call)
        if self._meter is not None:
            self._meter.charge(call.op, call.nbytes, call.outcome == "ok")

    def _segment(self, handle: Any) -> _Segment:
        seg = self._segments.get(handle) if isinstance(handle, int) else None
        if seg is None or isinstance(handle, bool):
            raise InvalidInputError(
                f"unknown segment handle {handle!r} on {self.device_string} (never allocated "
                f"or already freed)")
        return seg

    def _checked(self, handle: Any, offset: Any, nbytes: Any) -> _Segment:
        seg = self._segment(handle)
        off = _int_arg(offset, "offset")
        n = _int_arg(nbytes, "nbytes")
        if off + n > seg.nbytes:
            raise InvalidInputError(
                f"range [{off}, {off + n}) is outside segment {seg.handle} of {seg.nbytes} bytes "
                f"on {self.device_string}")
        return seg

    def _store(self, seg: _Segment) -> mmap.mmap:
        if seg.store is None:
            raise InvalidInputError(
                f"{self.device_string} was created with back_memory=False, so its segments hold "
                f"no bytes to copy or set; use SimDevice(..., back_memory=True)")
        return seg.store
