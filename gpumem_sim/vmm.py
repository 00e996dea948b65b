"""Virtual memory on the simulated device: reserved address ranges and physical pages.

The model follows the CUDA VMM rules that gpumem's backend protocol keeps (see
:mod:`gpumem.backends.base`), enforced strictly so that a pool bug shows up as an exception:

- Reserved address space is free: reservations come from a window of their own (16 times the
  capacity) and do not count against ``mem_get_info``. Physical page handles do, exactly like
  segments, and a page that does not fit fails with ``DriverOutOfMemory``.
- Every size and address is a multiple of :attr:`VirtualMemory.vm_granularity`.
- :meth:`VirtualMemory.vm_map_many` maps several handles side by side and grants access to the
  whole range once (CUDA: one cuMemMap per handle, one cuMemSetAccess over a range that holds
  whole mappings); it is logged as one ``vm_map_many`` entry per handle and one
  ``vm_set_access`` entry, so the cost model charges each cuMemMap and the one access call.
- A handle is mapped whole, at most once, inside one reservation, over unmapped bytes only; a
  mapped handle cannot be released and a reservation with mappings cannot be freed.
- A reservation's address is a segment handle for resolve / copies / memset; copies and memset
  touching unmapped bytes fail (with ``back_memory=True``; without it there are no bytes).
- Faults (:meth:`VirtualMemory.inject_vm`): fail page creation or mapping after ``n`` more calls
  and/or at a rate, from their own ``random.Random(seed)``. The device's own ``inject()`` faults
  apply too: a page creation is a raw allocation (``fail_after``, ``fail_rate``, ``fail_kind``)
  and a page release a free (``fail_free``), so a test that fails "the driver's allocations"
  does so whether the pool uses segments or pages.
  Creation fails with ``DriverOutOfMemory``; mapping too, or with a plain ``DriverError`` when
  the device's ``fail_kind`` is ``"error"``.
- Counters for leak tests: ``live_page_handles``, ``live_mappings``, ``live_reservations``,
  ``mapped_bytes``, and per-call counts in ``vm_calls``.

:class:`VirtualMemory` is a mixin of :class:`~gpumem_sim.device.SimDevice`: it uses that
device's lock, capacity accounting, call log and argument checks.
"""
from __future__ import annotations

import bisect
import mmap
import random
from typing import Any

from gpumem.errors import DriverError, DriverOutOfMemory, InvalidInputError
from gpumem.units import format_bytes
from gpumem_sim._common import _MMAP_KW, SimCall, _fail_after_arg, _int_arg, _rate_arg
from gpumem_sim._ranges import RangeAllocator

__all__ = ["VirtualMemory", "DEFAULT_VM_GRANULARITY", "VA_WINDOW_FACTOR"]

#: The sim's page size (CUDA reports 2 MiB on current GPUs).
DEFAULT_VM_GRANULARITY = 2 << 20
#: The address window for reservations is this many times the capacity.
VA_WINDOW_FACTOR = 16

_VM_OPS = ("reserve", "free", "create", "map", "set_access", "unmap", "release")


class _Fault:
    """Fail after ``after`` more counted calls and/or with probability ``rate`` per call."""

    __slots__ = ("after", "rate", "rng", "calls")

    def __init__(self, seed: int) -> None:
        self.after: int | None = None
        self.rate = 0.0
        self.rng = random.Random(seed)
        self.calls = 0

    def fires(self) -> str | None:
        self.calls += 1
        u = self.rng.random()              # one draw per counted call, whatever is armed
        if self.after is not None:
            if self.after == 0:
                return f"the allowed calls are used up (call {self.calls})"
            self.after -= 1
        if u < self.rate:
            return f"rate {self.rate} (call {self.calls})"
        return None


class _Page:
    __slots__ = ("handle", "nbytes", "store", "mapped_at")

    def __init__(self, handle: int, nbytes: int, store: mmap.mmap | None) -> None:
        self.handle = handle
        self.nbytes = nbytes
        self.store = store
        self.mapped_at: int | None = None   # address, while mapped


class _Reservation:
    __slots__ = ("address", "nbytes", "starts", "pages")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes
        self.starts: list[int] = []          # offsets of mappings, sorted
        self.pages: dict[int, _Page] = {}    # offset -> mapped page

    def mapping_at(self, offset: int) -> tuple[int, _Page] | None:
        """The mapping covering ``offset``: (its start offset, page), or None."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if i >= 0:
            start = self.starts[i]
            page = self.pages[start]
            if offset < start + page.nbytes:
                return start, page
        return None

    def overlaps(self, offset: int, nbytes: int) -> bool:
        i = bisect.bisect_left(self.starts, offset + nbytes) - 1
        return i >= 0 and self.starts[i] + self.pages[self.starts[i]].nbytes > offset


class VirtualMemory:
    """The ``vm_*`` calls of :class:`~gpumem_sim.device.SimDevice` (a mixin)."""

    # provided by SimDevice
    _lock: Any
    _capacity: int
    _other: int
    _live_bytes: int
    _card: Any
    _card_others: Any
    _back_memory: bool
    _fail_kind: str
    _fail_free_left: Any
    _record: Any
    _alloc_fault: Any
    injected_failures: int
    failed_frees: int
    peak_live_bytes: int

    def _vm_init(self, granularity: int, seed: int, window: int) -> None:
        self._vm_gran = granularity
        self._va_base = window           # from _reserve_window(capacity * VA_WINDOW_FACTOR)
        self._va = RangeAllocator(self._capacity * VA_WINDOW_FACTOR)
        self._reservations: dict[int, _Reservation] = {}
        self._res_starts: list[int] = []
        self._pages: dict[int, _Page] = {}
        self._next_page = 1
        self._create_fault = _Fault(seed)
        self._map_fault = _Fault(seed + 1)
        self.vm_calls = dict.fromkeys(_VM_OPS, 0)
        self.mapped_bytes = 0

    # --- observation ------------------------------------------------------------------------------
    @property
    def supports_virtual_memory(self) -> bool:
        return True

    @property
    def live_page_handles(self) -> int:
        """Physical page handles created and not yet released."""
        return len(self._pages)

    @property
    def live_mappings(self) -> int:
        return sum(len(r.pages) for r in self._reservations.values())

    @property
    def live_reservations(self) -> int:
        return len(self._reservations)

    def inject_vm(self, *, create_after: int | None | Any = ..., create_rate: float | Any = ...,
                  map_after: int | None | Any = ..., map_rate: float | Any = ...) -> None:
        """Arm faults of :meth:`vm_create` / :meth:`vm_map`: ``*_after=n`` lets the next ``n``
        calls through and fails the later ones (``None`` disarms); ``*_rate=p`` fails each
        call with probability ``p``. Only the arguments given change; all are checked first."""
        ca = _fail_after_arg(create_after) if create_after is not ... else ...
        cr = _rate_arg(create_rate, "create_rate") if create_rate is not ... else ...
        ma = _fail_after_arg(map_after) if map_after is not ... else ...
        mr = _rate_arg(map_rate, "map_rate") if map_rate is not ... else ...
        with self._lock:
            for fault, after, rate in ((self._create_fault, ca, cr), (self._map_fault, ma, mr)):
                if after is not ...:
                    fault.after = after
                if rate is not ...:
                    fault.rate = rate

    def _vm_clear_faults(self) -> None:
        for fault in (self._create_fault, self._map_fault):
            fault.after = None
            fault.rate = 0.0

    # --- the protocol -------------------------------------------------------------------------------
    def vm_granularity(self) -> int:
        return self._vm_gran

    def _vm_size(self, nbytes: Any, what: str = "nbytes") -> int:
        if type(nbytes) is int and nbytes > 0 and not nbytes % self._vm_gran:
            return nbytes                  # the common case, without the general checks
        n = _int_arg(nbytes, what, minimum=1)
        if n % self._vm_gran:
            raise InvalidInputError(
                f"{what}={n} is not a multiple of the granularity {self._vm_gran} "
                f"({format_bytes(self._vm_gran)}) on {self.device_string}")
        return n

    def _vm_log(self, op: str, nbytes: int, handle: int | None, outcome: str = "ok",
                logged_as: str | None = None) -> None:
        self.vm_calls[op] += 1
        # logs and charges it
        self._record(SimCall(logged_as or "vm_" + op, nbytes, handle, outcome))

    def vm_reserve(self, nbytes: int) -> int:
        n = self._vm_size(nbytes)
        with self._lock:
            offset = self._va.alloc(n)
            if offset is None:
                self._vm_log("reserve", n, None, "oom")
                raise DriverOutOfMemory(
                    f"{self.device_string}: no {format_bytes(n)} of address space left to "
                    f"reserve (largest free range {format_bytes(self._va.largest())})")
            address = self._va_base + offset
            self._reservations[address] = _Reservation(address, n)
            bisect.insort(self._res_starts, address)
            self._vm_log("reserve", n, address)
            return address

    def vm_free(self, address: int, nbytes: int) -> None:
        n = self._vm_size(nbytes)
        with self._lock:
            res = self._reservations.get(address) if isinstance(address, int) else None
            if res is None or isinstance(address, bool):
                raise InvalidInputError(f"{self.device_string}: {address!r} is not the address "
                                        f"of a live reservation")
            if res.nbytes != n:
                raise InvalidInputError(f"{self.device_string}: the reservation at {address:#x} "
                                        f"is {res.nbytes} bytes, not {n}")
            if res.pages:
                raise InvalidInputError(
                    f"{self.device_string}: the reservation at {address:#x} still has "
                    f"{len(res.pages)} mapping(s); unmap them before freeing it")
            del self._reservations[address]
            self._res_starts.remove(address)
            self._va.free(address - self._va_base, n)
            self._vm_log("free", n, address)

    def vm_create(self, nbytes: int) -> int:
        n = self._vm_size(nbytes)
        with self._lock:
            injected = self._create_fault.fires()
            if injected is None:                 # a page is a raw allocation too (inject())
                injected = self._alloc_fault(f"page creation {self.vm_calls['create'] + 1}")
                if injected is not None:
                    self.injected_failures += 1
                    if self._fail_kind == "error":
                        self._vm_log("create", n, None, "injected_error")
                        err = DriverError(f"{self.device_string}: injected driver error "
                                          f"creating a {format_bytes(n)} page ({injected})")
                        err.injected = True  # type: ignore[attr-defined]
                        raise err
            if injected is not None:
                self._vm_log("create", n, None, "injected_oom")
                exc = DriverOutOfMemory(f"{self.device_string}: out of memory creating a "
                                        f"{format_bytes(n)} page (injected: {injected})")
                exc.injected = True  # type: ignore[attr-defined]
                raise exc
            free = self._capacity - self._other - self._live_bytes - self._card_others()
            if n <= free and self._card is not None and not self._card.charge(n):
                free = 0                         # another process took it meanwhile
            if n > free:
                self._vm_log("create", n, None, "oom")
                exc = DriverOutOfMemory(f"{self.device_string}: out of memory creating a "
                                        f"{format_bytes(n)} page: {format_bytes(free)} free")
                exc.injected = False  # type: ignore[attr-defined]
                raise exc
            try:
                store = mmap.mmap(-1, n, **_MMAP_KW) if self._back_memory else None
            except BaseException:
                if self._card is not None:
                    self._card.charge(-n)
                raise
            handle = self._next_page
            self._next_page += 1
            self._pages[handle] = _Page(handle, n, store)
            self._live_bytes += n
            self.peak_live_bytes = max(self.peak_live_bytes, self._live_bytes)
            self._vm_log("create", n, handle)
            return handle

    def _vm_page(self, handle: Any) -> _Page:
        page = self._pages.get(handle) if isinstance(handle, int) else None
        if page is None or isinstance(handle, bool):
            raise InvalidInputError(f"{self.device_string}: unknown page handle {handle!r} "
                                    f"(never created or already released)")
        return page

    def _vm_reservation(self, address: Any) -> _Reservation | None:
        """The reservation containing ``address``, or None."""
        if isinstance(address, bool) or not isinstance(address, int):
            return None
        i = bisect.bisect_right(self._res_starts, address) - 1
        if i < 0:
            return None
        res = self._reservations[self._res_starts[i]]
        return res if address < res.address + res.nbytes else None

    def vm_map(self, address: int, nbytes: int, handle: int) -> None:
        n = self._vm_size(nbytes)
        with self._lock:
            self._vm_map_one(address, n, handle, "vm_map")

    def vm_map_many(self, address: int, handles: Any) -> None:
        """Map each ``(handle, nbytes)`` of ``handles`` in turn from ``address`` on and grant
        access to the whole range once. All or nothing: on a refused handle the ones this call
        mapped are unmapped again before the error propagates."""
        try:
            raw = [(h, n) for h, n in handles]
        except (TypeError, ValueError):
            raise InvalidInputError(f"handles must be (handle, nbytes) pairs, got "
                                    f"{handles!r}") from None
        pairs = [(h, self._vm_size(n)) for h, n in raw]
        if not pairs:
            raise InvalidInputError("vm_map_many needs at least one (handle, nbytes) pair")
        with self._lock:
            done: list[tuple[int, int]] = []
            at = address
            try:
                for handle, n in pairs:
                    self._vm_map_one(at, n, handle, "vm_map_many")
                    done.append((at, n))
                    at += n
            except BaseException:
                for a, n in reversed(done):         # nothing of this call stays mapped
                    self._vm_unmap_one(a, n, log=False)
                raise
            self._vm_log("set_access", at - address, None)

    def _vm_map_one(self, address: int, n: int, handle: int, op: str) -> None:
        """Map ``handle`` (``n`` bytes) at ``address``; lock held, ``n`` checked."""
        page = self._vm_page(handle)
        if page.nbytes != n:
            raise InvalidInputError(f"{self.device_string}: page {handle} is {page.nbytes} "
                                    f"bytes; it is mapped whole, not {n}")
        if page.mapped_at is not None:
            raise InvalidInputError(f"{self.device_string}: page {handle} is already mapped "
                                    f"at {page.mapped_at:#x}")
        res = self._vm_reservation(address)
        if res is None or address + n > res.address + res.nbytes:
            raise InvalidInputError(
                f"{self.device_string}: [{address:#x}, +{n}) does not lie inside one "
                f"reservation; map only into ranges from vm_reserve")
        if (address - res.address) % self._vm_gran:
            raise InvalidInputError(f"{self.device_string}: address {address:#x} is not "
                                    f"aligned to the granularity {self._vm_gran}")
        off = address - res.address
        if res.overlaps(off, n):
            raise InvalidInputError(f"{self.device_string}: [{address:#x}, +{n}) overlaps "
                                    f"a mapping; unmap it first")
        injected = self._map_fault.fires()
        if injected is not None:
            self._vm_log("map", n, handle, "injected_error", op)
            cls = DriverError if self._fail_kind == "error" else DriverOutOfMemory
            exc = cls(f"{self.device_string}: injected failure mapping page "
                      f"{handle} at {address:#x} ({injected})")
            exc.injected = True  # type: ignore[attr-defined]
            raise exc
        bisect.insort(res.starts, off)
        res.pages[off] = page
        page.mapped_at = address
        self.mapped_bytes += n
        self._vm_log("map", n, handle, "ok", op)

    def vm_unmap(self, address: int, nbytes: int) -> None:
        n = self._vm_size(nbytes)
        with self._lock:
            self._vm_unmap_one(address, n)

    def _vm_unmap_one(self, address: int, n: int, log: bool = True) -> None:
        """Remove the mapping of ``n`` bytes at ``address``; lock held. ``log=False``: the undo
        of a refused vm_map_many, which the driver never did (not logged, not charged)."""
        res = self._vm_reservation(address)
        page = res.pages.get(address - res.address) if res is not None else None
        if page is None:
            raise InvalidInputError(f"{self.device_string}: no mapping starts at "
                                    f"{address!r}")
        if page.nbytes != n:
            raise InvalidInputError(f"{self.device_string}: the mapping at {address:#x} is "
                                    f"{page.nbytes} bytes; unmap it whole, not {n}")
        off = address - res.address
        del res.pages[off]
        del res.starts[bisect.bisect_left(res.starts, off)]   # not list.remove: O(n) scan
        page.mapped_at = None
        self.mapped_bytes -= n
        if log:
            self._vm_log("unmap", n, page.handle)

    def vm_release(self, handle: int) -> None:
        with self._lock:
            page = self._vm_page(handle)
            if page.mapped_at is not None:
                raise InvalidInputError(f"{self.device_string}: page {handle} is still mapped at "
                                        f"{page.mapped_at:#x}; unmap it before releasing it")
            if self._fail_free_left > 0:         # inject(fail_free=...): a refused free
                self._fail_free_left -= 1
                self.failed_frees += 1
                self._vm_log("release", page.nbytes, handle, "injected_error")
                exc = DriverError(f"{self.device_string}: injected failure freeing page "
                                  f"{handle} ({format_bytes(page.nbytes)}); it is still "
                                  f"allocated")
                exc.injected = True  # type: ignore[attr-defined]
                raise exc
            if self._card is not None:
                # first: a card that raises (its ledger's lock) leaves the page allocated
                self._card.charge(-page.nbytes)
            del self._pages[handle]
            self._live_bytes -= page.nbytes
            if page.store is not None:
                page.store.close()
            self._vm_log("release", page.nbytes, handle)

    # --- reservations as segments (resolve, copies, memset) -------------------------------------
    def _vm_span(self, handle: Any, offset: int, nbytes: int) -> _Reservation | None:
        """The reservation named by ``handle`` after checking the range, or None if ``handle``
        names no reservation (the caller then treats it as a segment handle)."""
        res = self._reservations.get(handle) if isinstance(handle, int) else None
        if res is None or isinstance(handle, bool):
            return None
        offset = _int_arg(offset, "offset")
        nbytes = _int_arg(nbytes, "nbytes")
        if offset < 0 or nbytes < 0 or offset + nbytes > res.nbytes:
            raise InvalidInputError(f"range [{offset}, {offset + nbytes}) is outside the "
                                    f"reservation of {res.nbytes} bytes at {res.address:#x}")
        return res

    def _vm_pieces(self, res: _Reservation, offset: int, nbytes: int) -> list[tuple[Any, int, int]]:
        """``(store, start in store, length)`` covering the range; raises if any byte is
        unmapped or the device holds no bytes."""
        if not self._back_memory:
            raise InvalidInputError(
                f"{self.device_string} was created with back_memory=False, so its pages hold no "
                f"bytes to copy or set; use SimDevice(..., back_memory=True)")
        pieces = []
        pos, end = offset, offset + nbytes
        while pos < end:
            hit = res.mapping_at(pos)
            if hit is None:
                raise InvalidInputError(f"{self.device_string}: address {res.address + pos:#x} "
                                        f"is not mapped (access to unmapped virtual memory)")
            start, page = hit
            step = min(end, start + page.nbytes) - pos
            pieces.append((page.store, pos - start, step))
            pos += step
        return pieces

    def _vm_write(self, res: _Reservation, offset: int, data: memoryview) -> None:
        done = 0
        for store, at, n in self._vm_pieces(res, offset, data.nbytes):
            store[at:at + n] = data[done:done + n]
            done += n

    def _vm_read(self, res: _Reservation, offset: int, out: memoryview) -> None:
        done = 0
        for store, at, n in self._vm_pieces(res, offset, out.nbytes):
            out[done:done + n] = store[at:at + n]
            done += n

    def _vm_fill(self, res: _Reservation, offset: int, value: int, nbytes: int) -> None:
        for store, at, n in self._vm_pieces(res, offset, nbytes):
            store[at:at + n] = bytes([value]) * n
