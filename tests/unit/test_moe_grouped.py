"""``graphs/moe.py``'s fp32 grouped GEMMs: the per-expert loop eager GPU steps take (the
gathered per-row matrices of a model-sized batch do not fit on a GPU) equals the gathered form
the CPU and compiled steps use."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.graphs.moe import routed_experts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the per-expert loop is the eager GPU path")
def test_eager_gpu_fp32_loop_equals_gathered_form() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    e, d, i, t, k = 6, 64, 32, 13, 3
    p = {
        "w1": torch.randn(e, i, d, generator=g) / 8,
        "w3": torch.randn(e, i, d, generator=g) / 8,
        "w2": torch.randn(e, d, i, generator=g) / 6,
    }
    x = torch.randn(t, d, generator=g)
    idx = torch.randint(0, e - 2, (t, k), generator=g)  # the last two experts get no rows
    w = torch.rand(t, k, generator=g)
    want = routed_experts.reference(p, 7.0, x, idx, w)
    got = routed_experts.reference({n: v.cuda() for n, v in p.items()}, 7.0, x.cuda(), idx.cuda(), w.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
