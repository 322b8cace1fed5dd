"""deepinfer_fx.graphs.mhc (manifold-constrained hyper-connections) against explicit
float64 references: mhc_coeffs (pre / post gates and the Sinkhorn-normalised comb matrix,
spec §2.4), mhc_expand and mhc_collapse written out as loops, and the hc_head collapse.
float32 throughout, fresh seeds (printed in messages)."""

from __future__ import annotations

import math

import torch

from deepinfer_fx.graphs.mhc import hc_head, mhc_coeffs, mhc_collapse, mhc_expand
from primitives_helpers import close, gen


# --------------------------------------------------------------------------- mHC


def _mhc_inputs(g, t=5, n=4, d=16):
    X = torch.randn(t, n, d, generator=g)
    # Mixing logits of order 1 (std <~ 1.5). Much larger ones make the 4x4 Sinkhorn converge
    # slower than 20 iterations allow for 1e-3 (an algorithm property, not an engine bug).
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.5 / math.sqrt(n * d)
    base = torch.randn((2 + n) * n, generator=g) * 0.25
    scale = 0.5 + 1.5 * torch.rand(3, generator=g)
    return X, fn, base, scale


def test_mhc_coeffs(seed):
    g = gen(seed)
    n = 4
    X, fn, base, scale = _mhc_inputs(g, n=n)
    eps, hc_eps = 1e-6, 1e-6
    pre, post, comb = mhc_coeffs(X, fn, base, scale, eps, hc_eps, 20)
    t = X.shape[0]
    assert pre.shape == (t, n) and post.shape == (t, n) and comb.shape == (t, n, n)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert (pre > 0).all(), f"seed={seed}"
    assert ((post > 0) & (post < 2)).all(), f"seed={seed}"
    assert (comb > 0).all(), f"seed={seed}"
    close(comb.sum(-1), torch.ones(t, n), f"seed={seed}: comb row sums", atol=1e-3, rtol=0)
    close(comb.sum(-2), torch.ones(t, n), f"seed={seed}: comb column sums", atol=1e-3, rtol=0)

    # explicit reference (spec §2.4), per token, float64
    Xd, fnd, bd, sd = X.double(), fn.double(), base.double(), scale.double()
    for i in range(t):
        flat = Xd[i].flatten()
        r = 1 / torch.sqrt(flat.square().mean() + eps)
        m = (fnd @ flat) * r
        m_pre, m_post, m_comb = m[:n], m[n : 2 * n], m[2 * n :]
        close(pre[i], torch.sigmoid(m_pre * sd[0] + bd[:n]) + hc_eps, f"seed={seed}: pre[{i}]", atol=1e-5)
        close(post[i], 2 * torch.sigmoid(m_post * sd[1] + bd[n : 2 * n]), f"seed={seed}: post[{i}]", atol=1e-5)
        C = torch.softmax((m_comb * sd[2] + bd[2 * n :]).reshape(n, n), dim=-1) + hc_eps
        C = C / (C.sum(0, keepdim=True) + hc_eps)
        for _ in range(19):
            C = C / (C.sum(1, keepdim=True) + hc_eps)
            C = C / (C.sum(0, keepdim=True) + hc_eps)
        close(comb[i], C, f"seed={seed}: comb[{i}]", atol=1e-5)


def test_mhc_expand_and_collapse(seed):
    g = gen(seed)
    t, n, d = 3, 4, 8
    X = torch.randn(t, n, d, generator=g)
    y = torch.randn(t, d, generator=g)
    post = 2 * torch.rand(t, n, generator=g)
    comb = torch.rand(t, n, n, generator=g)  # deliberately not symmetric
    pre = torch.rand(t, n, generator=g)
    out = mhc_expand(X, y, post, comb)
    ref = torch.zeros(t, n, d, dtype=torch.float64)
    for i in range(t):
        for k in range(n):
            ref[i, k] = post[i, k].double() * y[i].double()
            for j in range(n):
                ref[i, k] += comb[i, j, k].double() * X[i, j].double()
    close(out, ref, f"seed={seed}: mhc_expand", atol=1e-5)
    col = mhc_collapse(X, pre)
    ref_c = torch.stack([sum(pre[i, j].double() * X[i, j].double() for j in range(n)) for i in range(t)])
    close(col, ref_c, f"seed={seed}: mhc_collapse", atol=1e-5)


def test_hc_head(seed):
    g = gen(seed)
    t, n, d = 4, 4, 8
    X = torch.randn(t, n, d, generator=g)
    fn = torch.randn(n, n * d, generator=g) / math.sqrt(n * d)
    base = torch.randn(n, generator=g)
    scale = torch.rand(1, generator=g) + 0.5
    out = hc_head(X, fn, base, scale, 1e-6, 1e-6)
    flat = X.double().flatten(1)
    m = (flat @ fn.double().T) / torch.sqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(m * scale.double() + base.double()) + 1e-6
    close(out, (pre[..., None] * X.double()).sum(1), f"seed={seed}: hc_head", atol=1e-5)
