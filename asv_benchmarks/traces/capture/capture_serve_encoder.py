"""Serving loop: a 4-layer nn.TransformerEncoder (d_model 256, 8 heads, ff 1024, batch_first,
eval, torch.inference_mode) answering requests of random batch size (1-32) and sequence length
(16-512, log-uniform), capped at a 4096-token budget per request. Half of the requests carry a
key-padding mask (ragged lengths inside the batch, which sends the encoder's fast path through
nested tensors); embedding lookup on the way in and a pooled classifier head on the way out."""
import math
import random
import sys

import torch
import torch.nn as nn

from capture_common import capture, materialize, phase

N_REQ = int(sys.argv[1]) if len(sys.argv) > 1 else 220
CFG = dict(d_model=256, nhead=8, dim_feedforward=1024, num_layers=4, vocab=8000, n_classes=16,
           requests=N_REQ, batch="uniform 1-32", seq="log-uniform 16-512",
           token_budget=4096, padding_mask_fraction=0.5)


class Server(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CFG["vocab"], CFG["d_model"])
        layer = nn.TransformerEncoderLayer(CFG["d_model"], CFG["nhead"], CFG["dim_feedforward"],
                                           dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, CFG["num_layers"], enable_nested_tensor=True)
        self.head = nn.Linear(CFG["d_model"], CFG["n_classes"])

    def forward(self, ids, pad_mask):
        x = self.emb(ids)
        h = self.enc(x, src_key_padding_mask=pad_mask)
        if pad_mask is not None:
            keep = (~pad_mask).unsqueeze(-1).to(h.dtype)
            pooled = (h * keep).sum(1) / keep.sum(1).clamp_min(1)
        else:
            pooled = h.mean(1)
        return self.head(pooled).softmax(-1)


class W:
    def prepare(self):
        model = Server().eval()
        rng = random.Random(1)
        reqs = []
        for _ in range(N_REQ):
            seq = int(round(math.exp(rng.uniform(math.log(16), math.log(512)))))
            bs = min(rng.randint(1, 32), max(1, CFG["token_budget"] // seq))
            masked = rng.random() < CFG["padding_mask_fraction"] and bs > 1
            lens = [rng.randint(max(1, seq // 4), seq) for _ in range(bs)] if masked else None
            if lens:
                lens[0] = seq
            reqs.append((bs, seq, lens))
        return model, reqs

    def run(self, prep):
        model, reqs = prep
        with phase("materialize"):
            old = materialize(model)
        g = torch.Generator().manual_seed(2)
        outs = []
        with torch.inference_mode():
            for k, (bs, seq, lens) in enumerate(reqs):
                with phase(f"request{k}"):
                    ids = torch.randint(0, CFG["vocab"], (bs, seq), generator=g)
                    mask = None
                    if lens:
                        mask = torch.arange(seq).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)
                    out = model(ids, mask)
                    outs.append(out.argmax(-1).tolist())
                    del ids, mask, out
        with phase("teardown"):
            del model, prep
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    w = W()
    capture("serve_encoder", w, config=CFG, description=__doc__.replace("\n", " "))
