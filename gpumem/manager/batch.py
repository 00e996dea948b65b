"""RAII batches and batch allocation.

- :class:`BufferBatch` holds buffers and frees every one still alive when its ``with`` block ends
  (``mm.batch()`` makes one).
- :func:`allocate_batch` (``mm.allocate_batch``) allocates many buffers at once, placed in as
  few segments as possible: what the cache can serve comes from the cache, the rest is carved
  from *one* new segment per pool (small requests and large requests live in separate pools),
  asked of the driver within the manager's limits. If anything fails, every buffer of the call
  is freed and the segments the call added are returned, so the manager is as before.
- :func:`warmup` (``mm.warmup``) fills the cache ahead of time so later requests of the same
  sizes are hits.

The manager's methods run the work here with its parts: the miss path (the ladder, for what a
new segment cannot hold) and its segment growth (:class:`gpumem.manager.growth.Growth`, the
declared interface batches use); nothing here reaches into the manager itself.

Example::

    with mm.batch() as batch:
        a = batch.malloc(4 << 20)
        b, c = batch.allocate([1 << 20, 8 << 20])
    # a, b and c are back in the cache here
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from gpumem._core.buffer import Buffer
from gpumem._core.manager_base import stream_handle
from gpumem.errors import (ClosedManagerError, DoubleFreeError, ForeignBufferError,
                           InvalidInputError)
from gpumem.manager.fallback import FallbackBuffer

if TYPE_CHECKING:
    from gpumem.manager.growth import Growth
    from gpumem.manager.interfaces import Allocator
    from gpumem.manager.miss_path import MissPath

__all__ = ["BufferBatch", "allocate_batch", "warmup", "allocate_in_segments", "warm_up",
           "validated_sizes"]


def validated_sizes(sizes: Iterable[Any], what: str = "sizes") -> list[int]:
    """``sizes`` as ints >= 0: TypeError naming the index of a non-integer, InvalidInputError
    for a negative one."""
    out = []
    for i, n in enumerate(sizes):
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"{what}[{i}] must be an int, got {type(n).__name__} {n!r}")
        n = int(n)
        if n < 0:
            raise InvalidInputError(f"{what}[{i}] must be >= 0, got {n}")
        out.append(n)
    return out


class BufferBatch:
    """Buffers freed together: on leaving the ``with`` block (or on :meth:`free_all`) every buffer
    the batch holds that is still alive is freed; buffers the user freed already are skipped.

    ``len(batch)`` and iteration cover the buffers held since the last :meth:`free_all`
    (including any the user freed early).
    """

    __slots__ = ("_manager", "_buffers")

    def __init__(self, manager: "Allocator") -> None:
        if not callable(getattr(manager, "malloc", None)) or not hasattr(manager, "pool"):
            raise InvalidInputError(
                f"BufferBatch needs a gpumem MemoryManager, got {type(manager).__name__}")
        self._manager = manager
        self._buffers: list[Buffer | FallbackBuffer] = []

    @property
    def manager(self) -> "Allocator":
        return self._manager

    def malloc(self, nbytes: int, stream: Any = None, tag: Any = None) -> Buffer | FallbackBuffer:
        """Allocate through the manager (same rules as ``manager.malloc``) and hold the buffer."""
        buf = self._manager.malloc(nbytes, stream=stream, tag=tag)
        self._buffers.append(buf)
        return buf

    def allocate(self, sizes: Iterable[int], *, stream: Any = None,
                 tag: Any = None) -> list[Buffer | FallbackBuffer]:
        """:func:`allocate_batch` on the manager; the batch holds every buffer returned."""
        bufs = self._manager.allocate_batch(sizes, stream=stream, tag=tag)
        self._buffers.extend(bufs)
        return bufs

    def add(self, buf: Buffer | FallbackBuffer) -> Buffer | FallbackBuffer:
        """Hold a live buffer of this batch's manager, so the batch frees it; returns it."""
        if not isinstance(buf, (Buffer, FallbackBuffer)):
            raise TypeError(f"add() takes a gpumem Buffer or FallbackBuffer, "
                            f"got {type(buf).__name__}")
        if buf.manager is not self._manager:
            raise ForeignBufferError(
                f"buffer {buf.id} belongs to another manager than this batch's "
                f"({self._manager.device_string})")
        if not buf.alive:
            raise InvalidInputError(f"buffer {buf.id} has been freed; a batch holds live buffers")
        self._buffers.append(buf)
        return buf

    def free_all(self) -> int:
        """Free every held buffer that is still alive (newest first); returns how many were
        freed. The batch is empty afterwards. If some frees fail, the others still happen and
        the first error is raised at the end."""
        held, self._buffers = self._buffers, []
        freed = 0
        first_error: BaseException | None = None
        for buf in reversed(held):
            if not buf.alive:
                continue                  # freed by the user, or its manager was closed
            try:
                buf.free()
                freed += 1
            except (DoubleFreeError, ClosedManagerError):
                pass                      # freed (or closed) concurrently: nothing left to do
            except Exception as exc:      # keep freeing the rest
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error
        return freed

    def __len__(self) -> int:
        return len(self._buffers)

    def __iter__(self) -> Iterator[Buffer | FallbackBuffer]:
        return iter(list(self._buffers))

    def __enter__(self) -> "BufferBatch":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self.free_all()
        else:
            # an exception is on its way out: free what we can, never hide it
            try:
                self.free_all()
            except Exception as err:
                warnings.warn(f"gpumem: freeing a batch failed during an exception: {err}",
                              RuntimeWarning)
        return False

    def __repr__(self) -> str:
        live = sum(1 for b in self._buffers if b.alive)
        return (f"<gpumem.BufferBatch on {self._manager.device_string}: {len(self._buffers)} "
                f"buffer(s), {live} alive>")


# ---------------------------------------------------------------------------------------------
# allocate_batch
# ---------------------------------------------------------------------------------------------

def allocate_batch(manager: "Allocator", sizes: Iterable[int], *, stream: Any = None,
                   tag: Any = None) -> list[Buffer | FallbackBuffer]:
    """Allocate one buffer per entry of ``sizes`` (in that order), in as few segments as possible.

    1. Every size is validated first (``TypeError`` for a non-integer, ``InvalidInputError``
       naming the index for a negative one), so bad input allocates nothing.
    2. Requests the cache can serve are served from it (largest first).
    3. The remaining small requests (rounded size <= ``small_size``) are carved from one new
       small-pool segment and the remaining large ones from one new large-pool segment, each
       sized for the sum of the rounded sizes (at least the segment a single miss would get).
       A segment is asked of the driver only within the manager's limits (soft ones trim
       the cache first; hard ones refuse: docs/pressure_and_oom.md).
       With ``max_split_size`` set, requests of that size or more get segments of their own
       (the pool never splits such blocks) and the others are grouped below it.
    4. Whatever is left (the combined segment was not allowed or was refused, a request larger
       than the hard cap) goes through the manager's normal ladder one by one, which may
       release cache, call OOM callbacks and fall back to the CPU as ``malloc`` would.

    On any failure every buffer allocated by the call is freed, the segments the call added are
    returned to the driver, and the exception is re-raised.
    """
    return manager.allocate_batch(sizes, stream=stream, tag=tag)


def allocate_in_segments(miss: MissPath, malloc: Callable[..., Any] | None,
                         sizes: Iterable[int], stream: Any, tag: Any) -> list[Any]:
    """:func:`allocate_batch` with a manager's miss path; what no new segment holds goes
    through ``malloc`` (the manager's, which may fall back to the CPU), or through the device
    only when ``malloc`` is None (warm-up)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be an iterable of ints, got {type(sizes).__name__}")
    nbytes = validated_sizes(list(sizes))
    s = 0 if stream is None else stream_handle(stream)
    if not nbytes:
        return []
    growth = miss.growth
    out: list[Any] = [None] * len(nbytes)
    with growth.lock:
        miss.check_open()
        miss.streams.ensure(s)
        before = set(growth.pool.live_segment_handles())
        expandable = growth.expandable
        mapped_before = expandable.extents() if expandable is not None else None
        try:
            _fill(miss, malloc, nbytes, s, tag, out)
        except BaseException:
            _undo(growth, out, before, mapped_before)
            raise
        growth.reserved_changed()
    return out


def _fill(miss: MissPath, malloc: Callable[..., Any] | None, nbytes: list[int], stream: int,
          tag: Any, out: list[Any]) -> None:
    growth = miss.growth
    pool = growth.pool
    usable = growth.hold                  # the most the manager may hold
    max_split = growth.config.max_split_size
    order = sorted(range(len(nbytes)), key=lambda i: nbytes[i], reverse=True)
    one_by_one = [i for i in order if nbytes[i] > usable]      # cannot fit in one segment
    # 2. the cache (and blocks of idle streams), largest first
    misses = []
    for i in order:
        if nbytes[i] > usable:
            continue
        buf = growth.alloc_cached(nbytes[i], stream, tag)
        if buf is None:
            buf = growth.alloc_from_idle_streams(nbytes[i], stream, tag)
        if buf is None:
            misses.append(i)
        else:
            out[i] = buf
    # 3. one new segment per pool (per group below max_split_size)
    small_size = pool.small_size
    small = [i for i in misses if pool.round_size(nbytes[i]) <= small_size]
    large = [i for i in misses if pool.round_size(nbytes[i]) > small_size]
    groups = []
    for members in (small, large):
        if not members:
            continue
        if max_split is None:
            groups.append(members)
            continue
        # the pool neither splits a block of max_split_size or more for a smaller request nor
        # splits off an oversize request: oversize requests alone, the rest in groups below it
        one_by_one += [i for i in members if pool.round_size(nbytes[i]) >= max_split]
        group: list[int] = []
        total = 0
        for i in members:                 # descending sizes: greedy groups below max_split
            r = pool.round_size(nbytes[i])
            if r >= max_split:
                continue
            if group and total + r >= max_split:
                groups.append(group)
                group, total = [], 0
            group.append(i)
            total += r
        if group:
            groups.append(group)
    for group in groups:
        one_by_one += _carve_group(growth, nbytes, group, stream, tag, out)
    # 4. the rest through the normal ladder
    for i in sorted(one_by_one, key=lambda i: nbytes[i], reverse=True):
        if malloc is None:
            out[i] = miss.malloc_device_only(nbytes[i], stream, tag)
        else:
            out[i] = malloc(nbytes[i], stream=stream, tag=tag)


def _carve_group(growth: Growth, nbytes: list[int], group: list[int], stream: int,
                 tag: Any, out: list[Any]) -> list[int]:
    """Carve the requests of ``group`` (indices, largest first, all in one pool) from one new
    segment. Returns the indices left unserved (no segment could be had, or a request did not
    land in it)."""
    pool = growth.pool
    max_split = growth.config.max_split_size
    total = sum(pool.round_size(nbytes[i]) for i in group)
    preferred = max(total, pool.segment_size(nbytes[group[0]]))
    if max_split is not None and preferred >= max_split and total < max_split:
        preferred = total
    seg = growth.new_segment((preferred, total),     # the full segment, else the exact sum
                             small=pool.round_size(nbytes[group[0]]) <= pool.small_size)
    if seg is None:
        return list(group)
    handle, base, seg_size = seg
    first = group[0]
    try:
        out[first] = growth.alloc_in_new_segment(handle, base, seg_size, nbytes[first], stream,
                                                 tag)
    except BaseException:
        if handle not in pool.live_segment_handles():
            growth.device.free_segment(handle)    # the pool did not adopt it
        raise                             # else the caller's undo returns it
    left = []
    for i in group[1:]:
        buf = growth.alloc_cached(nbytes[i], stream, tag)
        if buf is None:
            left.append(i)
        else:
            out[i] = buf
    return left


def _undo(growth: Growth, out: list[Any], before: set[int],
          mapped_before: dict[int, int] | None = None) -> None:
    """Free the buffers of a failed call and return the segments it added (wholly free again)
    and the free pages past the extents expandable segments had before the call
    (``mapped_before``)."""
    for buf in out:
        if buf is not None and buf.alive:
            try:
                buf.free()
            except Exception as exc:  # keep undoing the rest
                warnings.warn(f"gpumem: could not free buffer {buf.id} while undoing a failed "
                              f"batch: {exc}", RuntimeWarning)
    if mapped_before is not None and growth.expandable is not None:
        growth.expandable.trim(floor=mapped_before)
    pool = growth.pool
    if not (set(pool.live_segment_handles()) - before):
        return
    # Detach every wholly free segment, keep the ones that existed before the call.
    # (CachingPool has no "release this handle" primitive; restore_segment undoes a detach.)
    detached = pool.release_free_segments()
    ours = [d for d in detached if d[0] not in before]
    for d in detached:
        if d[0] in before:
            pool.restore_segment(*d)
    growth.release_segments(ours)         # a refused free goes back to the pool, with a warning
    growth.reserved_changed()


# ---------------------------------------------------------------------------------------------
# warmup
# ---------------------------------------------------------------------------------------------

def warmup(manager: "Allocator", sizes: Sequence[int], counts: Sequence[int] | int = 1, *,
           stream: Any = None) -> int:
    """Allocate ``counts[i]`` buffers of ``sizes[i]`` (``counts`` may be one int for all) in as
    few segments as possible, then free them so the cache holds them: later requests of these
    sizes on ``stream`` are cache hits. Device memory only (no CPU fallback: an
    OutOfMemoryError is raised and nothing is kept). Returns the bytes newly reserved from the
    device (0 when the cache already held enough).

    The cached bytes are subject to the manager's policies like any other cache: a
    ``max_pool_size`` cap, pressure responses, ``empty_cache()``.
    """
    return manager.warmup(sizes, counts, stream=stream)


def warm_up(miss: MissPath, sizes: Sequence[int], counts: Sequence[int] | int,
            stream: Any) -> int:
    """:func:`warmup` with a manager's miss path."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}")
    size_list = validated_sizes(list(sizes))
    if isinstance(counts, bool):
        raise TypeError("counts must be an int or a sequence of ints, not a bool")
    if hasattr(counts, "__index__"):
        count_list = validated_sizes([counts] * len(size_list), what="counts")
    elif hasattr(counts, "__iter__") and not isinstance(counts, (str, bytes)):
        count_list = validated_sizes(list(counts), what="counts")
        if len(count_list) != len(size_list):
            raise InvalidInputError(f"counts has {len(count_list)} entries but sizes has "
                                    f"{len(size_list)}; give one count per size or one int")
    else:
        raise TypeError(f"counts must be an int or a sequence of ints, "
                        f"got {type(counts).__name__}")
    flat = [n for n, c in zip(size_list, count_list) for _ in range(c)]
    pool = miss.growth.pool
    before = pool.reserved_bytes
    bufs = allocate_in_segments(miss, None, flat, stream, "warmup")
    for buf in reversed(bufs):
        buf.free()
    return max(0, pool.reserved_bytes - before)
