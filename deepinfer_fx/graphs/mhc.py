"""Manifold-constrained hyper-connections: the residual is ``hc_mult`` streams per token.

Each site (before attention, before the FFN) derives from the streams a collapse vector
``pre``, an expand vector ``post`` and a doubly-stochastic mixing matrix ``comb`` (Sinkhorn).
All of it runs in fp32.
"""

from __future__ import annotations

import torch

from .norm import project
from .pointwise import sigmoid, softmax
from .reduce import mean_over, sum_over
from .swap import swappable


def _mixes(X: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``rms_norm(flat X) @ fn.T``, computed as ``(flat X @ fn.T) * r`` with ``r`` each row's
    reciprocal RMS: the same in exact arithmetic, and the normalised ``[T, N*D]`` fp32 copy is
    never written (at a 4096-token P8 prefill, ~0.5 GB per site by the shapes)."""
    flat = X.flatten(-2).float()
    r = torch.rsqrt(mean_over(flat.square(), -1, keepdim=True) + rms_eps)
    return project(flat, fn, True) * r  # the place batch invariance swaps (the same GEMM otherwise)


def mhc_coeffs(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X ``[T, N, D]`` -> pre ``[T, N]``, post ``[T, N]``, comb ``[T, N, N]`` (all fp32)."""
    n = X.shape[-2]
    m = _mixes(X, fn, rms_eps)
    m_pre, m_post, m_comb = m.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.float().split([n, n, n * n])
    s = scale.float()
    pre = sigmoid(m_pre * s[0] + b_pre) + hc_eps
    post = 2 * sigmoid(m_post * s[1] + b_post)
    return pre, post, sinkhorn((m_comb * s[2] + b_comb).unflatten(-1, (n, n)), hc_eps, iters)


@swappable
def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """``[..., n, n]`` logits -> a doubly-stochastic mixing matrix: softmax over rows plus eps,
    a column normalisation, then ``iters - 1`` rounds of row and column normalisation (fp32)."""
    comb = softmax(logits.float(), -1) + eps
    comb = comb / (sum_over(comb, -2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (sum_over(comb, -1, keepdim=True) + eps)
        comb = comb / (sum_over(comb, -2, keepdim=True) + eps)
    return comb


def first_stream(X: torch.Tensor) -> torch.Tensor:
    """The ``pre`` that collapses stream 0 of X ``[..., N, D]`` alone (V4.1's first site):
    ``[..., N]`` fp32, one then zeros. Padded rather than assigned: a compiled step would copy
    an assigned constant from the host at every call, which CUDA-graph capture refuses."""
    return torch.nn.functional.pad(X.new_ones(*X.shape[:-2], 1, dtype=torch.float32), (0, X.shape[-2] - 1))


def mhc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j X_j``: the sublayer input ``[T, D]``."""
    return sum_over(pre.unsqueeze(-1) * X.float(), -2).to(X.dtype)


@swappable
def mhc_site(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    iters: int,
    pre_in: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One site up to the sublayer input: ``mhc_coeffs`` and the collapse of ``X`` with
    ``pre_in`` (``[T, N]`` fp32; V4.1 passes the previous site's ``pre``) or, without it, with
    the site's own ``pre``. Returns pre, post, comb and the collapsed ``u`` ``[T, D]`` in X's dtype.
    One place for the whole site, so a kernel can fuse the GEMV, the coefficients and the
    collapse (``passes/swaps.py``)."""
    pre, post, comb = mhc_coeffs(X, fn, base, scale, rms_eps, hc_eps, iters)
    return pre, post, comb, mhc_collapse(X, pre if pre_in is None else pre_in)


@swappable
def mhc_expand(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_k = post_k y + sum_j comb[j, k] X_j`` (the sum runs over comb's first index). The
    mix is ``comb^T @ X`` in X's dtype (comb rounded to it, fp32 accumulation, one rounding),
    written as N broadcast terms: a compiled step fuses them with the rest into one kernel,
    where a batched matmul of [N, N] x [N, D] per token was a cuBLAS call of its own (~16 us
    at a 64-request P8 decode, 32 a step). A place (``mhc.mhc_expand``) for the runs that
    are not fused by a compiler: batch-invariant inference's one-launch kernel on CUDA."""
    dt = X.dtype
    c, Xf = comb.to(dt).float(), X.float()
    mixed = sum(c[..., j, :, None] * Xf[..., j, None, :] for j in range(X.shape[-2]))
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + mixed.to(dt)


@swappable
def hc_head(
    X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float, hc_eps: float
) -> torch.Tensor:
    """Final learned collapse of the streams before the output norm: X ``[T, N, D]``, fn
    ``[N, N*D]``, base ``[N]``, scale ``[1]`` -> ``[T, D]`` in X's dtype. A swap place, so a kernel
    can run the mixing GEMV, ``pre`` and the collapse as ``mhc_site`` does (``passes/swaps.py``)."""
    pre = sigmoid(_mixes(X, fn, rms_eps) * scale.float() + base.float()) + hc_eps
    return mhc_collapse(X, pre)
