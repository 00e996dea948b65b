"""LSTM language-model training with bucketed variable sequence lengths: embedding (vocab 6000,
dim 256) -> 2-layer nn.LSTM (hidden 512, dropout 0.2) -> tied-size linear head, cross-entropy,
backward, clip_grad_norm_(1.0), Adam(foreach=True), zero_grad(set_to_none=True). Each step draws
a bucket (sequence length 32/64/128/256) and a batch size that keeps about 2048 tokens per step
(64/32/16/8 sequences), random order of buckets, so activation shapes change every step."""
import random
import sys

import torch
import torch.nn as nn

from capture_common import capture, materialize, phase

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 32
BUCKETS = {32: 64, 64: 32, 128: 16, 256: 8}
CFG = dict(vocab=6000, emb=256, hidden=512, layers=2, dropout=0.2, steps=STEPS,
           buckets_seq_to_batch=BUCKETS, optimizer="Adam(lr=1e-3, foreach=True)",
           grad_clip=1.0)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CFG["vocab"], CFG["emb"])
        self.rnn = nn.LSTM(CFG["emb"], CFG["hidden"], CFG["layers"], batch_first=True,
                           dropout=CFG["dropout"])
        self.drop = nn.Dropout(CFG["dropout"])
        self.head = nn.Linear(CFG["hidden"], CFG["vocab"])

    def forward(self, x):
        h, _ = self.rnn(self.drop(self.emb(x)))
        return self.head(self.drop(h))


class W:
    def prepare(self):
        model = LM().train()
        rng = random.Random(1)
        plan = [rng.choice(list(BUCKETS)) for _ in range(STEPS)]
        return model, plan

    def run(self, prep):
        model, plan = prep
        with phase("materialize"):
            old = materialize(model)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        g = torch.Generator().manual_seed(2)
        lossf = nn.CrossEntropyLoss()
        for k, seq in enumerate(plan):
            bs = BUCKETS[seq]
            with phase(f"step{k}"):
                tok = torch.randint(0, CFG["vocab"], (bs, seq + 1), generator=g)
                x, y = tok[:, :-1], tok[:, 1:]
                logits = model(x)
                loss = lossf(logits.reshape(-1, CFG["vocab"]), y.reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss_v = loss.item()
                del tok, x, y, logits, loss
        with phase("teardown"):
            del opt, model, prep
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    capture("lstm_lm_train", W(), config=CFG, description=__doc__.replace("\n", " "))
