"""RMSNorm flavours and the plain linear map the model functions share."""

from __future__ import annotations

import torch

from ..io.quant import dequant_fp8_block, fp8_block_of
from .reduce import mean_over
from .swap import swappable


@swappable
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``w * x / rms(x)`` over the last dim, computed in fp32 and cast back to x's dtype.
    Without a weight it is the unweighted scale used for the per-head q norm and mHC. A place
    (``norm.rms_norm``) where batch-invariant inference puts its one-launch kernel on CUDA; the
    compiled pipeline fuses it by pattern instead (``passes/fusion.py``)."""
    xf = x.float()
    y = xf * torch.rsqrt(mean_over(xf.square(), -1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


@swappable
def project(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """``x @ w.T`` for a weight stored [out, in], as in the checkpoints: in x's dtype (``w`` cast
    to it), or accumulated and returned in fp32. Every dense projection of the model goes through
    here, so this one place (``norm.project``) is where a GEMM kernel for decode-sized calls
    stands in (``passes/swaps.py``).

    fp32 results: with bf16 operands on CUDA the tensor cores multiply them directly into an
    fp32 result (``mm`` with ``out_dtype``) instead of casting a weight copy to fp32 every step
    (2 GiB per step for the head); the products are exact either way, only the accumulation
    order differs. Elsewhere (CPU, fp32 operands) the operands are cast up."""
    if not out_fp32:
        return x @ w.to(x.dtype).T
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16:
        flat = x.reshape(-1, x.shape[-1])
        return torch.mm(flat, w.T, out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
    return x.float() @ w.float().T


def dequant_dense(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A dense weight as the model multiplies it: ``w`` itself, or (``scale`` given: block FP8
    held as stored, ``load_model(dense_format="fp8")``) ``w.float() * scale`` over each block,
    rounded to ``dtype``, the value the loader would have dequantised it to."""
    if scale is None:
        return w
    return dequant_fp8_block(w, scale, fp8_block_of(w.shape, scale.shape), dtype)


@swappable
def project_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """``project`` for a block-FP8 weight held as stored (float8_e4m3fn ``[out, in]`` and fp32
    block scales): dequantised to x's dtype, then the same product, so a model held in fp8 gives
    the bits of the one dequantised on load. A place of its own, where a kernel that reads the
    fp8 weight as stored can stand in."""
    return project(x, dequant_dense(w, scale, x.dtype), out_fp32)


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` in x's dtype; ``scale``: w's block scales where it is held in block FP8."""
    return project(x, w, False) if scale is None else project_fp8(x, w, scale, False)


def linear_fp32(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` accumulated and returned in fp32: the router, compressor and indexer-weight
    projections and the LM head; ``scale`` as in ``linear``."""
    return project(x, w, True) if scale is None else project_fp8(x, w, scale, True)


def held(p: dict, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight and its block scales (None unless held in block FP8)."""
    return p[name], p.get(f"{name}_scale")


@swappable
def project_blocks(x: torch.Tensor, w: torch.Tensor, blocks: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., G*K]`` times a block-diagonal weight, in x's dtype: its ``G`` blocks are the
    row blocks of ``w`` ``[G*R, K]``, so output block g ``[..., R]`` is input block g times
    ``w[g*R:(g+1)*R].T``. The grouped output projection ``wo_a`` (each group of heads has its
    own low-rank map); one place (``norm.project_blocks``) where a decode GEMV stands in for
    the batched matmul (``passes/swaps.py``). ``scale``: w's block scales where it is held in
    block FP8 (dequantised to x's dtype first, as ``project_fp8`` does)."""
    xb = x.unflatten(-1, (blocks, -1))
    wb = dequant_dense(w, scale, x.dtype).to(x.dtype).unflatten(0, (blocks, -1))
    return torch.einsum("...gi,gri->...gr", xb, wb).flatten(-2)
