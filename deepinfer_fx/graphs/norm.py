"""RMSNorm flavours and the plain linear map the model functions share."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``w * x / rms(x)`` over the last dim, computed in fp32 and cast back to x's dtype.
    Without a weight it is the unweighted scale used for the per-head q norm and mHC."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in x's dtype (weights are stored [out, in], as in the checkpoints)."""
    return x @ w.to(x.dtype).T


def linear_out_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` accumulated and returned in fp32 without an fp32 copy of a bf16 weight (the LM
    head: 2 GiB of fp32 copy per step otherwise): CUDA's ``mm`` takes bf16 operands with an fp32
    result; elsewhere the operands are cast up. ``x`` holds bf16 values either way, so the
    products are the same; only the accumulation order may differ."""
    if x.is_cuda and w.dtype == torch.bfloat16:
        flat = x.reshape(-1, x.shape[-1]).to(w.dtype)
        return torch.mm(flat, w.T, out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
    return x.float() @ w.float().T


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same map in fp32: router, compressor and indexer-weight projections are computed in fp32."""
    return x.float() @ w.float().T
