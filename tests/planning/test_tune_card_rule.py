"""tune's card rule follows the soft limits (issue 38, points 2 and 5): on an 80 GiB CUDA card
gpumem has what PyTorch has, and MemoryConfig()'s smallest card is no larger than PyTorch's
default's; a preset's soft limits bound no row, its hard ones do.

Level: **real** (the real pool replaying a shipped trace on gpumem_sim; the model of PyTorch's
allocator).
"""
from __future__ import annotations

from pathlib import Path

import gpumem
from gpumem.planning.tune import Candidate, tune

TRACES = Path(gpumem.__file__).parent / "data" / "traces"


def test_80gib_cuda_card_gives_gpumem_what_pytorch_gets():
    """gpumem tune bert_varlen_infer --card 80GiB --card-kind cuda: gpumem's capacity is at
    least PyTorch's, and the default row's smallest card at most PyTorch default's (real)."""
    default = Candidate("gpumem", "default", (("segments", "auto"),))
    res = tune(TRACES / "bert_varlen_infer.csv.gz", "80GiB", card_kind="cuda",
               gpumem_configs=[default], torch_confs=[""], jobs=1)
    doc = res.as_dict()
    assert doc["gpumem_capacity"] >= doc["torch_capacity"] > 79 * (1 << 30)
    rows = {r["allocator"]: r for r in res.rows}
    assert rows["gpumem"]["config"] == "MemoryConfig.default()"
    assert rows["gpumem"]["min_capacity_bytes"] <= rows["torch"]["min_capacity_bytes"]


def test_soft_limits_bound_no_row_hard_ones_do():
    """A row that does not fit is bounded by the card under the default preset (soft limits),
    by gpu_memory_fraction under the constrained one (hard) (real)."""
    grid = [Candidate("gpumem", "default", (("segments", "auto"),)),
            Candidate("gpumem", "constrained", (("segments", "auto"),))]
    res = tune(TRACES / "gpt2_train.csv.gz", "3GiB", card_kind="sim", gpumem_configs=grid,
               torch_confs=[], jobs=1, find_min_capacity=False)
    limits = {r["label"]: r["limit"] for r in res.rows}
    assert limits["default, auto"].startswith("the card: pool <= 3.00 GiB")
    assert limits["constrained, auto"].startswith("gpu_memory_fraction=0.7: pool <= 2.10 GiB")
