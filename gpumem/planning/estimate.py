"""Memory estimates for decoder-only transformer models (weights, KV cache, activations).

Units: every ``*_bytes`` value is an exact byte count. ``*_mb()`` helpers divide by
``MiB = 2**20`` and ``*_gib()`` helpers by ``GiB = 2**30`` (binary, what ``nvidia-smi`` and
:func:`gpumem.units.format_bytes` show); ``*_gb()`` helpers divide by ``10**9`` (decimal, what
vendors print on the box).

The presets (:data:`MODEL_PRESETS`) are data: ``gpumem/data/model_presets.json``. Training
estimates (gradients, optimizer state) are in :mod:`gpumem.planning.estimate_training`.

Only whole-byte dtypes are supported (1, 2, 4 or 8 bytes per element); packed sub-byte
formats such as int4 are rejected rather than silently rounded.
"""
from __future__ import annotations

import json
import operator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpumem.errors import InvalidInputError
from gpumem.units import GiB, MiB

__all__ = [
    "MemoryEstimate",
    "ModelShape",
    "MODEL_PRESETS",
    "count_parameters",
    "estimate_inference_memory",
    "estimate_model",
    "parse_dtype",
    "preset",
    "load_presets",
    "PRESETS_FILE",
    "GB",
]

#: Decimal gigabyte, used by the ``*_gb()`` helpers.
GB = 10**9

_VALID_DTYPE_BYTES = (1, 2, 4, 8)
_NORMS = ("rms", "layer")

_DTYPE_NAMES: dict[str, int] = {
    "float64": 8, "fp64": 8, "f64": 8, "double": 8,
    "float32": 4, "fp32": 4, "f32": 4, "single": 4,
    "float16": 2, "fp16": 2, "f16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "e4m3": 1, "e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}
_SUB_BYTE_NAMES = ("int4", "uint4", "fp4", "float4", "nf4", "int2", "int3", "fp6", "float6")


# ---------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------

def _positive_int(value: Any, name: str) -> int:
    """Return ``value`` as an int if it is a positive integer (bools rejected)."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be a positive int, got the bool {value!r}")
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise InvalidInputError(
            f"{name} must be a positive int, got {type(value).__name__} {value!r}") from None
    if ivalue <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {ivalue}")
    return ivalue


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def parse_dtype(dtype: Any) -> int:
    """Return the bytes per element of ``dtype``.

    Accepts a name (``"float16"``, ``"fp16"``, ``"half"``, ``"bf16"``, ``"fp32"``, ``"int8"``,
    ``"fp8"``, ``"torch.bfloat16"``...), a numpy dtype or scalar type (``np.float16``), any
    object with an int ``itemsize`` (e.g. ``torch.float16``), or a byte count in {1, 2, 4, 8}.
    Raises :class:`InvalidInputError` otherwise, including for sub-byte types such as int4.
    """
    if isinstance(dtype, bool):
        raise InvalidInputError(f"dtype must be a dtype name or a byte count, got the bool {dtype!r}")
    if isinstance(dtype, int):
        if dtype not in _VALID_DTYPE_BYTES:
            raise InvalidInputError(
                f"dtype_bytes must be one of {_VALID_DTYPE_BYTES}, got {dtype}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        for prefix in ("torch.", "numpy.", "np.", "jnp.", "jax.numpy."):
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        if key == "float":
            raise InvalidInputError(
                "dtype 'float' is ambiguous (float32 in torch, float64 in numpy); "
                "say 'float32' or 'float64'")
        if key in _SUB_BYTE_NAMES:
            raise InvalidInputError(
                f"dtype {dtype!r} is a sub-byte type; only whole-byte dtypes are supported "
                f"(1, 2, 4 or 8 bytes per element). Estimate packed weights yourself.")
        raise InvalidInputError(
            f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)} or a byte count "
            f"in {_VALID_DTYPE_BYTES}")
    # numpy dtypes / scalar types, torch dtypes, anything exposing an int itemsize.
    kind = getattr(dtype, "kind", None)
    itemsize = getattr(dtype, "itemsize", None)
    if not isinstance(itemsize, int):
        try:
            import numpy as np  # only needed for numpy scalar types such as np.float16

            npdtype = np.dtype(dtype)
        except Exception:
            npdtype = None
        if npdtype is not None and dtype is not None:
            kind, itemsize = npdtype.kind, npdtype.itemsize
    if isinstance(itemsize, int) and not isinstance(itemsize, bool):
        name = str(getattr(dtype, "name", dtype)).lower()
        if isinstance(kind, str):
            # numpy kinds: f float, i int, u uint; 'V' only for named extension types such as
            # ml_dtypes' bfloat16 / float8_*.
            ok = kind in ("f", "i", "u") or (kind == "V" and name in _DTYPE_NAMES)
        else:
            ok = not any(bad in name for bad in ("bool", "complex", "qint", "quint"))
        if not ok:
            raise InvalidInputError(
                f"dtype {dtype!r} is not a numeric weight dtype; use a float or integer dtype")
        if itemsize not in _VALID_DTYPE_BYTES:
            raise InvalidInputError(
                f"dtype {dtype!r} has itemsize {itemsize}; supported sizes are {_VALID_DTYPE_BYTES}")
        return itemsize
    raise InvalidInputError(
        f"dtype must be a dtype name, a numpy/torch dtype or a byte count, "
        f"got {type(dtype).__name__} {dtype!r}")


# ---------------------------------------------------------------------------------------------
# result type
# ---------------------------------------------------------------------------------------------

def format_breakdown(parameters: int, rows: list[tuple[str, int]]) -> str:
    """The table an estimate prints: one row per component in bytes, GiB and GB, the last row
    (the total) under a rule."""
    lines = [f"parameters: {parameters:,}",
             f"{'component':<12} {'bytes':>18} {'GiB':>10} {'GB':>10}"]
    for i, (label, n) in enumerate(rows):
        if i == len(rows) - 1:
            lines.append("-" * 53)
        lines.append(f"{label:<12} {n:>18,} {n / GiB:>10.3f} {n / GB:>10.3f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated inference memory; ``total_bytes == model + kv_cache + activation bytes``."""

    parameters: int
    model_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    total_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInputError(f"{f.name} must be a non-negative int, got {v!r}")
        parts = self.model_bytes + self.kv_cache_bytes + self.activation_bytes
        if self.total_bytes != parts:
            raise InvalidInputError(
                f"total_bytes ({self.total_bytes}) must equal model + kv_cache + activation "
                f"bytes ({parts})")

    # decimal gigabytes (1 GB = 10**9 bytes)
    def total_gb(self) -> float:
        """Total in GB (10**9 bytes)."""
        return self.total_bytes / GB

    def model_gb(self) -> float:
        """Weights in GB (10**9 bytes)."""
        return self.model_bytes / GB

    def kv_cache_gb(self) -> float:
        """KV cache in GB (10**9 bytes)."""
        return self.kv_cache_bytes / GB

    def activations_gb(self) -> float:
        """Peak activations in GB (10**9 bytes)."""
        return self.activation_bytes / GB

    # binary mebibytes (1 MiB = 2**20 bytes)
    def total_mb(self) -> float:
        """Total in MiB (2**20 bytes)."""
        return self.total_bytes / MiB

    def model_mb(self) -> float:
        """Weights in MiB (2**20 bytes)."""
        return self.model_bytes / MiB

    def kv_cache_mb(self) -> float:
        """KV cache in MiB (2**20 bytes)."""
        return self.kv_cache_bytes / MiB

    def activation_mb(self) -> float:
        """Peak activations in MiB (2**20 bytes)."""
        return self.activation_bytes / MiB

    # binary gibibytes (1 GiB = 2**30 bytes)
    def total_gib(self) -> float:
        """Total in GiB (2**30 bytes)."""
        return self.total_bytes / GiB

    def model_gib(self) -> float:
        """Weights in GiB (2**30 bytes)."""
        return self.model_bytes / GiB

    def kv_cache_gib(self) -> float:
        """KV cache in GiB (2**30 bytes)."""
        return self.kv_cache_bytes / GiB

    def activations_gib(self) -> float:
        """Peak activations in GiB (2**30 bytes)."""
        return self.activation_bytes / GiB

    def as_dict(self) -> dict[str, int]:
        """The five fields as a plain dict of ints."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        rows = [
            ("weights", self.model_bytes),
            ("kv cache", self.kv_cache_bytes),
            ("activations", self.activation_bytes),
            ("total", self.total_bytes),
        ]
        return format_breakdown(self.parameters, rows)


# ---------------------------------------------------------------------------------------------
# model shapes and formulas
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """Architecture hyper-parameters of a decoder-only transformer.

    ``max_position_embeddings`` is the size of a *learned* absolute position table (GPT-2);
    leave it ``None`` for rotary/ALiBi models, which have no position parameters.
    ``published_parameters`` is the count the model's authors report, if known.
    ``num_experts`` > 1 makes the MLP a mixture of experts (each layer holds ``num_experts``
    MLPs and a router; each token goes through ``experts_per_token`` of them).
    ``max_seq_len`` is the context length the model was trained for (None: unknown), the
    default sequence length of :meth:`estimate`.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool = False
    gated_mlp: bool = True
    bias: bool = False
    max_position_embeddings: int | None = None
    norm: str = "rms"
    published_parameters: int | None = None
    num_experts: int = 1
    experts_per_token: int = 1
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        _validate_shape(self.hidden_size, self.intermediate_size, self.num_layers,
                        self.vocab_size, self.num_heads, self.num_kv_heads, self.tie_embeddings,
                        self.gated_mlp, self.bias, self.max_position_embeddings, self.norm,
                        self.num_experts, self.experts_per_token)
        if self.published_parameters is not None:
            _positive_int(self.published_parameters, "published_parameters")
        if self.max_seq_len is not None:
            _positive_int(self.max_seq_len, "max_seq_len")

    def default_seq_len(self) -> int:
        """``max_seq_len``, else ``max_position_embeddings``; InvalidInputError if neither."""
        n = self.max_seq_len or self.max_position_embeddings
        if n is None:
            raise InvalidInputError("this model shape has no max_seq_len: give seq_len")
        return n

    @property
    def head_dim(self) -> int:
        """``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    def parameter_count(self) -> int:
        """Parameter count from the formula in :func:`count_parameters`."""
        return count_parameters(**self._arch_kwargs())

    def estimate(self, seq_len: int | None = None, batch_size: int = 1,
                 dtype: Any = "float16") -> MemoryEstimate:
        """:func:`estimate_inference_memory` for this shape (seq_len None: the model's
        maximum, :meth:`default_seq_len`)."""
        return estimate_inference_memory(
            self.hidden_size, self.intermediate_size, self.num_layers, self.vocab_size,
            self.num_heads, self.num_kv_heads,
            self.default_seq_len() if seq_len is None else seq_len, parse_dtype(dtype),
            batch_size, **self._flags())

    def _flags(self) -> dict[str, Any]:
        return dict(tie_embeddings=self.tie_embeddings, gated_mlp=self.gated_mlp, bias=self.bias,
                    max_position_embeddings=self.max_position_embeddings, norm=self.norm,
                    num_experts=self.num_experts, experts_per_token=self.experts_per_token)

    def _arch_kwargs(self) -> dict[str, Any]:
        return dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_layers=self.num_layers, vocab_size=self.vocab_size,
                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, **self._flags())


def _validate_shape(hidden_size: Any, intermediate_size: Any, num_layers: Any, vocab_size: Any,
                    num_heads: Any, num_kv_heads: Any, tie_embeddings: Any, gated_mlp: Any,
                    bias: Any, max_position_embeddings: Any, norm: Any,
                    num_experts: Any = 1, experts_per_token: Any = 1) -> tuple[int, ...]:
    h = _positive_int(hidden_size, "hidden_size")
    i = _positive_int(intermediate_size, "intermediate_size")
    n_layers = _positive_int(num_layers, "num_layers")
    vocab = _positive_int(vocab_size, "vocab_size")
    heads = _positive_int(num_heads, "num_heads")
    kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
    if h % heads:
        raise InvalidInputError(
            f"num_heads ({heads}) must divide hidden_size ({h})")
    if heads % kv_heads:
        raise InvalidInputError(
            f"num_kv_heads ({kv_heads}) must divide num_heads ({heads})")
    _flag(tie_embeddings, "tie_embeddings")
    _flag(gated_mlp, "gated_mlp")
    _flag(bias, "bias")
    if max_position_embeddings is not None:
        _positive_int(max_position_embeddings, "max_position_embeddings")
    if norm not in _NORMS:
        raise InvalidInputError(f"norm must be one of {_NORMS}, got {norm!r}")
    experts = _positive_int(num_experts, "num_experts")
    if _positive_int(experts_per_token, "experts_per_token") > experts:
        raise InvalidInputError(
            f"experts_per_token ({experts_per_token}) must not exceed num_experts ({experts})")
    return h, i, n_layers, vocab, heads, kv_heads


def count_parameters(hidden_size: int, intermediate_size: int, num_layers: int, vocab_size: int,
                     num_heads: int, num_kv_heads: int, *, tie_embeddings: bool = False,
                     gated_mlp: bool = True, bias: bool = False,
                     max_position_embeddings: int | None = None, norm: str = "rms",
                     num_experts: int = 1, experts_per_token: int = 1) -> int:
    """Parameter count of a decoder-only transformer.

    With ``h`` hidden, ``i`` intermediate, ``kv = num_kv_heads * head_dim``:

    * embeddings ``vocab*h`` (+ ``vocab*h`` lm_head unless tied) (+ ``max_pos*h`` if learned);
    * per layer: attention ``2*h*h + 2*h*kv`` (q, o, k, v) plus ``2*h + 2*kv`` biases;
      MLP ``3*h*i`` gated (gate/up/down) or ``2*h*i`` (up/down) plus ``i + h`` biases
      (``2*i + h`` when gated); two norms of ``h`` (rms) or ``2h`` (layer, weight+bias) each;
    * one final norm;
    * mixture of experts (``num_experts`` > 1): ``num_experts`` MLPs per layer plus a router
      of ``h*num_experts`` (Mixtral's layout; every expert counts, not only the active ones).
    """
    h, i, n_layers, vocab, heads, kv_heads = _validate_shape(
        hidden_size, intermediate_size, num_layers, vocab_size, num_heads, num_kv_heads,
        tie_embeddings, gated_mlp, bias, max_position_embeddings, norm, num_experts,
        experts_per_token)
    kv_dim = kv_heads * (h // heads)
    norm_params = h if norm == "rms" else 2 * h

    attn = 2 * h * h + 2 * h * kv_dim
    mlp = (3 if gated_mlp else 2) * h * i
    if bias:
        attn += 2 * h + 2 * kv_dim
        mlp += (2 * i if gated_mlp else i) + h
    if num_experts > 1:
        mlp = num_experts * mlp + h * num_experts      # the experts and the router
    per_layer = attn + mlp + 2 * norm_params

    embed = vocab * h * (1 if tie_embeddings else 2)
    if max_position_embeddings is not None:
        embed += max_position_embeddings * h
    return embed + n_layers * per_layer + norm_params


def estimate_inference_memory(hidden_size: int, intermediate_size: int, num_layers: int,
                              vocab_size: int, num_heads: int, num_kv_heads: int, seq_len: int,
                              dtype_bytes: int, batch_size: int = 1, *,
                              tie_embeddings: bool = False, gated_mlp: bool = True,
                              bias: bool = False, max_position_embeddings: int | None = None,
                              norm: str = "rms", num_experts: int = 1,
                              experts_per_token: int = 1) -> MemoryEstimate:
    """Estimate memory to run one forward pass of ``batch_size`` sequences of ``seq_len`` tokens.

    * ``model_bytes = parameters * dtype_bytes`` (see :func:`count_parameters`).
    * ``kv_cache_bytes = 2 * num_layers * batch * seq_len * num_kv_heads * head_dim * dtype_bytes``
      with ``head_dim = hidden_size // num_heads``.
    * ``activation_bytes`` (peak transient, one layer at a time, no gradients) =
      ``dtype_bytes * (batch*num_heads*seq_len**2 + batch*seq_len*intermediate_size
      + 2*batch*seq_len*hidden_size)``: the un-fused attention score matrix, the MLP
      intermediate (times ``experts_per_token`` for a mixture of experts), and two
      hidden-sized tensors (residual stream and normed input). It is an
      upper-bound-style heuristic: fused (flash) attention needs far less, and the final
      ``batch*seq_len*vocab`` logits are not included.

    ``dtype_bytes`` must be 1, 2, 4 or 8 (use :func:`parse_dtype` for names). If
    ``max_position_embeddings`` is given (learned positions) ``seq_len`` may not exceed it.
    """
    h, i, n_layers, vocab, heads, kv_heads = _validate_shape(
        hidden_size, intermediate_size, num_layers, vocab_size, num_heads, num_kv_heads,
        tie_embeddings, gated_mlp, bias, max_position_embeddings, norm, num_experts,
        experts_per_token)
    s = _positive_int(seq_len, "seq_len")
    b = _positive_int(batch_size, "batch_size")
    db = _positive_int(dtype_bytes, "dtype_bytes")
    if db not in _VALID_DTYPE_BYTES:
        raise InvalidInputError(f"dtype_bytes must be one of {_VALID_DTYPE_BYTES}, got {db}")
    if max_position_embeddings is not None and s > max_position_embeddings:
        raise InvalidInputError(
            f"seq_len ({s}) exceeds max_position_embeddings ({max_position_embeddings}) of the "
            f"learned position table")

    params = count_parameters(h, i, n_layers, vocab, heads, kv_heads,
                              tie_embeddings=tie_embeddings, gated_mlp=gated_mlp, bias=bias,
                              max_position_embeddings=max_position_embeddings, norm=norm,
                              num_experts=num_experts, experts_per_token=experts_per_token)
    head_dim = h // heads
    model_bytes = params * db
    kv_cache_bytes = 2 * n_layers * b * s * kv_heads * head_dim * db
    activation_bytes = db * (b * heads * s * s + b * s * i * experts_per_token + 2 * b * s * h)
    return MemoryEstimate(
        parameters=params,
        model_bytes=model_bytes,
        kv_cache_bytes=kv_cache_bytes,
        activation_bytes=activation_bytes,
        total_bytes=model_bytes + kv_cache_bytes + activation_bytes,
    )


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------

#: where the presets live (one JSON object per model; see its "_about")
PRESETS_FILE = Path(__file__).resolve().parents[1] / "data" / "model_presets.json"


def load_presets(path: str | Path = PRESETS_FILE) -> dict[str, ModelShape]:
    """Read model presets from a JSON file of ``{name: {ModelShape field: value}}`` (keys
    starting with ``_`` are comments). InvalidInputError names the model and the bad field."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    names = {f.name for f in fields(ModelShape)}
    presets = {}
    for name, spec in raw.items():
        if name.startswith("_"):
            continue
        unknown = sorted(set(spec) - names)
        if unknown:
            raise InvalidInputError(f"{path}: preset {name!r} has unknown field(s) {unknown}; "
                                    f"fields are {sorted(names)}")
        try:
            presets[name.lower()] = ModelShape(**spec)
        except (InvalidInputError, TypeError) as exc:
            raise InvalidInputError(f"{path}: preset {name!r}: {exc}") from None
    return presets


MODEL_PRESETS: dict[str, ModelShape] = load_presets()
"""Named architectures (name -> :class:`ModelShape`; ``gpumem estimate --list``), from
:data:`PRESETS_FILE`; ``published_parameters`` are the counts reported by their authors
(Hugging Face checkpoints), reproduced exactly by :func:`count_parameters`."""


def preset(name: str) -> ModelShape:
    """The preset called `name` (case-insensitive); InvalidInputError listing the known ones."""
    if not isinstance(name, str):
        raise InvalidInputError(f"name must be a preset name (str), got {type(name).__name__} {name!r}")
    shape = MODEL_PRESETS.get(name.strip().lower())
    if shape is None:
        raise InvalidInputError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(MODEL_PRESETS))}")
    return shape


def estimate_model(name: str, seq_len: int | None = None, batch_size: int = 1,
                   dtype: Any = "float16") -> MemoryEstimate:
    """Estimate inference memory for the preset ``name`` (see :data:`MODEL_PRESETS`).

    ``seq_len`` None means the model's maximum context (its ``max_seq_len``). ``dtype`` is
    anything :func:`parse_dtype` accepts (``"float16"``, ``"bf16"``, ``"int8"``,
    ``np.float32``, a byte count...).
    """
    return preset(name).estimate(seq_len, batch_size, dtype)
