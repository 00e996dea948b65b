"""Memory to train a decoder-only transformer: weights, gradients, optimizer state, activations.

Beside :mod:`gpumem.planning.estimate` (inference). The formulas, per parameter count ``P`` and weight
dtype of ``d`` bytes:

* weights ``P*d`` and gradients ``P*d``;
* optimizer state, in float32 as PyTorch keeps it: Adam/AdamW two moments (``8*P``), SGD with
  momentum one buffer (``4*P``), plain SGD none; with a weight dtype under 4 bytes (mixed
  precision) also a float32 master copy of the weights (``4*P``). Adam in fp16/bf16 is thus the
  ``16*P`` bytes of the ZeRO paper (Rajbhandari et al., 2020);
* activations kept for the backward pass, without recomputation: per layer
  ``s*b*h*(34 + 5*a*s/h)`` bytes at 2 bytes per element (Korthikanti et al., 2022, "Reducing
  Activation Recomputation in Large Transformer Models", eq. 1: GPT layers with un-fused
  attention and dropout), scaled by ``d/2``, plus the final logits ``s*b*vocab*d``. For
  gated or mixture-of-experts MLPs it is an approximation, and fused (flash) attention stores
  far less than the ``5*a*s**2*b`` term.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from gpumem.errors import InvalidInputError
from gpumem.planning.estimate import ModelShape, _positive_int, format_breakdown, parse_dtype, preset
from gpumem.units import GiB, MiB

__all__ = ["TrainingEstimate", "estimate_training_memory", "OPTIMIZER_STATES"]

#: float32 values kept per parameter by each optimizer
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class TrainingEstimate:
    """Estimated training memory; ``total_bytes`` is the sum of the four ``*_bytes`` parts."""

    parameters: int
    model_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    total_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInputError(f"{f.name} must be a non-negative int, got {v!r}")
        parts = self.model_bytes + self.gradient_bytes + self.optimizer_bytes \
            + self.activation_bytes
        if self.total_bytes != parts:
            raise InvalidInputError(f"total_bytes ({self.total_bytes}) must equal the sum of "
                                    f"the parts ({parts})")

    def total_gib(self) -> float:
        """Total in GiB (2**30 bytes)."""
        return self.total_bytes / GiB

    def total_mb(self) -> float:
        """Total in MiB (2**20 bytes)."""
        return self.total_bytes / MiB

    def as_dict(self) -> dict[str, int]:
        """The six fields as a plain dict of ints."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        rows = [("weights", self.model_bytes), ("gradients", self.gradient_bytes),
                ("optimizer", self.optimizer_bytes), ("activations", self.activation_bytes),
                ("total", self.total_bytes)]
        return format_breakdown(self.parameters, rows)


def estimate_training_memory(model: str | ModelShape, seq_len: int | None = None,
                             batch_size: int = 1, dtype: Any = "float16", *,
                             optimizer: str = "adam") -> TrainingEstimate:
    """Estimate the memory of one training step of `model` (a preset name or a ModelShape)
    on ``batch_size`` sequences of ``seq_len`` tokens (None: the model's maximum), with
    `optimizer` one of :data:`OPTIMIZER_STATES`. See the module docstring for the formulas."""
    shape = preset(model) if isinstance(model, str) else model
    if not isinstance(shape, ModelShape):
        raise InvalidInputError(f"model must be a preset name or a ModelShape, got "
                                f"{type(model).__name__} {model!r}")
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZER_STATES:
        raise InvalidInputError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got "
                                f"{optimizer!r}")
    s = shape.default_seq_len() if seq_len is None else _positive_int(seq_len, "seq_len")
    b = _positive_int(batch_size, "batch_size")
    d = parse_dtype(dtype)
    # the inference estimate validates seq_len against a learned position table
    shape.estimate(s, b, d)
    params = shape.parameter_count()
    states = OPTIMIZER_STATES[optimizer.lower()]
    master = 4 * params if d < 4 else 0
    optimizer_bytes = 4 * params * states + master
    h, a = shape.hidden_size, shape.num_heads
    per_layer_fp16 = s * b * h * 34 + 5 * a * s * s * b
    activation_bytes = shape.num_layers * per_layer_fp16 * d // 2 + s * b * shape.vocab_size * d
    model_bytes = gradient_bytes = params * d
    return TrainingEstimate(
        parameters=params, model_bytes=model_bytes, gradient_bytes=gradient_bytes,
        optimizer_bytes=optimizer_bytes, activation_bytes=activation_bytes,
        total_bytes=model_bytes + gradient_bytes + optimizer_bytes + activation_bytes)
