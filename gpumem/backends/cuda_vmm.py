"""Virtual memory on CUDA: the ``vm_*`` calls of the backend protocol over the driver's VMM API
(``cuMemGetAllocationGranularity``, ``cuMemAddressReserve``/``Free``, ``cuMemCreate``/``Release``,
``cuMemMap`` + ``cuMemSetAccess``, ``cuMemUnmap``), each through
:func:`gpumem.backends.cuda_driver.check` with the device's primary context current, like every
other call of the cuda backend. :meth:`CudaVirtualMemory.vm_map_many` maps several handles side
by side and grants access to the whole range with one cuMemSetAccess (its range may hold several
whole mappings), as PyTorch's expandable segments do.

These calls run on the pool's miss and release paths only, so they go through
``cuda.bindings.driver`` (the Cython fast path covers the per-allocation calls).

:class:`CudaVirtualMemory` is a mixin of :class:`~gpumem.backends.cuda.CudaDevice`; the state it
adds (live reservations, for resolve/copies, and page handles) is guarded by the device's lock.
"""
from __future__ import annotations

from typing import Any, Sequence

from gpumem.backends.cuda_driver import check
from gpumem.errors import DriverError, InvalidInputError

__all__ = ["CudaVirtualMemory"]


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{what} must be a positive int, got {value!r}")
    return value


class CudaVirtualMemory:
    """``vm_*`` for :class:`~gpumem.backends.cuda.CudaDevice` (a mixin)."""

    # provided by CudaDevice
    _drv: Any
    _dev: Any
    _lock: Any
    index: int
    device_string: str

    def _vm_init(self) -> None:
        self._vm_supported: bool | None = None
        self._vm_gran = 0
        self._reservations: dict[int, int] = {}    # address -> bytes
        self._pages: dict[int, Any] = {}           # handle value -> CUmemGenericAllocationHandle
        self._mappings: dict[int, int] = {}        # address -> bytes

    def _alloc_prop(self) -> Any:
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.index
        return prop

    @property
    def supports_virtual_memory(self) -> bool:
        """The device attribute VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (probed once)."""
        if self._vm_supported is None:
            drv = self._drv
            attr = getattr(drv.CUdevice_attribute,
                           "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", None)
            try:
                ok = attr is not None and bool(int(check(
                    drv, drv.cuDeviceGetAttribute(attr, self._dev), "cuDeviceGetAttribute")))
            except DriverError:
                ok = False
            self._vm_supported = ok
        return self._vm_supported

    def _require_vm(self, call: str) -> None:
        if not self.supports_virtual_memory:
            raise self._no_virtual_memory(call)     # type: ignore[attr-defined]

    def vm_granularity(self) -> int:
        self._require_vm("vm_granularity")
        if not self._vm_gran:
            drv = self._drv
            flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            self._vm_gran = int(self._call("cuMemGetAllocationGranularity",  # type: ignore[attr-defined]
                                           drv.cuMemGetAllocationGranularity,
                                           self._alloc_prop(), flag))
        return self._vm_gran

    def _vm_size(self, nbytes: Any, what: str = "nbytes") -> int:
        n = _positive(nbytes, what)
        g = self.vm_granularity()
        if n % g:
            raise InvalidInputError(f"{self.device_string}: {what}={n} is not a multiple of the "
                                    f"VMM granularity {g}")
        return n

    def vm_reserve(self, nbytes: int) -> int:
        n = self._vm_size(nbytes)
        ptr = int(self._call("cuMemAddressReserve", self._drv.cuMemAddressReserve,  # type: ignore[attr-defined]
                             n, self.vm_granularity(), 0, 0))
        with self._lock:
            self._reservations[ptr] = n
        return ptr

    def vm_free(self, address: int, nbytes: int) -> None:
        n = self._vm_size(nbytes)
        with self._lock:
            if self._reservations.get(address) != n:
                raise InvalidInputError(f"{self.device_string}: no reservation of {n} bytes at "
                                        f"{address!r}")
        self._call("cuMemAddressFree", self._drv.cuMemAddressFree, address, n)  # type: ignore[attr-defined]
        with self._lock:
            del self._reservations[address]

    def vm_create(self, nbytes: int) -> int:
        n = self._vm_size(nbytes)
        h = self._call("cuMemCreate", self._drv.cuMemCreate, n, self._alloc_prop(), 0)  # type: ignore[attr-defined]
        with self._lock:
            self._pages[int(h)] = h
        return int(h)

    def vm_release(self, handle: int) -> None:
        with self._lock:
            h = self._pages.get(handle)
        if h is None:
            raise InvalidInputError(f"{self.device_string}: unknown page handle {handle!r}")
        self._call("cuMemRelease", self._drv.cuMemRelease, h)  # type: ignore[attr-defined]
        with self._lock:
            del self._pages[handle]

    def _access_desc(self) -> Any:
        drv = self._drv
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return access

    def vm_map(self, address: int, nbytes: int, handle: int) -> None:
        self._map_pages(address, [(handle, nbytes)])

    def vm_map_many(self, address: int, handles: Sequence[tuple[int, int]]) -> None:
        """cuMemMap for each ``(handle, nbytes)`` side by side from ``address``, then one
        cuMemSetAccess over the whole range (it may hold several whole mappings). On failure
        every mapping of this call is undone."""
        self._map_pages(address, handles)

    def _map_pages(self, address: int, handles: Sequence[tuple[int, int]]) -> None:
        pairs = [(self._vm_size(n), handle) for handle, n in handles]
        if not pairs:
            raise InvalidInputError("vm_map_many needs at least one (handle, nbytes) pair")
        objs = []
        with self._lock:
            for _, handle in pairs:
                h = self._pages.get(handle)
                if h is None:
                    raise InvalidInputError(f"{self.device_string}: unknown page handle "
                                            f"{handle!r}")
                objs.append(h)
        drv = self._drv
        done: list[tuple[int, int]] = []
        at = address
        try:
            for (n, _), h in zip(pairs, objs):
                self._call("cuMemMap", drv.cuMemMap, at, n, 0, h, 0)  # type: ignore[attr-defined]
                done.append((at, n))
                at += n
            self._call("cuMemSetAccess", drv.cuMemSetAccess, address, at - address,  # type: ignore[attr-defined]
                       [self._access_desc()], 1)
        except BaseException:
            for a, n in reversed(done):             # nothing stays mapped on failure
                drv.cuMemUnmap(a, n)
            raise
        with self._lock:
            for a, n in done:
                self._mappings[a] = n

    def vm_unmap(self, address: int, nbytes: int) -> None:
        n = self._vm_size(nbytes)
        self._call("cuMemUnmap", self._drv.cuMemUnmap, address, n)  # type: ignore[attr-defined]
        with self._lock:
            self._mappings.pop(address, None)

    def _reservation_size(self, handle: int) -> int | None:
        """Bytes of the reservation at ``handle`` (for resolve and copies), None if none."""
        with self._lock:
            return self._reservations.get(handle)

    def _vm_close(self) -> list[tuple[str, tuple]]:
        """Driver calls that return what is left (close()): mappings, pages, reservations, in
        the order the driver needs. The caller makes them with the context current and
        ignores failures."""
        with self._lock:
            mappings = list(self._mappings.items())
            pages = list(self._pages.values())
            reservations = list(self._reservations.items())
            self._mappings.clear()
            self._pages.clear()
            self._reservations.clear()
        return ([("cuMemUnmap", (a, n)) for a, n in mappings]
                + [("cuMemRelease", (h,)) for h in pages]
                + [("cuMemAddressFree", (a, n)) for a, n in reservations])
