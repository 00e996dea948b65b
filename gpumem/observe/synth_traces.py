"""Synthetic allocation traces with the shapes real workloads have, seeded and deterministic.

>>> from gpumem.observe.synth_traces import synthesize
>>> data = synthesize("serving", seed=3)           # a gpumem.observe.trace.TraceData
>>> gpumem.replay(data, "sim:80GiB")                # doctest: +SKIP

Three generators, each a model of what a PyTorch program asks its allocator for:

- :func:`serving`: an LLM serving loop with continuous batching (KV caches grown by
  concatenation, a batch that changes every step);
- :func:`varlen`: inference on batches whose sequence length changes from batch to batch
  (activations ~ batch x seq x hidden, attention ~ seq^2);
- :func:`training`: training steps (parameters once, gradients per step, Adam state at the
  first step, activations saved in the forward and freed in reverse in the backward).

They exist to judge an allocator on workloads nobody tuned it on: the same seed gives the same
trace, another seed another one of the same shape. Sizes are rounded up to 512 bytes as
PyTorch's caching allocator rounds them; ids count allocations from 0 and ``t_ns`` advances by
a modeled time per event. ``scale`` multiplies every tensor size (1.0: the default model shape
in the generator's docstring); ``steps`` sets the length. With the defaults a trace has 20k to
200k events and a peak live of 1 to 20 GiB. Model weights of the inference generators are left
out (allocated once and never freed, they would only dilute the figures); a training trace
keeps its parameters and optimizer state live at the end.
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable

import numpy as np

from gpumem.errors import InvalidInputError
from gpumem.observe.trace import OP_ALLOC, OP_FREE, TraceData

__all__ = ["serving", "varlen", "training", "synthesize", "describe", "KINDS", "ROUND"]

#: PyTorch's caching allocator rounds every request up to a multiple of 512 bytes
ROUND = 512
_BF16 = 2
_FP32 = 4
_EVENT_NS = 1_500          # modeled host time between two allocator calls of one step


class _Trace:
    """Collects events; hands out ids in allocation order and checks every free's pairing.
    Each event carries a ``tag`` (what the tensor is: ``act``, ``kv:<request>:k``, ``grad``...),
    written as the trace's ``tag`` column."""

    __slots__ = ("scale", "t", "ops", "ids", "sizes", "times", "tags", "live", "next_id")

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.t = 0
        self.ops: list[int] = []
        self.ids: list[int] = []
        self.sizes: list[int] = []
        self.times: list[int] = []
        self.tags: list[str] = []
        self.live: dict[int, tuple[int, str]] = {}
        self.next_id = 0

    def alloc(self, nbytes: float, tag: str = "act") -> int:
        n = max(ROUND, -(-int(math.ceil(nbytes * self.scale)) // ROUND) * ROUND)
        i = self.next_id
        self.next_id += 1
        self.live[i] = (n, tag)
        self._event(OP_ALLOC, i, n, tag)
        return i

    def free(self, i: int) -> None:
        n, tag = self.live.pop(i)
        self._event(OP_FREE, i, n, tag)

    def _event(self, op: int, i: int, n: int, tag: str) -> None:
        self.t += _EVENT_NS
        self.ops.append(op)
        self.ids.append(i)
        self.sizes.append(n)
        self.times.append(self.t)
        self.tags.append(tag)

    def wait(self, ns: float) -> None:
        """The GPU time of a step, between its host-side allocator calls."""
        self.t += int(ns)

    def data(self, name: str, meta: dict[str, Any]) -> TraceData:
        return TraceData(np.array(self.times, dtype=np.int64), np.array(self.ops, dtype=np.uint8),
                         np.array(self.ids, dtype=np.int64), np.array(self.sizes, dtype=np.int64),
                         name=name, extra={"tag": self.tags}, metadata=meta)


# --- argument checks ----------------------------------------------------------------------------
def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
        raise InvalidInputError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def _float(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or not lo < value <= hi:
        raise InvalidInputError(f"{name} must be a number in ({lo}, {hi}], got {value!r}")
    return float(value)


def _seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidInputError(f"seed must be an int >= 0, got {value!r}")
    return int(value)


def _layer(tr: _Trace, rows: int, hidden: int, qkv: int, ffn: int, x: int,
           in_attention: Callable[[], None] | None = None) -> int:
    """One transformer layer of a no-grad forward over ``rows`` tokens: returns the output
    hidden state's id (``x``, the input, is freed). ``in_attention`` runs while q/k/v are
    live (where a KV cache is appended to)."""
    q = tr.alloc(rows * qkv * _BF16)
    if in_attention is not None:
        in_attention()
    a = tr.alloc(rows * hidden * _BF16)
    tr.free(q)
    m = tr.alloc(rows * 2 * ffn * _BF16)         # gate and up projections, fused
    tr.free(a)
    y = tr.alloc(rows * hidden * _BF16)
    tr.free(m)
    tr.free(x)
    return y


# --- serving ------------------------------------------------------------------------------------
def serving(*, seed: int = 0, steps: int = 400, scale: float = 1.0, max_batch: int = 64,
            arrival_rate: float = 0.3, grow_every: int = 16, layers: int = 32) -> TraceData:
    """An LLM serving loop with continuous batching (a Llama-3-8B shape in bf16: hidden 4096,
    8 KV heads of 128, MLP 14336, vocabulary 128256; ``layers`` layers).

    Requests arrive as a Poisson process (``arrival_rate`` per engine step); prompt and output
    lengths are lognormal (medians 512 and 128 tokens, clipped to 16..8192 and 1..2048), so a
    few requests are long. A step admits waiting requests first come, first served while the
    batch has room (``max_batch``) and the KV caches fit an 8 GiB budget, prefills them (up to
    8192 prompt tokens a step), then decodes one token for every running request and retires
    the finished ones. Each request's KV cache (one K and one V tensor over all layers) grows by
    concatenation: every ``grow_every`` tokens a tensor ``grow_every`` tokens longer is
    allocated and the old one freed. Activations and logits are sized by the step's batch.
    After ``steps`` steps the requests still running are cancelled (their caches freed), so
    the trace ends with nothing live.

    Why it matters for fragmentation: every cache growth frees a block just too small for that
    request's next growth while the batch, and so the activation sizes, change every step;
    caches of all lengths come and go, so the free space is scattered in pieces of every size.
    This is the workload expandable segments (and vLLM's paging) exist for.
    """
    seed = _seed(seed)
    steps = _int("steps", steps, 1, 100_000)
    scale = _float("scale", scale, 0.0, 64.0)
    max_batch = _int("max_batch", max_batch, 1, 4096)
    arrival_rate = _float("arrival_rate", arrival_rate, 0.0, 1000.0)
    grow_every = _int("grow_every", grow_every, 1, 4096)
    layers = _int("layers", layers, 1, 256)
    rng = np.random.default_rng(seed)
    hidden, kv_dim, ffn, vocab = 4096, 1024, 14336, 128256
    qkv = hidden + 2 * kv_dim
    kv_token = layers * kv_dim * _BF16              # bytes per token of one K (or V) tensor
    budget = (8 << 30) // (2 * kv_token)            # tokens the KV caches may hold together
    max_prefill = 8192
    tr = _Trace(scale)
    waiting: list[tuple[int, int]] = []             # (prompt, output) in arrival order
    running: list[list[int]] = []       # [length, generated, output, cap, k, v, request]
    in_cache = 0                                    # tokens of capacity held by caches
    next_request = 0

    for _ in range(steps):
        for _ in range(int(rng.poisson(arrival_rate))):
            prompt = int(np.clip(rng.lognormal(math.log(512), 1.0), 16, 8192))
            out = int(np.clip(rng.lognormal(math.log(128), 1.0), 1, 2048))
            waiting.append((prompt, out))
        admitted: list[tuple[int, int]] = []
        tokens = 0
        while waiting and len(running) + len(admitted) < max_batch:
            prompt, out = waiting[0]
            cap = -(-(prompt + 1) // grow_every) * grow_every
            if in_cache + cap > budget or (admitted and tokens + prompt > max_prefill):
                break
            waiting.pop(0)
            admitted.append((prompt, out))
            tokens += prompt
            in_cache += cap
        if admitted:                                # prefill the new requests together
            ids = tr.alloc(tokens * 8, "input")
            x = tr.alloc(tokens * hidden * _BF16)
            new: list[list[int]] = []

            def make_caches() -> None:
                for prompt, out in admitted:
                    cap = -(-(prompt + 1) // grow_every) * grow_every
                    r = next_request + len(new)
                    new.append([prompt, 0, out, cap, tr.alloc(cap * kv_token, f"kv:{r}:k"),
                                tr.alloc(cap * kv_token, f"kv:{r}:v"), r])
            for layer in range(layers):
                x = _layer(tr, tokens, hidden, qkv, ffn, x, make_caches if layer == 0 else None)
            logits = tr.alloc(len(admitted) * vocab * _FP32, "logits")  # each prompt's last
            tr.free(x)
            tr.free(ids)
            tr.free(logits)
            tr.wait(tokens * 20_000)
            running.extend(new)
            next_request += len(new)
        if not running:
            tr.wait(5_000_000)
            continue
        batch = len(running)

        def grow_caches() -> None:
            nonlocal in_cache
            for r in running:
                r[0] += 1
                if r[0] > r[3]:                     # torch.cat: the longer copy, then the old
                    r[3] += grow_every
                    in_cache += grow_every
                    k = tr.alloc(r[3] * kv_token, f"kv:{r[6]}:k")
                    tr.free(r[4])
                    v = tr.alloc(r[3] * kv_token, f"kv:{r[6]}:v")
                    tr.free(r[5])
                    r[4], r[5] = k, v
        x = tr.alloc(batch * hidden * _BF16)
        for layer in range(layers):
            x = _layer(tr, batch, hidden, qkv, ffn, x, grow_caches if layer == 0 else None)
        logits = tr.alloc(batch * vocab * _FP32, "decode_logits")     # sized by the batch
        tr.free(x)
        tr.free(logits)
        tr.wait(12_000_000 + batch * 100_000)
        still = []
        for r in running:
            r[1] += 1
            if r[1] >= r[2]:
                tr.free(r[4])
                tr.free(r[5])
                in_cache -= r[3]
            else:
                still.append(r)
        running = still
    for r in running:                               # cancelled at the end
        tr.free(r[4])
        tr.free(r[5])
    return tr.data(f"synth-serving-seed{seed}", {
        "generator": "serving", "seed": seed, "steps": steps, "scale": scale,
        "max_batch": max_batch, "arrival_rate": arrival_rate, "grow_every": grow_every,
        "layers": layers})


# --- varlen -------------------------------------------------------------------------------------
def varlen(*, seed: int = 0, steps: int = 300, scale: float = 1.0, batch: int = 32,
           layers: int = 24, max_seq: int = 1024) -> TraceData:
    """Inference over batches of variable sequence length (an encoder with hidden 2048, 16
    heads, MLP 8192, ``layers`` layers, eager attention, bf16).

    Each of ``steps`` batches has ``batch`` sequences of one length drawn lognormal (median 192,
    clipped to 16..``max_seq``, a multiple of 8). A layer allocates q/k/v, the attention scores
    and their softmax (``batch x heads x seq x seq``), the attention output, the MLP's
    activation and its output, freeing each as soon as the next one exists.

    Why it matters for fragmentation: the attention blocks scale with seq^2 and the rest with
    seq, so every batch asks for a different set of sizes, from a few MiB to a GiB; blocks
    cached for one batch are the wrong size for the next, and a pool that splits them keeps
    fragments nobody asks for again.
    """
    seed = _seed(seed)
    steps = _int("steps", steps, 1, 100_000)
    scale = _float("scale", scale, 0.0, 64.0)
    batch = _int("batch", batch, 1, 4096)
    layers = _int("layers", layers, 1, 256)
    max_seq = _int("max_seq", max_seq, 16, 65536)
    rng = np.random.default_rng(seed)
    hidden, heads, ffn = 2048, 16, 8192
    tr = _Trace(scale)
    for _ in range(steps):
        seq = int(np.clip(rng.lognormal(math.log(192), 0.7), 16, max_seq)) // 8 * 8
        rows = batch * seq
        ids = tr.alloc(rows * 8, "input")
        x = tr.alloc(rows * hidden * _BF16)
        for _ in range(layers):
            q = tr.alloc(rows * 3 * hidden * _BF16)
            s = tr.alloc(batch * heads * seq * seq * _BF16, "attention")
            p = tr.alloc(batch * heads * seq * seq * _BF16, "attention")
            tr.free(s)
            c = tr.alloc(rows * hidden * _BF16)
            tr.free(p)
            tr.free(q)
            a = tr.alloc(rows * hidden * _BF16)
            tr.free(c)
            m = tr.alloc(rows * ffn * _BF16)
            y = tr.alloc(rows * hidden * _BF16)
            tr.free(m)
            tr.free(a)
            tr.free(x)
            x = y
        pooled = tr.alloc(batch * hidden * _FP32, "output")
        tr.free(x)
        tr.free(ids)
        tr.wait(rows * 3_000 + 1_000_000)
        tr.free(pooled)
    return tr.data(f"synth-varlen-seed{seed}", {
        "generator": "varlen", "seed": seed, "steps": steps, "scale": scale, "batch": batch,
        "layers": layers, "max_seq": max_seq})


# --- training -----------------------------------------------------------------------------------
def training(*, seed: int = 0, steps: int = 40, scale: float = 1.0, batch: int = 8,
             seq: int = 1024, layers: int = 12) -> TraceData:
    """Training steps of a decoder (hidden 1536, 12 heads, MLP 6144, vocabulary 32000,
    ``layers`` layers) in fp32 with bf16 autocast and a foreach Adam.

    The parameters are allocated once (in module order). Each step zeroes the gradients
    (set_to_none: they are freed), runs the forward (autocast's bf16 weight copies live until
    the forward ends; per layer nine activations are saved for the backward, the attention
    scores are a temporary; the logits and the fp32 loss input), then the backward (in reverse
    layer order: gradient temporaries, each parameter's ``.grad`` allocated, the layer's saved
    activations freed in reverse order) and the optimizer step (Adam's ``exp_avg`` and
    ``exp_avg_sq`` allocated at the first step, one temporary per parameter for the update).
    Each step's sequence length is ``seq`` times a factor in [0.6, 1] (packing varies),
    rounded to 64. The trace ends after a last zero_grad with the parameters and the optimizer
    state live (the persistent state).

    Why it matters for fragmentation: long-lived blocks (parameters, optimizer state, then
    gradients) are allocated between short-lived ones, and each step's activations differ a
    little in size, so cached blocks rarely fit exactly.
    """
    seed = _seed(seed)
    steps = _int("steps", steps, 1, 100_000)
    scale = _float("scale", scale, 0.0, 64.0)
    batch = _int("batch", batch, 1, 4096)
    seq = _int("seq", seq, 64, 65536)
    layers = _int("layers", layers, 1, 256)
    rng = np.random.default_rng(seed)
    hidden, heads, ffn, vocab = 1536, 12, 6144, 32000
    layer_shapes = [hidden, 3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden, hidden,
                    hidden * ffn, ffn, ffn * hidden, hidden]    # ln1, qkv w/b, out w/b, ln2, fc1, fc2
    shapes = [vocab * hidden] + layer_shapes * layers + [hidden]
    tr = _Trace(scale)
    params = [tr.alloc(n * _FP32, "param") for n in shapes]
    adam: list[int] = []
    grads: list[int] = []
    per_layer = len(layer_shapes)
    for step in range(steps):
        for g in grads:                             # zero_grad(set_to_none=True)
            tr.free(g)
        grads = []
        s = max(64, int(seq * rng.uniform(0.6, 1.0)) // 64 * 64)
        rows = batch * s
        ids = tr.alloc(rows * 8, "input")
        casts = []
        saved: list[list[int]] = []
        x0 = tr.alloc(rows * hidden * _BF16)        # embedding output: layer 0's input
        for _ in range(layers):
            casts += [tr.alloc(n * _BF16, "autocast") for n in (
                3 * hidden * hidden, hidden * hidden, hidden * ffn, ffn * hidden)]
            keep = [tr.alloc(rows * hidden * _BF16), tr.alloc(rows * 3 * hidden * _BF16)]
            scores = tr.alloc(batch * heads * s * s * _FP32)
            keep.append(tr.alloc(batch * heads * s * s * _BF16))     # softmax, saved
            tr.free(scores)
            # attention output, projection, ln2, fc1, gelu, fc2 + residual (the next input)
            keep += [tr.alloc(rows * hidden * _BF16), tr.alloc(rows * hidden * _BF16),
                     tr.alloc(rows * hidden * _BF16), tr.alloc(rows * ffn * _BF16),
                     tr.alloc(rows * ffn * _BF16), tr.alloc(rows * hidden * _BF16)]
            saved.append(keep)
        logits = tr.alloc(rows * vocab * _BF16)
        loss_in = tr.alloc(rows * vocab * _FP32)
        for c in casts:                             # autocast's cache ends with the forward
            tr.free(c)
        tr.wait(rows * 40_000)
        dlogits = tr.alloc(rows * vocab * _FP32)
        tr.free(loss_in)
        tr.free(logits)
        grads.append(tr.alloc(shapes[-1] * _FP32, "grad"))     # final norm
        dx = tr.alloc(rows * hidden * _BF16)
        tr.free(dlogits)
        for li in reversed(range(layers)):
            base = 1 + li * per_layer
            dm = tr.alloc(rows * ffn * _BF16)
            for k in reversed(range(per_layer)):
                grads.append(tr.alloc(shapes[base + k] * _FP32, "grad"))
                if k == 6:                          # the attention's backward temporaries
                    ds = tr.alloc(batch * heads * s * s * _BF16)
                    dq = tr.alloc(rows * 3 * hidden * _BF16)
                    tr.free(ds)
                    tr.free(dq)
            tr.free(dm)
            for a in reversed(saved[li]):           # its output was the next layer's input
                tr.free(a)
            ndx = tr.alloc(rows * hidden * _BF16)
            tr.free(dx)
            dx = ndx
        grads.append(tr.alloc(shapes[0] * _FP32, "grad"))      # embedding
        tr.free(x0)
        tr.free(dx)
        tr.free(ids)
        tr.wait(rows * 60_000)
        if step == 0:                               # Adam's state, at the first step
            for n in shapes:
                adam += [tr.alloc(n * _FP32, "adam"), tr.alloc(n * _FP32, "adam")]
        temps = [tr.alloc(n * _FP32, "optim_tmp") for n in shapes]  # foreach: denom per param
        for t in temps:
            tr.free(t)
    for g in grads:
        tr.free(g)
    # live at the end: the parameters and Adam's state (the persistent state)
    return tr.data(f"synth-training-seed{seed}", {
        "generator": "training", "seed": seed, "steps": steps, "scale": scale, "batch": batch,
        "seq": seq, "layers": layers, "persistent_tensors": len(params) + len(adam)})


# --- by name ------------------------------------------------------------------------------------
KINDS: dict[str, Callable[..., TraceData]] = {
    "serving": serving, "varlen": varlen, "training": training}


def synthesize(kind: str, *, seed: int = 0, **params: Any) -> TraceData:
    """The trace of generator ``kind`` (one of :data:`KINDS`) for ``seed`` and ``params``
    (the generator's keyword arguments, e.g. ``steps=``, ``scale=``). Unknown kinds or
    parameters and bad values raise :class:`~gpumem.errors.InvalidInputError`."""
    gen = KINDS.get(kind) if isinstance(kind, str) else None
    if gen is None:
        raise InvalidInputError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    allowed = [p for p in inspect.signature(gen).parameters if p != "seed"]
    for name in params:
        if name not in allowed:
            raise InvalidInputError(f"{kind} has no parameter {name!r}; its parameters are "
                                    f"seed, {', '.join(allowed)}")
    return gen(seed=seed, **params)


def describe(kind: str) -> dict[str, Any]:
    """Generator ``kind``'s defaults and what it models (its docstring's opening words)."""
    gen = KINDS[kind]
    defaults = {p.name: p.default for p in inspect.signature(gen).parameters.values()}
    first = " ".join((gen.__doc__ or "").strip().split("\n\n")[0].split())
    return {"kind": kind, "summary": first.split(" (")[0], "defaults": defaults}
