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


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same map in fp32: router, compressor and indexer-weight projections are computed in fp32."""
    return x.float() @ w.float().T
