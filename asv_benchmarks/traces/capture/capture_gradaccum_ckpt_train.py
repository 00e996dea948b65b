"""Gradient accumulation with varying micro-batch sizes and activation checkpointing: a small
GPT-style decoder written in torch (vocab 6000, d 320, 6 layers, 5 heads, SDPA causal, GELU MLP
1280, learned positions, tied-size head); the even layers run under
torch.utils.checkpoint(use_reentrant=False) so their activations are recomputed in backward.
Each optimizer step accumulates 2-6 micro-batches whose shape varies (batch 1-12 x sequence
64-384, token budget 3072), loss scaled by the micro-batch's share of tokens; then
clip_grad_norm_(1.0), AdamW(foreach=True), zero_grad(set_to_none=True)."""
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from capture_common import capture, materialize, phase

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
CFG = dict(vocab=6000, d=320, layers=6, heads=5, mlp=1280, max_pos=512, steps=STEPS,
           micro_batches="uniform 2-6 per step", micro_batch="batch uniform 1-12 x seq "
           "choice 64/128/192/256/384, capped at 3072 tokens",
           checkpointed_layers="even (0,2,4), use_reentrant=False",
           optimizer="AdamW(lr=3e-4, foreach=True)", grad_clip=1.0)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        d = CFG["d"]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, CFG["mlp"]), nn.Linear(CFG["mlp"], d)

    def forward(self, x):
        b, t, d = x.shape
        h = CFG["heads"]
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(CFG["vocab"], CFG["d"])
        self.pos = nn.Embedding(CFG["max_pos"], CFG["d"])
        self.layers = nn.ModuleList(Layer() for _ in range(CFG["layers"]))
        self.ln = nn.LayerNorm(CFG["d"])
        self.head = nn.Linear(CFG["d"], CFG["vocab"], bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=False) if i % 2 == 0 else layer(x)
        return self.head(self.ln(x))


class W:
    def prepare(self):
        model = GPT().train()
        rng = random.Random(1)
        plan = []
        for _ in range(STEPS):
            micro = []
            for _ in range(rng.randint(2, 6)):
                seq = rng.choice([64, 128, 192, 256, 384])
                micro.append((min(rng.randint(1, 12), 3072 // seq), seq))
            plan.append(micro)
        return model, plan

    def run(self, prep):
        model, plan = prep
        with phase("materialize"):
            old = materialize(model)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
        g = torch.Generator().manual_seed(2)
        for k, micro in enumerate(plan):
            with phase(f"step{k}"):
                total = sum(b * s for b, s in micro)
                for bs, seq in micro:
                    tok = torch.randint(0, CFG["vocab"], (bs, seq + 1), generator=g)
                    logits = model(tok[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, CFG["vocab"]),
                                           tok[:, 1:].reshape(-1)) * (bs * seq / total)
                    loss.backward()
                    del tok, logits, loss
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        with phase("teardown"):
            del opt, model, prep
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    capture("gradaccum_ckpt_train", W(), config=CFG, description=__doc__.replace("\n", " "))
