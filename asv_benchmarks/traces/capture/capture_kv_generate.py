"""Autoregressive generation with a growing KV cache: a tiny pre-LN decoder written in torch
(vocab 8000, d 256, 4 layers, 8 heads, GELU MLP 1024, learned positions), eval,
torch.inference_mode. Per request: a prefill over the prompt, then one token at a time; each
layer's K and V caches grow by torch.cat every step (like HF's DynamicCache), attention via
SDPA. Sampling: temperature 0.8 + top-k 50 via multinomial. Several requests of different batch
(1-4), prompt length (24-384) and new tokens (64-256)."""
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from capture_common import capture, materialize, phase

N_REQ = int(sys.argv[1]) if len(sys.argv) > 1 else 7
CFG = dict(vocab=8000, d=256, layers=4, heads=8, mlp=1024, max_pos=1024, requests=N_REQ,
           batch="uniform 1-4", prompt="uniform 24-384", new_tokens="uniform 64-256",
           sampling="temperature 0.8, top-k 50, multinomial", kv_cache="torch.cat per step")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        d = CFG["d"]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, CFG["mlp"])
        self.fc2 = nn.Linear(CFG["mlp"], d)

    def forward(self, x, cache):
        b, t, d = x.shape
        h = CFG["heads"]
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, (k, v)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(CFG["vocab"], CFG["d"])
        self.pos = nn.Embedding(CFG["max_pos"], CFG["d"])
        self.layers = nn.ModuleList(Layer() for _ in range(CFG["layers"]))
        self.ln = nn.LayerNorm(CFG["d"])
        self.head = nn.Linear(CFG["d"], CFG["vocab"], bias=False)

    def forward(self, idx, start, caches):
        pos = torch.arange(start, start + idx.shape[1])
        x = self.tok(idx) + self.pos(pos)
        new = []
        for layer, c in zip(self.layers, caches):
            x, c = layer(x, c)
            new.append(c)
        return self.head(self.ln(x[:, -1])), new


class W:
    def prepare(self):
        model = Decoder().eval()
        rng = random.Random(1)
        reqs = [(rng.randint(1, 4), rng.randint(24, 384), rng.randint(64, 256))
                for _ in range(N_REQ)]
        return model, reqs

    def run(self, prep):
        model, reqs = prep
        with phase("materialize"):
            old = materialize(model)
        g = torch.Generator().manual_seed(2)
        texts = []
        with torch.inference_mode():
            for r, (bs, plen, new) in enumerate(reqs):
                with phase(f"request{r}"):
                    idx = torch.randint(0, CFG["vocab"], (bs, plen), generator=g)
                    caches = [None] * CFG["layers"]
                    logits, caches = model(idx, 0, caches)
                    out = [idx]
                    for s in range(new):
                        vals, ids = (logits / 0.8).topk(50, dim=-1)
                        choice = torch.multinomial(vals.softmax(-1), 1, generator=g)
                        nxt = ids.gather(-1, choice)
                        out.append(nxt)
                        logits, caches = model(nxt, plen + s, caches)
                    texts.append(torch.cat(out, 1).shape)
                    del idx, caches, logits, out, vals, ids, choice, nxt
        with phase("teardown"):
            del model, prep
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    capture("kv_generate", W(), config=CFG, description=__doc__.replace("\n", " "))
