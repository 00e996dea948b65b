"""PYTORCH_CUDA_ALLOC_CONF, read as PyTorch reads it, for :class:`gpumem.TorchAllocatorModel`.

The syntax and limits are those of PyTorch's ``c10/core/AllocatorConfig.cpp`` (``parseArgs``) and
``c10/cuda/CUDAAllocatorConfig.cpp`` (docs/torch_model.md names the commits): a comma-separated
list of ``key:value``; spaces are ignored; ``roundup_power2_divisions`` also takes the list form
``[256:1,512:2,>:4]`` (interval start in MiB, a power of two, ``>`` for every interval after the
last one named). Keys that change where memory goes are modeled:

=================================  ===========================================================
``max_split_size_mb:N``            blocks of N MiB or more are never split (N >= 20)
``max_non_split_rounding_mb:N``    an oversize request may take a cached block up to N MiB
                                   larger (N >= 20; default 20)
``roundup_power2_divisions:N``     round requests up to N steps per power of two (N a power
                                   of two), or the per-interval list form
``garbage_collection_threshold:F`` 0 < F < 1: free idle cached blocks when reserved memory
                                   passes F of the per-process limit
``expandable_segments:True``       one growing segment per stream and pool
=================================  ===========================================================

The keys that only touch threads, the pinned host allocator or graph capture
(``release_lock_on_cudamalloc``, ``pinned_use_cuda_host_register``,
``pinned_num_register_threads``, ``pinned_use_background_threads``,
``pinned_reserve_segment_size_mb``, ``graph_capture_record_stream_reuse``) are checked and
have no effect here; ``backend:native`` is accepted, ``backend:cudaMallocAsync`` is refused (a
different allocator, not modeled). Where PyTorch's ``stoi`` would silently read ``40.5`` as 40,
the model refuses it: a typo should not become a different setting.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gpumem.errors import InvalidInputError

__all__ = ["TorchAllocatorConf", "parse_torch_conf", "UNLIMITED", "KEYS"]

MiB = 1 << 20
#: PyTorch's ``std::numeric_limits<size_t>::max()``: no max_split_size
UNLIMITED = (1 << 64) - 1
#: ``kLargeBuffer``: the smallest max_split_size_mb / max_non_split_rounding_mb allowed
_LARGE_BUFFER_MB = 20
#: roundup_power2_divisions has one entry per power-of-two interval from 1 MiB to 64 GiB
N_INTERVALS = 16
_PINNED_MAX_REGISTER_THREADS = 128

#: every key PYTORCH_CUDA_ALLOC_CONF accepts at the commits the model follows
KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
        "roundup_power2_divisions", "expandable_segments", "backend",
        "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
        "pinned_num_register_threads", "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")
_BOOL_KEYS = ("expandable_segments", "release_lock_on_cudamalloc",
              "pinned_use_cuda_host_register", "pinned_use_background_threads",
              "graph_capture_record_stream_reuse")


@dataclass(frozen=True)
class TorchAllocatorConf:
    """The settings of PyTorch's native caching allocator that decide where memory goes."""

    #: bytes; blocks of this size or more are not split (UNLIMITED: every block may be split)
    max_split_size: int = UNLIMITED
    #: bytes; an oversize request takes a cached block smaller than request + this
    max_non_split_rounding_size: int = _LARGE_BUFFER_MB * MiB
    garbage_collection_threshold: float = 0.0
    #: divisions per power-of-two interval [1 MiB, 2 MiB), [2, 4) ... [32 GiB, 64 GiB); 0 or 1: none
    roundup_power2_divisions: tuple[int, ...] = (0,) * N_INTERVALS
    expandable_segments: bool = False
    #: the string it was parsed from
    text: str = field(default="", compare=False)

    def divisions(self, size: int) -> int:
        """Divisions for a request of ``size`` bytes (PyTorch's ``roundup_power2_divisions(size)``:
        the interval of floor(log2(size)), below 1 MiB the first, above 32 GiB the last)."""
        index = size.bit_length() - 1 - 20
        return self.roundup_power2_divisions[min(max(index, 0), N_INTERVALS - 1)]


def _lex(text: str) -> list[str]:
    """PyTorch's lexArgs: ``, : [ ]`` are tokens of their own, spaces are dropped."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf.clear()
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


class _Tokens:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _lex(text)

    def error(self, msg: str) -> InvalidInputError:
        return InvalidInputError(f"PYTORCH_CUDA_ALLOC_CONF {self.text!r}: {msg}")

    def expect(self, i: int, tok: str, after: str) -> None:
        if i >= len(self.toks) or self.toks[i] != tok:
            got = "the end" if i >= len(self.toks) else repr(self.toks[i])
            raise self.error(f"expected {tok!r} after {after!r}, found {got}")

    def value(self, i: int, key: str) -> str:
        if i >= len(self.toks) or self.toks[i] in ",:[]":
            raise self.error(f"{key} needs a value")
        return self.toks[i]

    def integer(self, i: int, key: str, allowed: str) -> int:
        v = self.value(i, key)
        if not v.isdigit():
            raise self.error(f"{key} must be {allowed}, got {v!r}")
        return int(v)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_divisions(t: _Tokens, i: int, divs: list[int]) -> int:
    """``roundup_power2_divisions``: a power of two for every interval, or ``[MiB:N,...,>:N]``.
    Returns the index of the last token read. Like PyTorch, the first listed interval also
    sets every interval below it, and ``>`` sets the intervals from the last listed one on
    (that one included)."""
    key = "roundup_power2_divisions"
    if i < len(t.toks) and t.toks[i] == "[":
        first, last_index = True, 0
        i += 1
        while i < len(t.toks) and t.toks[i] != "]":
            start = t.value(i, key)
            t.expect(i + 1, ":", f"{key} interval {start}")
            n = t.integer(i + 2, key, "0 (no rounding) or a power of two per interval")
            if n != 0 and not _power_of_two(n):
                raise t.error(f"{key}: divisions must be 0 or a power of two, got {n}")
            if start == ">":
                divs[last_index:] = [n] * (N_INTERVALS - last_index)
            else:
                if not start.isdigit() or not _power_of_two(int(start)):
                    raise t.error(f"{key}: an interval must be a power of two in MiB or '>', "
                                  f"got {start!r}")
                index = min(int(start).bit_length() - 1, N_INTERVALS - 1)
                if first:
                    divs[:index] = [n] * index
                    first = False
                divs[index] = n
                last_index = index
            i += 3
            if i < len(t.toks) and t.toks[i] == ",":
                i += 1
            elif i < len(t.toks) and t.toks[i] != "]":
                raise t.error(f"{key}: expected ',' or ']' after {start}:{n}, found "
                              f"{t.toks[i]!r}")
        if i >= len(t.toks):
            raise t.error(f"{key}: the list has no closing ']'")
        return i
    n = t.integer(i, key, "a power of two, or a list such as [256:1,512:2,>:4]")
    if not _power_of_two(n):
        raise t.error(f"{key}: divisions must be a power of two, got {n}")
    divs[:] = [n] * N_INTERVALS
    return i


def parse_torch_conf(conf: str | TorchAllocatorConf = "") -> TorchAllocatorConf:
    """Read a PYTORCH_CUDA_ALLOC_CONF value. Raises :class:`~gpumem.errors.InvalidInputError`
    naming the key and what it allows for an unknown key, a bad value or bad punctuation."""
    if isinstance(conf, TorchAllocatorConf):
        return conf
    if not isinstance(conf, str):
        raise InvalidInputError(f"conf must be a PYTORCH_CUDA_ALLOC_CONF string such as "
                                f"'expandable_segments:True', got {type(conf).__name__} {conf!r}")
    t = _Tokens(conf)
    toks = t.toks
    vals: dict = {}
    divs = [0] * N_INTERVALS
    i = 0
    while i < len(toks):
        key = toks[i]
        if key not in KEYS:
            raise t.error(f"unknown key {key!r}; the keys are {', '.join(KEYS)}")
        t.expect(i + 1, ":", key)
        i += 2
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = t.integer(i, key, f"a whole number of MiB >= {_LARGE_BUFFER_MB}")
            if mb < _LARGE_BUFFER_MB:
                raise t.error(f"{key} must be >= {_LARGE_BUFFER_MB} (MiB), got {mb}")
            nbytes = min(mb, UNLIMITED // MiB) * MiB
            vals["max_split_size" if key == "max_split_size_mb"
                 else "max_non_split_rounding_size"] = nbytes
        elif key == "garbage_collection_threshold":
            v = t.value(i, key)
            try:
                f = float(v)
            except ValueError:
                f = -1.0
            if not 0.0 < f < 1.0:
                raise t.error(f"{key} must be a number in (0.0, 1.0), got {v!r}")
            vals[key] = f
        elif key == "roundup_power2_divisions":
            i = _parse_divisions(t, i, divs)
        elif key in _BOOL_KEYS:
            v = t.value(i, key)
            if v not in ("True", "False"):
                raise t.error(f"{key} must be True or False, got {v!r}")
            if key == "expandable_segments":
                vals[key] = v == "True"
        elif key == "backend":
            v = t.value(i, key)
            if v == "cudaMallocAsync":
                raise t.error("backend:cudaMallocAsync is the driver's stream-ordered allocator, "
                              "which this model does not cover; use backend:native")
            if v != "native":
                raise t.error(f"backend must be native or cudaMallocAsync, got {v!r}")
        elif key == "pinned_num_register_threads":
            n = t.integer(i, key, f"a power of two <= {_PINNED_MAX_REGISTER_THREADS}")
            if not _power_of_two(n) or n > _PINNED_MAX_REGISTER_THREADS:
                raise t.error(f"{key} must be a power of two <= {_PINNED_MAX_REGISTER_THREADS}, "
                              f"got {n}")
        elif key == "pinned_reserve_segment_size_mb":
            if t.integer(i, key, "a whole number of MiB > 0") == 0:
                raise t.error(f"{key} must be > 0")
        i += 1
        if i < len(toks):
            t.expect(i, ",", key)
            i += 1
    return TorchAllocatorConf(roundup_power2_divisions=tuple(divs), text=conf, **vals)
