"""A PYTORCH_CUDA_ALLOC_CONF value as MemoryConfig settings: :meth:`gpumem.MemoryConfig.from_torch_conf`.

The value is read as PyTorch reads it (:func:`gpumem.planning.torch_conf.parse_torch_conf`: an
unknown key or a bad value is an InvalidInputError naming it). Keys with a gpumem equivalent:

================================  ===================================================
``expandable_segments:True``      ``expandable_segments=True`` (the auto policy: segments
                                  that grow in place); ``False``: plain segments
``max_split_size_mb:N``           ``max_split_size=N MiB`` (larger cached blocks are never
                                  split)
``max_non_split_rounding_mb:N``   ``oversize_slack=N MiB`` (an unsplittable cached block
                                  may exceed the request by this much)
``backend:native``                nothing to set (gpumem replaces the native allocator)
================================  ===================================================

Keys without one, named in the warning and in :func:`torch_conf_changes`'s second result:
``garbage_collection_threshold`` (gpumem trims its cache by pressure level instead:
``pressure_thresholds``, ``high_cache_fraction``), ``roundup_power2_divisions`` (gpumem rounds
to ``granularity``), and the keys of threads, the pinned host allocator and graph capture
(``release_lock_on_cudamalloc``, ``pinned_*``, ``graph_capture_record_stream_reuse``).
"""
from __future__ import annotations

from typing import Any

from gpumem.planning.torch_conf import KEYS, _lex, parse_torch_conf

__all__ = ["torch_conf_changes", "NO_EQUIVALENT"]

MiB = 1 << 20

#: keys of PYTORCH_CUDA_ALLOC_CONF that no MemoryConfig setting matches, and why
NO_EQUIVALENT = {
    "garbage_collection_threshold": "gpumem trims its cache by pressure level instead "
                                    "(pressure_thresholds, high_cache_fraction)",
    "roundup_power2_divisions": "gpumem rounds requests to granularity, not by powers of two",
    "release_lock_on_cudamalloc": "gpumem never holds its lock across a driver call",
    "pinned_use_cuda_host_register": "a setting of torch's pinned host allocator",
    "pinned_num_register_threads": "a setting of torch's pinned host allocator",
    "pinned_use_background_threads": "a setting of torch's pinned host allocator",
    "pinned_reserve_segment_size_mb": "a setting of torch's pinned host allocator",
    "graph_capture_record_stream_reuse": "a setting of torch's CUDA-graph capture",
}


def _keys_named(conf: str) -> list[str]:
    """The keys ``conf`` names, in order (``parse_torch_conf`` has checked it)."""
    toks = _lex(conf)
    return [t for i, t in enumerate(toks) if t in KEYS and (i == 0 or toks[i - 1] == ",")]


def torch_conf_changes(conf: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``(changes, unmapped)``: MemoryConfig fields for the keys of ``conf`` that have an
    equivalent, and ``{key: why}`` for those that have none."""
    parsed = parse_torch_conf(conf)
    changes: dict[str, Any] = {}
    unmapped: dict[str, str] = {}
    for key in _keys_named(conf):
        if key == "expandable_segments":
            changes["expandable_segments"] = parsed.expandable_segments
        elif key == "max_split_size_mb":
            changes["max_split_size"] = parsed.max_split_size
        elif key == "max_non_split_rounding_mb":
            changes["oversize_slack"] = parsed.max_non_split_rounding_size
        elif key == "backend":
            pass                        # native (cudaMallocAsync is refused by the parser)
        else:
            unmapped[key] = NO_EQUIVALENT[key]
    return changes, unmapped
