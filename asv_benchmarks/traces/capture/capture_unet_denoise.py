"""Diffusion-style sampling loop: a small UNet written in torch (base 32 channels, mults 1/2/4,
2 ResBlocks per level with GroupNorm + SiLU + time-embedding injection, self-attention at the
lowest resolution, skip concatenations on the way up), eval, torch.inference_mode, DDIM-like
deterministic sampler with classifier-free guidance (the batch is doubled with torch.cat every
step: conditional + unconditional, class embedding). Several requests with different image
size (48/64/96) and batch (1-4), 20 denoising steps each."""
import math
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from capture_common import capture, materialize, phase

N_REQ = int(sys.argv[1]) if len(sys.argv) > 1 else 4
STEPS = 20
CFG = dict(base=32, mults=[1, 2, 4], res_blocks=2, attn_at="lowest", groups=8, classes=10,
           requests=N_REQ, steps_per_request=STEPS, resolution="choice 48/64/96",
           batch="uniform 1-4", guidance_scale=3.0, channels=3)


def temb(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half) / half)
    a = t.float()[:, None] * f[None]
    return torch.cat([a.sin(), a.cos()], 1)


class Res(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, e):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(e)[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return h + self.skip(x)


class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n = nn.GroupNorm(8, c)
        self.qkv = nn.Conv2d(c, 3 * c, 1)
        self.o = nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, hh, ww = x.shape
        q, k, v = self.qkv(self.n(x)).reshape(b, 3, 4, c // 4, hh * ww).unbind(1)
        a = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2),
                                           v.transpose(-1, -2))
        return x + self.o(a.transpose(-1, -2).reshape(b, c, hh, ww))


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        b = CFG["base"]
        self.tdim = 4 * b
        self.temb = nn.Sequential(nn.Linear(b, self.tdim), nn.SiLU(), nn.Linear(self.tdim, self.tdim))
        self.cemb = nn.Embedding(CFG["classes"] + 1, self.tdim)
        self.inp = nn.Conv2d(3, b, 3, padding=1)
        chans = [b * m for m in CFG["mults"]]
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        cin = b
        skips = [b]
        for i, c in enumerate(chans):
            blocks = nn.ModuleList()
            for _ in range(CFG["res_blocks"]):
                blocks.append(Res(cin, c, self.tdim))
                cin = c
                skips.append(c)
            self.down.append(blocks)
            if i < len(chans) - 1:
                self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                skips.append(c)
        self.mid1, self.mida, self.mid2 = Res(cin, cin, self.tdim), Attn(cin), Res(cin, cin, self.tdim)
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i, c in reversed(list(enumerate(chans))):
            blocks = nn.ModuleList()
            for _ in range(CFG["res_blocks"] + 1):
                blocks.append(Res(cin + skips.pop(), c, self.tdim))
                cin = c
            self.up.append(blocks)
            if i > 0:
                self.upsample.append(nn.Conv2d(c, c, 3, padding=1))
        self.out = nn.Sequential(nn.GroupNorm(8, cin), nn.SiLU(), nn.Conv2d(cin, 3, 3, padding=1))

    def forward(self, x, t, y):
        e = self.temb(temb(t, CFG["base"])) + self.cemb(y)
        h = self.inp(x)
        hs = [h]
        for i, blocks in enumerate(self.down):
            for blk in blocks:
                h = blk(h, e)
                hs.append(h)
            if i < len(self.downsample):
                h = self.downsample[i](h)
                hs.append(h)
        h = self.mid2(self.mida(self.mid1(h, e)), e)
        for i, blocks in enumerate(self.up):
            for blk in blocks:
                h = blk(torch.cat([h, hs.pop()], 1), e)
            if i < len(self.upsample):
                h = self.upsample[i](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.out(h)


class W:
    def prepare(self):
        model = UNet().eval()
        rng = random.Random(1)
        reqs = [(rng.randint(1, 4), rng.choice([48, 64, 96])) for _ in range(N_REQ)]
        return model, reqs

    def run(self, prep):
        model, reqs = prep
        with phase("materialize"):
            old = materialize(model)
        g = torch.Generator().manual_seed(2)
        abar = torch.cos(torch.linspace(0, 1, 1001)[1:] * math.pi / 2) ** 2
        ts = torch.linspace(999, 0, STEPS).long()
        results = []
        with torch.inference_mode():
            for r, (bs, res) in enumerate(reqs):
                with phase(f"request{r}"):
                    x = torch.randn(bs, 3, res, res, generator=g)
                    y = torch.randint(0, CFG["classes"], (bs,), generator=g)
                    y2 = torch.cat([y, torch.full_like(y, CFG["classes"])])
                    for k, t in enumerate(ts.tolist()):
                        tt = torch.full((2 * bs,), t, dtype=torch.long)
                        eps_c, eps_u = model(torch.cat([x, x]), tt, y2).chunk(2)
                        eps = eps_u + CFG["guidance_scale"] * (eps_c - eps_u)
                        a = abar[t]
                        a_prev = abar[ts[k + 1]] if k + 1 < STEPS else torch.tensor(1.0)
                        x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
                        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
                        del tt, eps_c, eps_u, eps, a, a_prev, x0
                    results.append(float(x.mean()))
                    del x, y, y2
        with phase("teardown"):
            del model, prep, abar, ts
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    capture("unet_denoise", W(), config=CFG, description=__doc__.replace("\n", " "))
