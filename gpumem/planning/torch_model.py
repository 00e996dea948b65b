"""A model of PyTorch's CUDA caching allocator policy, to replay a trace as torch would place it.

Written from ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``); which commit,
what it leaves out and how it was checked is in docs/torch_model.md. The model keeps PyTorch's
decisions, weaknesses included, and none of its data: a block is a Python object with an
address and a size, the device is a byte budget (``capacity``), and each driver call is counted
(and priced by the sim's driver cost model where it exists) instead of made.

What it decides, as PyTorch does:

- sizes: below 512 B -> 512 B; else a multiple of 512 B, or with ``roundup_power2_divisions``
  the next of N steps between two powers of two (``round_size``);
- pools: requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones
  from the large pool, whose segments are 20 MiB for requests under 10 MiB and the request
  rounded up to 2 MiB otherwise (``get_allocation_size``). Free blocks are kept per pool in
  (stream, size, address) order and found best-fit (``get_free_block``);
- ``max_split_size_mb``: a request under it never takes a cached block at or over it, and a
  request at or over it takes a cached block only if that block is less than
  ``max_non_split_rounding_mb`` (20 MiB) larger; such requests never split their block;
- splitting (``should_split``): a small-pool block (or any block with expandable segments) when
  512 B or more would remain, a large-pool block when more than 1 MiB would remain;
- a freed block merges with free neighbours of its segment (``free_block``);
- when no cached block fits: garbage collection if a threshold and a per-process memory
  fraction are set, then a new segment (cudaMalloc); if the driver refuses, free cached
  oversize blocks (``release_available_cached_blocks``) and retry; then free every cached block
  that is a whole segment (``release_cached_blocks``) and retry; only then OutOfMemoryError;
- ``expandable_segments:True``: one segment per stream and pool that reserves 1 1/8 of the
  device's address space and maps 2 MiB pages (small pool) or 20 MiB pages (large pool) at its
  lowest free address as needed; mapped pages stay until an OOM retry or :meth:`empty_cache`
  unmaps the wholly free ones.

Thread safety: none; one model belongs to one thread (a replay, a tune worker).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.planning.torch_conf import UNLIMITED, TorchAllocatorConf, parse_torch_conf
from gpumem.units import format_bytes

__all__ = ["TorchAllocatorModel", "round_size", "allocation_size"]

KMIN_BLOCK = 512              # kMinBlockSize
KSMALL_SIZE = 1 << 20         # kSmallSize: largest small-pool request
KSMALL_BUFFER = 2 << 20       # kSmallBuffer: small-pool segment and expandable page
KLARGE_BUFFER = 20 << 20      # kLargeBuffer: segment for 1..10 MiB requests, large page
KMIN_LARGE_ALLOC = 10 << 20   # kMinLargeAlloc
KROUND_LARGE = 2 << 20        # kRoundLarge
_ONE_EXABYTE = 1 << 60        # allocate() refuses this much before the allocator sees it
_ADDR_MASK = (1 << 64) - 1
_VA_BASE = 0x7F00_0000_0000   # first modeled device address (any nonzero base would do)
_ROUNDED_CACHE = 1 << 16      # distinct request sizes whose rounding a model remembers


def round_size(size: int, conf: TorchAllocatorConf) -> int:
    """The block size PyTorch gives a request of ``size`` bytes (``round_size``)."""
    if size < KMIN_BLOCK:
        return KMIN_BLOCK
    div = conf.divisions(size)
    if div > 1 and size > KMIN_BLOCK * div:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // KMIN_BLOCK) * KMIN_BLOCK


def allocation_size(size: int) -> int:
    """Bytes of the segment a rounded ``size`` gets from cudaMalloc (``get_allocation_size``)."""
    if size <= KSMALL_SIZE:
        return KSMALL_BUFFER
    if size < KMIN_LARGE_ALLOC:
        return KLARGE_BUFFER
    return -(-size // KROUND_LARGE) * KROUND_LARGE


class _Segment:
    """An expandable segment: a reserved address range mapped page by page."""

    __slots__ = ("base", "page", "n_pages", "mapped")

    def __init__(self, base: int, page: int, n_pages: int) -> None:
        self.base, self.page, self.n_pages = base, page, n_pages
        self.mapped: set[int] = set()


class _Block:
    __slots__ = ("addr", "size", "stream", "small", "allocated", "mapped", "prev", "next",
                 "seg", "gc_base", "requested")

    def __init__(self, addr: int, size: int, stream: int, small: bool,
                 seg: _Segment | None = None, mapped: bool = True) -> None:
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg = seg
        self.gc_base = 0
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: "_Block | None", after: "_Block | None") -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


def _cost_model() -> Any:
    """The sim's driver cost model (``gpumem_sim.driver_costs``), or None where it is absent."""
    try:
        from gpumem_sim.driver_costs import DriverCostModel
    except ImportError:
        return None
    return DriverCostModel()


class TorchAllocatorModel:
    """PyTorch's CUDA caching allocator policy on a device of ``capacity`` bytes.

    ``conf`` is a PYTORCH_CUDA_ALLOC_CONF value (``"max_split_size_mb:128,expandable_segments:True"``);
    ``memory_fraction`` is ``torch.cuda.set_per_process_memory_fraction()``: the allocator then
    keeps its reserved bytes under that share of ``capacity`` (and only then does
    ``garbage_collection_threshold`` act, as in PyTorch).

    :meth:`malloc` returns a modeled device address (0 for 0 bytes, as torch gives a null
    pointer), :meth:`free` takes it back; a request torch would refuse after its own release
    and retry raises :class:`~gpumem.errors.OutOfMemoryError` and leaves the model as torch
    would (cached blocks released, the failure counted in ``num_ooms``).
    """

    def __init__(self, capacity: int | str, conf: str | TorchAllocatorConf = "", *,
                 memory_fraction: float | None = None) -> None:
        from gpumem.units import parse_size
        cap = parse_size(capacity, what="capacity")
        if cap <= 0:
            raise InvalidInputError(f"capacity must be > 0 bytes, got {capacity!r}")
        if memory_fraction is not None and (
                isinstance(memory_fraction, bool)
                or not isinstance(memory_fraction, (int, float))
                or not 0.0 <= memory_fraction <= 1.0):
            raise InvalidInputError(f"memory_fraction must be a number in [0, 1] "
                                    f"(torch.cuda.set_per_process_memory_fraction), got "
                                    f"{memory_fraction!r}")
        self.capacity = cap
        self.conf = parse_torch_conf(conf)
        #: ``allowed_memory_maximum`` when a fraction is set (``set_fraction``), else None
        self.limit = None if memory_fraction is None else int(memory_fraction * cap)
        self._gc_on = self.limit is not None and self.conf.garbage_collection_threshold > 0
        # free mapped blocks: per (small pool?, stream) a sorted list of size << 64 | addr
        self._free: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        self._unmapped: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        self._cached: dict[int, _Block] = {}        # addr -> free mapped block
        self._unmapped_blocks: dict[int, _Block] = {}
        self._active: dict[int, _Block] = {}        # addr -> allocated block
        self._segments: dict[int, _Segment | None] = {}  # base -> expandable segment / None
        self._gc_calls = [0, 0]                     # get_free_blocks_call_count per pool
        self._next_va = _VA_BASE
        self._device_used = 0                       # physical bytes held from the driver
        self.allocated_bytes = self.peak_allocated_bytes = 0
        self.requested_bytes = self.peak_requested_bytes = 0
        self.reserved_bytes = self.peak_reserved_bytes = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self.num_device_alloc = self.num_device_free = 0
        #: driver calls by name (the sim cost model's names: segment_alloc, vm_map, ...)
        self.driver_call_counts: dict[str, int] = {}
        self._costs = _cost_model()
        self._rounded: dict[int, tuple[int, int]] = {}   # request -> (block, segment) sizes
        #: modeled seconds of those calls (None without ``gpumem_sim.driver_costs``)
        self.modeled_driver_seconds: float | None = None if self._costs is None else 0.0

    # --- public API ---------------------------------------------------------------------------
    @property
    def driver_calls(self) -> int:
        """cudaMalloc/cudaFree calls, and the cuMem* and synchronize calls of expandable
        segments, refused ones included."""
        return sum(self.driver_call_counts.values())

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """The address of a block for ``nbytes`` on ``stream``, placed as PyTorch would."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidInputError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise InvalidInputError(f"stream must be an int >= 0, got {stream!r}")
        if nbytes == 0:
            return 0
        if nbytes >= _ONE_EXABYTE:
            raise self._oom(nbytes, nbytes, "torch refuses 1 EB or more before allocating")
        rounded = self._rounded.get(nbytes)
        if rounded is None:             # a pure function of the size: a trace repeats sizes
            rounded = (round_size(nbytes, self.conf), 0)
            rounded = (rounded[0], allocation_size(rounded[0]))
            if len(self._rounded) < _ROUNDED_CACHE:
                self._rounded[nbytes] = rounded
        size, alloc_size = rounded
        small = size <= KSMALL_SIZE
        block = self._get_free_block(size, stream, small)
        if block is None:
            if self._gc_on:
                self._garbage_collect()
            block = (self._alloc_block(size, alloc_size, stream, small, False)
                     or (self._release_available_cached_blocks(size, stream, small)
                         and self._alloc_block(size, alloc_size, stream, small, False))
                     or (self._release_cached_blocks()
                         and self._alloc_block(size, alloc_size, stream, small, True)))
            if not block:
                self.num_ooms += 1
                raise self._oom(nbytes, alloc_size, "after releasing every cached segment")
        return self._alloc_found_block(block, size, nbytes, self._should_split(block, size))

    def free(self, address: int) -> None:
        """Return the block at ``address`` to the cache (0 is ignored, as torch ignores null)."""
        if address == 0:
            return
        block = self._active.pop(address, None)
        if block is None:
            raise InvalidInputError(f"address {address:#x} is not a live allocation of this "
                                    f"model")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        self._free_block(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached block that is a whole segment
        (and unmap the wholly free pages of expandable segments)."""
        self._release_cached_blocks()

    def segments(self) -> list[dict[str, Any]]:
        """The segments held, by address, as torch's snapshot lists them: ``address``,
        ``total_size`` (mapped bytes), ``stream``, ``pool`` (small/large), ``expandable`` and
        ``blocks`` (``size``, ``allocated``) of its mapped blocks."""
        out = []
        by_addr = {**self._cached, **self._unmapped_blocks, **self._active}
        for base in sorted(self._segments):
            b: _Block | None = by_addr[base]
            blocks: list[dict[str, Any]] = []
            first = None
            while b is not None:
                if b.mapped:
                    if first is None:
                        first = b
                    blocks.append({"size": b.size, "allocated": b.allocated})
                b = b.next
            if first is None:
                continue
            out.append({"address": first.addr, "total_size": sum(x["size"] for x in blocks),
                        "stream": first.stream, "pool": "small" if first.small else "large",
                        "expandable": first.seg is not None, "blocks": blocks})
        return out

    def __repr__(self) -> str:
        return (f"<TorchAllocatorModel {format_bytes(self.capacity)} conf={self.conf.text!r}: "
                f"allocated {format_bytes(self.allocated_bytes)}, reserved "
                f"{format_bytes(self.reserved_bytes)}>")

    # --- bookkeeping ------------------------------------------------------------------------
    def _call(self, name: str, nbytes: int = 0, ok: bool = True) -> None:
        counts = self.driver_call_counts
        counts[name] = counts.get(name, 0) + 1
        if self._costs is not None:
            self.modeled_driver_seconds += self._costs.cost(name, nbytes if ok else 0)

    def _grow(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _new_va(self, nbytes: int, align: int) -> int:
        addr = -(-self._next_va // align) * align
        self._next_va = addr + nbytes
        return addr

    def _insert(self, b: _Block) -> None:       # insert_into_blocks
        b.gc_base = self._gc_calls[b.small]
        insort(self._free[b.small].setdefault(b.stream, []), (b.size << 64) | b.addr)
        self._cached[b.addr] = b

    def _erase(self, b: _Block) -> None:
        lst = self._free[b.small][b.stream]
        del lst[bisect_left(lst, (b.size << 64) | b.addr)]
        del self._cached[b.addr]

    def _insert_unmapped(self, b: _Block) -> None:
        insort(self._unmapped[b.small].setdefault(b.stream, []), b.addr)
        self._unmapped_blocks[b.addr] = b

    def _erase_unmapped(self, b: _Block) -> None:
        lst = self._unmapped[b.small][b.stream]
        del lst[bisect_left(lst, b.addr)]
        del self._unmapped_blocks[b.addr]

    def _oom(self, nbytes: int, alloc_size: int, why: str) -> OutOfMemoryError:
        largest = max((b.size for b in self._cached.values()), default=0)
        return OutOfMemoryError(
            nbytes, device=f"torch allocator model ({format_bytes(self.capacity)})",
            free=self.capacity - self._device_used, total=self.capacity,
            in_use=self.allocated_bytes, cached=self.reserved_bytes - self.allocated_bytes,
            limit=self.limit, largest_free_block=largest,
            reason=f"PyTorch would report 'Tried to allocate {format_bytes(alloc_size)}' "
                   f"{why}")

    # --- finding and splitting ----------------------------------------------------------
    def _get_free_block(self, size: int, stream: int, small: bool) -> _Block | None:
        if self._gc_on:
            self._gc_calls[small] += 1
        lst = self._free[small].get(stream)
        if not lst:
            return None
        i = bisect_left(lst, size << 64)
        if i == len(lst):
            return None
        cached = self._cached
        b = cached[lst[i] & _ADDR_MASK]
        if b.seg is not None:
            # best fit counts the unmapped space after a block as its size: a segment's tail
            # is taken only when no other block fits as closely
            def grown(x: _Block) -> int:
                n = x.next
                return x.size + (n.size if n is not None and not n.mapped else 0)
            j = i + 1
            while b.seg is not None and j < len(lst):
                nb = cached[lst[j] & _ADDR_MASK]
                if grown(nb) >= grown(b):
                    break
                b, j = nb, j + 1
        mss = self.conf.max_split_size
        if size < mss and b.size >= mss:
            return None                 # never an oversize block for a smaller request
        if size >= mss and b.size >= size + self.conf.max_non_split_rounding_size:
            return None
        self._erase(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.conf.expandable_segments:
            return remaining >= KMIN_BLOCK
        return size < self.conf.max_split_size and remaining > KSMALL_SIZE

    def _alloc_found_block(self, b: _Block, size: int, nbytes: int, split: bool) -> int:
        if split:
            rest = b
            b = _Block(rest.addr, size, rest.stream, rest.small, rest.seg)
            b.splice(rest.prev, rest)
            rest.addr += size
            rest.size -= size
            self._insert(rest)
        b.allocated = True
        b.requested = nbytes
        self._active[b.addr] = b
        self.allocated_bytes += b.size
        self.requested_bytes += nbytes
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        return b.addr

    def _free_block(self, b: _Block) -> None:
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._insert(b)

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            self._erase(src)
        else:
            self._erase_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # --- new memory -----------------------------------------------------------------------
    def _alloc_block(self, size: int, alloc_size: int, stream: int, small: bool,
                     retry: bool) -> _Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self.limit is not None and self.reserved_bytes + alloc_size > self.limit:
            return None                 # over the per-process fraction: no driver call
        if self.conf.expandable_segments:
            return self._try_allocate_expandable(size, stream, small)
        ok = self._device_used + alloc_size <= self.capacity
        self._call("segment_alloc", alloc_size, ok)
        if not ok:
            return None
        addr = self._new_va(alloc_size, KROUND_LARGE)
        b = _Block(addr, alloc_size, stream, small)
        self._segments[addr] = None
        self._device_used += alloc_size
        self._grow(alloc_size)
        self.num_device_alloc += 1
        return b

    def _release_block(self, b: _Block) -> None:    # cudaFree of a whole cached segment
        self._erase(b)
        del self._segments[b.addr]
        self._call("segment_free", b.size)
        self._device_used -= b.size
        self.reserved_bytes -= b.size
        self.num_device_free += 1

    def _release_available_cached_blocks(self, size: int, stream: int, small: bool) -> bool:
        mss = self.conf.max_split_size
        if mss == UNLIMITED:
            return False
        lst = self._free[small].get(stream, [])
        want = max(size, mss)
        i = bisect_left(lst, want << 64)
        cached = self._cached
        if i < len(lst) and cached[lst[i] & _ADDR_MASK].seg is None:
            self._release_block(cached[lst[i] & _ADDR_MASK])
            return True
        # no single block is large enough: free oversize blocks from the largest down
        # (expandable ones are skipped: they are unmapped, not freed)
        released = 0
        i -= 1
        while released < want and i >= 0 and (lst[i] >> 64) >= mss:
            b = cached[lst[i] & _ADDR_MASK]
            if b.seg is None:
                released += b.size
                self._release_block(b)
            i -= 1
        return released >= want

    def _release_cached_blocks(self) -> bool:
        for small in (False, True):                 # large pool first, as torch does
            to_unmap = []
            for stream in sorted(self._free[small]):
                for key in list(self._free[small][stream]):
                    b = self._cached[key & _ADDR_MASK]
                    if b.seg is not None:
                        to_unmap.append(b)
                    elif not b.is_split():
                        self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if not b.mapped and b.prev is None and b.next is None:
                    self._release_expandable_segment(b)
        return True

    def _garbage_collect(self) -> None:
        threshold = int(self.conf.garbage_collection_threshold * self.limit)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        calls = self._gc_calls[False]

        def large_blocks() -> list[_Block]:
            return [self._cached[k & _ADDR_MASK] for s in sorted(self._free[False])
                    for k in self._free[False][s]]

        freeable = [b for b in large_blocks() if not b.is_split() and b.seg is None]
        total_age = sum(calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count       # the oldest (above average) first
            freed = False
            for b in large_blocks():
                if not b.is_split() and b.seg is None and calls - b.gc_base >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= calls - b.gc_base
                    count -= 1
                    self._release_block(b)

    # --- expandable segments ----------------------------------------------------------------
    def _find_expandable_block(self, stream: int, small: bool, size: int) -> _Block:
        def allocatable(x: _Block | None) -> bool:
            return x is not None and not x.allocated

        for addr in self._unmapped[small].get(stream, []):
            c = self._unmapped_blocks[addr]
            if allocatable(c.prev):
                c = c.prev
            room, x = 0, c
            while room < size and allocatable(x):
                room += x.size
                x = x.next
            if room >= size:
                return c
        page = KSMALL_BUFFER if small else KLARGE_BUFFER
        n_pages = -(-(self.capacity + self.capacity // 8) // page)
        base = self._new_va(n_pages * page, page)
        self._call("vm_reserve")
        seg = _Segment(base, page, n_pages)
        self._segments[base] = seg
        c = _Block(base, n_pages * page, stream, small, seg, mapped=False)
        self._insert_unmapped(c)
        return c

    def _map_pages(self, seg: _Segment, begin: int, end: int) -> bool:
        for i in range(begin, end):
            ok = self._device_used + seg.page <= self.capacity
            self._call("vm_create", seg.page, ok)
            if not ok:                                  # roll back this call's pages
                for j in range(begin, i):
                    seg.mapped.discard(j)
                    self._device_used -= seg.page
                    self._call("vm_release")
                return False
            seg.mapped.add(i)
            self._device_used += seg.page
        for _ in range(begin, end):
            self._call("vm_map")
        self._call("vm_set_access")
        return True

    def _map_block(self, b: _Block, size: int) -> bool:
        seg = b.seg
        begin = (b.addr - seg.base) // seg.page
        end = -(-(b.addr + size - seg.base) // seg.page)
        if not self._map_pages(seg, begin, end):
            return False
        mapped = (end - begin) * seg.page
        self._erase_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.addr + mapped, b.size - mapped, b.stream, b.small, seg, mapped=False)
            rest.splice(b, b.next)
            self._insert_unmapped(rest)
            b.size = mapped
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._insert(b)
        self._grow(mapped)
        self.num_device_alloc += 1
        return True

    def _try_allocate_expandable(self, size: int, stream: int, small: bool) -> _Block | None:
        c = self._find_expandable_block(stream, small, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:                # free -> unmapped -> ...: map and merge onwards
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None                 # what was mapped stays mapped, as in torch
            c = nxt
        self._erase(c)
        return c

    def _unmap_block(self, b: _Block) -> None:
        seg = b.seg
        begin = -(-(b.addr - seg.base) // seg.page)
        end = (b.addr + b.size - seg.base) // seg.page
        if begin >= end:
            return                          # no whole page free inside the block
        self._erase(b)
        self._call("synchronize")
        for i in range(begin, end):
            seg.mapped.discard(i)
            self._call("vm_unmap")
            self._call("vm_release")
        start, nbytes = seg.base + begin * seg.page, (end - begin) * seg.page
        if start > b.addr:
            before = _Block(b.addr, start - b.addr, b.stream, b.small, seg)
            before.splice(b.prev, b)
            self._insert(before)
        after = b.size - (start - b.addr) - nbytes
        if after > 0:
            tail = _Block(start + nbytes, after, b.stream, b.small, seg)
            tail.splice(b, b.next)
            self._insert(tail)
        b.addr, b.size, b.mapped = start, nbytes, False
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._insert_unmapped(b)
        self._device_used -= nbytes
        self.reserved_bytes -= nbytes
        self.num_device_free += 1

    def _release_expandable_segment(self, b: _Block) -> None:
        self._erase_unmapped(b)
        del self._segments[b.seg.base]
        self._call("vm_free")
