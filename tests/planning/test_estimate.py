"""Tests for gpumem.planning.estimate (transformer memory estimates)."""
from __future__ import annotations

import dataclasses

import pytest

from gpumem.errors import InvalidInputError
from gpumem.planning.estimate import (
    GB,
    MODEL_PRESETS,
    MemoryEstimate,
    ModelShape,
    count_parameters,
    estimate_inference_memory,
    estimate_model,
    parse_dtype,
)
from gpumem.units import GiB

PUBLISHED = {
    "mistral-7b": 7_241_732_096,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "llama-3-8b": 8_030_261_248,
}

# A small valid architecture used by the validation tests.
SMALL = dict(hidden_size=64, intermediate_size=256, num_layers=2, vocab_size=100,
             num_heads=8, num_kv_heads=2, seq_len=16, dtype_bytes=2)


# --------------------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("name,published", sorted(PUBLISHED.items()))
def test_presets_reproduce_published_counts(name: str, published: int) -> None:
    est = estimate_model(name, seq_len=128)
    assert abs(est.parameters - published) <= 0.02 * published
    assert est.parameters == published  # the formulas are exact for these architectures
    assert MODEL_PRESETS[name].parameter_count() == published
    assert MODEL_PRESETS[name].published_parameters == published


def test_preset_shapes() -> None:
    m = MODEL_PRESETS["mistral-7b"]
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.vocab_size, m.num_heads,
            m.num_kv_heads, m.tie_embeddings, m.gated_mlp) == (4096, 14336, 32, 32000, 32, 8,
                                                               False, True)
    g = MODEL_PRESETS["gpt2"]
    assert (g.tie_embeddings, g.gated_mlp, g.bias, g.max_position_embeddings, g.norm) == (
        True, False, True, 1024, "layer")
    assert all(isinstance(s, ModelShape) for s in MODEL_PRESETS.values())


def test_gpt2_parameter_breakdown_by_hand() -> None:
    h, i, v = 768, 3072, 50257
    per_layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * (2 * h)
    expected = v * h + 1024 * h + 12 * per_layer + 2 * h
    assert expected == 124_439_808
    assert count_parameters(h, i, 12, v, 12, 12, tie_embeddings=True, gated_mlp=False,
                            bias=True, max_position_embeddings=1024, norm="layer") == expected


def test_parameter_options_change_count_as_documented() -> None:
    arch = dict(hidden_size=64, intermediate_size=256, num_layers=2, vocab_size=100,
                num_heads=8, num_kv_heads=2)
    base = count_parameters(**arch)
    assert base - count_parameters(**arch, tie_embeddings=True) == 100 * 64
    assert base - count_parameters(**arch, gated_mlp=False) == 2 * 64 * 256
    assert count_parameters(**arch, max_position_embeddings=32) - base == 32 * 64
    # layer norm adds a bias of h to each of the 2 per-layer norms and to the final norm
    assert count_parameters(**arch, norm="layer") - base == (2 * 2 + 1) * 64
    kv_dim = 2 * (64 // 8)
    attn_bias = 2 * 64 + 2 * kv_dim
    mlp_bias = 2 * 256 + 64
    assert count_parameters(**arch, bias=True) - base == 2 * (attn_bias + mlp_bias)


# --------------------------------------------------------------------------- kv cache / activations

def test_kv_cache_hand_computed() -> None:
    # 2 (k and v) * 2 layers * batch 3 * seq 16 * 2 kv heads * head_dim 8 * 2 bytes
    est = estimate_inference_memory(64, 256, 2, 100, 8, 2, 16, 2, 3)
    assert est.kv_cache_bytes == 2 * 2 * 3 * 16 * 2 * 8 * 2 == 6144


def test_kv_cache_mistral_4k() -> None:
    est = estimate_model("mistral-7b", seq_len=4096, dtype="fp16")
    # 2 * 32 layers * 4096 tokens * 8 kv heads * 128 head_dim * 2 bytes = 512 MiB
    assert est.kv_cache_bytes == 512 * 2**20
    assert est.kv_cache_gib() == 0.5


def test_activation_formula_hand_computed() -> None:
    est = estimate_inference_memory(64, 256, 2, 100, 8, 2, 16, 2, 3)
    b, heads, s, i, h, db = 3, 8, 16, 256, 64, 2
    assert est.activation_bytes == db * (b * heads * s * s + b * s * i + 2 * b * s * h)


def test_activations_monotonic_in_batch_and_seq() -> None:
    prev = 0
    for batch in (1, 2, 4, 8):
        a = estimate_model("llama-2-7b", seq_len=512, batch_size=batch).activation_bytes
        assert a > prev
        prev = a
    prev = 0
    for seq in (1, 16, 512, 4096):
        a = estimate_model("llama-2-7b", seq_len=seq).activation_bytes
        assert a > prev
        prev = a


def test_model_bytes_independent_of_batch_and_seq() -> None:
    a = estimate_model("mistral-7b", seq_len=16)
    b = estimate_model("mistral-7b", seq_len=2048, batch_size=4)
    assert a.model_bytes == b.model_bytes == a.parameters * 2
    assert b.kv_cache_bytes == a.kv_cache_bytes * 128 * 4


def test_total_is_sum() -> None:
    est = estimate_model("llama-3-8b", seq_len=1024, batch_size=2, dtype="bf16")
    assert est.total_bytes == est.model_bytes + est.kv_cache_bytes + est.activation_bytes


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("name,nbytes", [
    ("float16", 2), ("fp16", 2), ("half", 2), ("bfloat16", 2), ("bf16", 2), ("BF16", 2),
    ("float32", 4), ("fp32", 4), ("int8", 1), ("fp8", 1), ("float64", 8),
    ("torch.float16", 2), (" float32 ", 4), (1, 1), (2, 2), (4, 4), (8, 8),
])
def test_parse_dtype_names(name: object, nbytes: int) -> None:
    assert parse_dtype(name) == nbytes


def test_parse_dtype_numpy() -> None:
    np = pytest.importorskip("numpy")
    assert parse_dtype(np.float16) == 2
    assert parse_dtype(np.dtype("float32")) == 4
    assert parse_dtype(np.int8) == 1
    assert parse_dtype(np.dtype(np.float64)) == 8
    for bad in (np.bool_, np.complex64, np.dtype("V2"), np.dtype("U4")):
        with pytest.raises(InvalidInputError):
            parse_dtype(bad)


@pytest.mark.parametrize("bad", ["int4", "nf4", "float", "float17", "", 3, 0, -2, 16, True, None,
                                 2.0, object()])
def test_parse_dtype_rejects(bad: object) -> None:
    with pytest.raises(InvalidInputError):
        parse_dtype(bad)


def test_int4_error_mentions_whole_bytes() -> None:
    with pytest.raises(InvalidInputError, match="whole-byte"):
        parse_dtype("int4")


def test_estimate_model_dtype_scales_weights() -> None:
    f16 = estimate_model("gpt2", seq_len=64, dtype="float16")
    f32 = estimate_model("gpt2", seq_len=64, dtype="float32")
    i8 = estimate_model("gpt2", seq_len=64, dtype="int8")
    by_bytes = estimate_model("gpt2", seq_len=64, dtype=2)
    assert f32.model_bytes == 2 * f16.model_bytes == 4 * i8.model_bytes
    assert f32.total_bytes == 2 * f16.total_bytes
    assert by_bytes == f16


# --------------------------------------------------------------------------- units and output

def test_gb_and_gib_helpers_consistent() -> None:
    est = estimate_model("llama-2-13b", seq_len=2048, batch_size=2)
    for part in ("total", "model", "kv_cache", "activations"):
        nbytes = getattr(est, "activation_bytes" if part == "activations" else f"{part}_bytes")
        gb = getattr(est, f"{part}_gb")()
        gib = getattr(est, f"{part}_gib")()
        assert gb == nbytes / 1e9 == nbytes / GB
        assert gib == nbytes / 2**30 == nbytes / GiB
        assert gb == pytest.approx(gib * GiB / GB)
        assert gb > gib
    assert est.total_gb() == pytest.approx(est.model_gb() + est.kv_cache_gb() + est.activations_gb())


def test_as_dict_and_str() -> None:
    est = estimate_model("gpt2", seq_len=1024)
    d = est.as_dict()
    assert d == {"parameters": est.parameters, "model_bytes": est.model_bytes,
                 "kv_cache_bytes": est.kv_cache_bytes, "activation_bytes": est.activation_bytes,
                 "total_bytes": est.total_bytes}
    assert all(type(v) is int for v in d.values())
    text = str(est)
    assert "124,439,808" in text
    assert "GiB" in text and "GB" in text
    for label in ("weights", "kv cache", "activations", "total"):
        assert label in text


def test_memory_estimate_is_frozen_and_checked() -> None:
    est = estimate_model("gpt2", seq_len=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        est.total_bytes = 0  # type: ignore[misc]
    with pytest.raises(InvalidInputError):
        MemoryEstimate(parameters=1, model_bytes=2, kv_cache_bytes=3, activation_bytes=4,
                       total_bytes=10)
    with pytest.raises(InvalidInputError):
        MemoryEstimate(parameters=-1, model_bytes=0, kv_cache_bytes=0, activation_bytes=0,
                       total_bytes=0)


# --------------------------------------------------------------------------- validation

INT_ARGS = ["hidden_size", "intermediate_size", "num_layers", "vocab_size", "num_heads",
            "num_kv_heads", "seq_len", "dtype_bytes"]


@pytest.mark.parametrize("arg", INT_ARGS + ["batch_size"])
@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, "8", None])
def test_integer_arguments_validated(arg: str, bad: object) -> None:
    kwargs = dict(SMALL, batch_size=1)
    kwargs[arg] = bad
    with pytest.raises(InvalidInputError, match=arg):
        estimate_inference_memory(**kwargs)


def test_numpy_integers_accepted() -> None:
    np = pytest.importorskip("numpy")
    kwargs = {k: np.int64(v) for k, v in SMALL.items()}
    assert estimate_inference_memory(**kwargs) == estimate_inference_memory(**SMALL)


def test_heads_must_divide_hidden() -> None:
    with pytest.raises(InvalidInputError, match="num_heads"):
        estimate_inference_memory(**dict(SMALL, num_heads=7, num_kv_heads=7))


def test_kv_heads_must_divide_heads() -> None:
    with pytest.raises(InvalidInputError, match="num_kv_heads"):
        estimate_inference_memory(**dict(SMALL, num_kv_heads=3))


@pytest.mark.parametrize("db", [3, 5, 16])
def test_dtype_bytes_must_be_whole_supported(db: int) -> None:
    with pytest.raises(InvalidInputError, match="dtype_bytes"):
        estimate_inference_memory(**dict(SMALL, dtype_bytes=db))


@pytest.mark.parametrize("flag", ["tie_embeddings", "gated_mlp", "bias"])
def test_flags_must_be_bool(flag: str) -> None:
    with pytest.raises(InvalidInputError, match=flag):
        estimate_inference_memory(**SMALL, **{flag: 1})


def test_norm_and_position_options_validated() -> None:
    with pytest.raises(InvalidInputError, match="norm"):
        estimate_inference_memory(**SMALL, norm="batch")
    with pytest.raises(InvalidInputError, match="max_position_embeddings"):
        estimate_inference_memory(**SMALL, max_position_embeddings=0)
    with pytest.raises(InvalidInputError, match="seq_len"):
        estimate_inference_memory(**SMALL, max_position_embeddings=8)  # seq_len 16 > 8
    with pytest.raises(InvalidInputError, match="seq_len"):
        estimate_model("gpt2", seq_len=1025)
    assert estimate_model("gpt2", seq_len=1024).parameters == 124_439_808


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(InvalidInputError) as info:
        estimate_model("gpt-5", seq_len=16)
    for name in MODEL_PRESETS:
        assert name in str(info.value)
    with pytest.raises(InvalidInputError):
        estimate_model(None, seq_len=16)  # type: ignore[arg-type]


def test_estimate_model_validates_seq_batch_dtype() -> None:
    with pytest.raises(InvalidInputError, match="seq_len"):
        estimate_model("mistral-7b", seq_len=0)
    with pytest.raises(InvalidInputError, match="batch_size"):
        estimate_model("mistral-7b", seq_len=8, batch_size=True)
    with pytest.raises(InvalidInputError):
        estimate_model("mistral-7b", seq_len=8, dtype="int4")


def test_model_shape_validates() -> None:
    with pytest.raises(InvalidInputError, match="num_kv_heads"):
        ModelShape(64, 256, 2, 100, 8, 3)
    with pytest.raises(InvalidInputError, match="hidden_size"):
        ModelShape(0, 256, 2, 100, 8, 2)


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        parse_dtype("nope")


# --------------------------------------------------------------------------- issue 10 item 4, issue 15 item 10

def test_mib_helpers_divide_by_2_20() -> None:
    """real: model_mb / kv_cache_mb / activation_mb / total_mb are MiB (2**20), so seed 000's
    ``est.model_mb() / 1024`` prints GiB."""
    est = estimate_model("llama-2-7b", seq_len=2048, batch_size=2)
    assert est.model_mb() == est.model_bytes / 2**20
    assert est.kv_cache_mb() == est.kv_cache_bytes / 2**20
    assert est.activation_mb() == est.activation_bytes / 2**20
    assert est.total_mb() == pytest.approx(est.model_mb() + est.kv_cache_mb() + est.activation_mb())
    assert est.model_mb() / 1024 == pytest.approx(est.model_gib())
    # llama-2-7b fp16 weights: 6,738,415,616 * 2 bytes = 12,852.5 MiB
    assert est.model_mb() == pytest.approx(12852.51, abs=0.01)


def test_mixture_of_experts_preset_reproduces_mixtral() -> None:
    """real: Mixtral-8x7B's published 46,702,792,704 parameters come out of the formula with 8
    experts (all counted) plus the router; the MLP activations scale with the 2 active experts;
    the KV cache is that of the dense model with the same attention."""
    m = MODEL_PRESETS["mixtral-8x7b"]
    assert (m.num_experts, m.experts_per_token) == (8, 2)
    assert m.parameter_count() == m.published_parameters == 46_702_792_704
    dense = dataclasses.replace(m, num_experts=1, experts_per_token=1, published_parameters=None)
    moe, one = m.estimate(256), dense.estimate(256)
    assert moe.kv_cache_bytes == one.kv_cache_bytes
    assert moe.activation_bytes - one.activation_bytes == 2 * 256 * m.intermediate_size
    with pytest.raises(InvalidInputError, match="experts_per_token"):
        dataclasses.replace(m, experts_per_token=9)


def test_presets_are_data_and_default_to_the_models_maximum(tmp_path) -> None:
    """real: MODEL_PRESETS is read from gpumem/data/model_presets.json; seq_len None is the
    model's trained context (gpt2: 1024); a bad preset file names the model and field."""
    import json

    from gpumem.planning.estimate import PRESETS_FILE, load_presets
    raw = json.loads(PRESETS_FILE.read_text())
    assert set(MODEL_PRESETS) == {k for k in raw if not k.startswith("_")}
    assert estimate_model("gpt2") == estimate_model("gpt2", seq_len=1024)
    assert estimate_model("llama-3-8b") == estimate_model("llama-3-8b", seq_len=8192)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"tiny": {"hidden_size": 64, "hiden": 3}}))
    with pytest.raises(InvalidInputError, match="'tiny'.*hiden"):
        load_presets(bad)
    shape = ModelShape(64, 256, 2, 100, 8, 2)
    with pytest.raises(InvalidInputError, match="seq_len"):
        shape.estimate()


def test_training_estimate_adam_mixed_precision_is_16_bytes_per_parameter() -> None:
    """real: Adam with fp16 weights keeps weights 2 + gradients 2 + fp32 master 4 + two fp32
    moments 8 = 16 bytes per parameter (ZeRO paper); SGD without momentum in fp32 keeps
    weights + gradients only; activations follow Korthikanti et al. eq. 1 plus the logits."""
    from gpumem.planning.estimate_training import estimate_training_memory
    g = MODEL_PRESETS["gpt2"]
    p = g.parameter_count()
    est = estimate_training_memory("gpt2", seq_len=512, batch_size=4, dtype="fp16")
    assert est.model_bytes + est.gradient_bytes + est.optimizer_bytes == 16 * p
    s, b, h, a, L = 512, 4, 768, 12, 12
    assert est.activation_bytes == L * (s * b * h * 34 + 5 * a * s * s * b) + s * b * 50257 * 2
    assert est.total_bytes == sum(v for k, v in est.as_dict().items()
                                  if k.endswith("_bytes") and k != "total_bytes")
    sgd = estimate_training_memory(g, seq_len=512, batch_size=4, dtype="fp32", optimizer="sgd")
    assert sgd.optimizer_bytes == 0 and sgd.model_bytes == sgd.gradient_bytes == 4 * p
    mom = estimate_training_memory(g, seq_len=512, batch_size=4, dtype="fp32",
                                   optimizer="sgd-momentum")
    assert mom.optimizer_bytes == 4 * p
    assert estimate_training_memory("gpt2").activation_bytes > est.activation_bytes / 4
    with pytest.raises(InvalidInputError, match="optimizer"):
        estimate_training_memory("gpt2", optimizer="lion")
    with pytest.raises(InvalidInputError, match="max_position_embeddings"):
        estimate_training_memory("gpt2", seq_len=2048)
