"""Mixture-of-experts training: token embeddings (vocab 4000, d 256) -> 2 x [pre-LN self-attention
(4 heads, SDPA, causal) + top-2 MoE FFN with 8 experts (256->1024->256, GELU)] -> LM head. The
router's softmax picks 2 experts per token; tokens are gathered per expert with index_select,
run through the expert, weighted and scattered back with index_add_, so the token count each
expert sees changes every step (an auxiliary load-balancing loss keeps routing moving). The
batch shape also varies per step (batch 4-16 x sequence 64-256, ~512-4096 tokens). Cross-entropy
+ 0.01 * aux loss, backward, AdamW(foreach=True), zero_grad(set_to_none=True)."""
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from capture_common import capture, materialize, phase

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
CFG = dict(vocab=4000, d=256, heads=4, ffn=1024, experts=8, top_k=2, layers=2, steps=STEPS,
           batch="uniform 4-16", seq="choice 64/96/128/192/256",
           optimizer="AdamW(lr=1e-3, foreach=True)", aux_loss_weight=0.01)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        d, f, e = CFG["d"], CFG["ffn"], CFG["experts"]
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(d, f) for _ in range(e))
        self.w2 = nn.ModuleList(nn.Linear(f, d) for _ in range(e))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(-1)
        topw, topi = probs.topk(CFG["top_k"], dim=-1)
        topw = topw / topw.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(CFG["experts"]):
            tok, slot = (topi == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = self.w2[e](F.gelu(self.w1[e](x.index_select(0, tok))))
            out = out.index_add(0, tok, h * topw[tok, slot].unsqueeze(-1))
        frac = F.one_hot(topi[:, 0], CFG["experts"]).float().mean(0)
        aux = CFG["experts"] * (frac * probs.mean(0)).sum()
        return out.reshape(shape), aux


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        d = CFG["d"]
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoE()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        hd = d // CFG["heads"]
        q, k, v = (z.view(b, t, CFG["heads"], hd).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        m, aux = self.moe(self.ln2(x))
        return x + m, aux


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CFG["vocab"], CFG["d"])
        self.blocks = nn.ModuleList(Block() for _ in range(CFG["layers"]))
        self.ln = nn.LayerNorm(CFG["d"])
        self.head = nn.Linear(CFG["d"], CFG["vocab"])

    def forward(self, idx):
        x = self.emb(idx)
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return self.head(self.ln(x)), aux


class W:
    def prepare(self):
        model = Model().train()
        rng = random.Random(1)
        plan = [(rng.randint(4, 16), rng.choice([64, 96, 128, 192, 256])) for _ in range(STEPS)]
        return model, plan

    def run(self, prep):
        model, plan = prep
        with phase("materialize"):
            old = materialize(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        g = torch.Generator().manual_seed(2)
        for k, (bs, seq) in enumerate(plan):
            with phase(f"step{k}"):
                tok = torch.randint(0, CFG["vocab"], (bs, seq + 1), generator=g)
                logits, aux = model(tok[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, CFG["vocab"]), tok[:, 1:].reshape(-1))
                loss = loss + CFG["aux_loss_weight"] * aux
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss.item()
                del tok, logits, aux, loss
        with phase("teardown"):
            del opt, model, prep
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    capture("moe_train", W(), config=CFG, description=__doc__.replace("\n", " "))
