"""Multi-scale CNN training: a plain-torch ResNet-18 (BasicBlock [2,2,2,2], BatchNorm, NCHW
fp32, 100 classes), batch 8, image resolution drawn per step from 128/160/192/224 (as in
multi-scale / progressive-resize training), forward + label-smoothed cross-entropy + backward +
SGD(momentum 0.9, nesterov, weight_decay 5e-4, foreach=True) + zero_grad(set_to_none=True)."""
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from capture_common import capture, materialize, phase

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 22
RES = [128, 160, 192, 224]
CFG = dict(arch="resnet18", batch=8, resolutions=RES, steps=STEPS, classes=100,
           optimizer="SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, foreach=True)",
           label_smoothing=0.1)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)), inplace=True)
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.down is None else self.down(x)), inplace=True)


class ResNet18(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class W:
    def prepare(self):
        model = ResNet18(CFG["classes"]).train()
        rng = random.Random(1)
        plan = [rng.choice(RES) for _ in range(STEPS)]
        return model, plan

    def run(self, prep):
        model, plan = prep
        with phase("materialize"):
            old = materialize(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                  weight_decay=5e-4, foreach=True)
        g = torch.Generator().manual_seed(2)
        for k, res in enumerate(plan):
            with phase(f"step{k}"):
                x = torch.randn(CFG["batch"], 3, res, res, generator=g)
                y = torch.randint(0, CFG["classes"], (CFG["batch"],), generator=g)
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss.item()
                del x, y, loss
        with phase("teardown"):
            del opt, model, prep
            import gc
            gc.collect()
        self.old = old


if __name__ == "__main__":
    capture("cnn_multiscale_train", W(), config=CFG, description=__doc__.replace("\n", " "))
