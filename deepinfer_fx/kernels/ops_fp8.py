"""Ops over expert weights kept as the checkpoint stores them, so released checkpoints run
without dequantising them on load (``load_model(..., expert_format="fp8" | "fp4")``).

``deepinfer::moe_experts_fp8`` is ``deepinfer::moe_experts`` with each stacked expert weight
given as float8_e4m3fn ``[E, out, in]`` plus fp32 scales ``[E, cdiv(out, block), cdiv(in,
block)]``: the dequantised weight is ``w.float() * scale`` expanded over each ``block x block``
square, rounded to the activation dtype. The reference does exactly that and then runs the
bf16 math of ``graphs/moe.py``; the Triton kernel dequantises each tile as it loads it.

``deepinfer::moe_experts_fp4`` takes MXFP4 experts: uint8 ``[E, out, in / 2]`` (two e2m1 codes
a byte, the even k in the low nibble) with ue8m0 byte scales ``[E, out, in / 32]``; the
reference is ``io.quant.dequant_mxfp4`` then the same math.

No ``from __future__ import annotations``: ``custom_op`` infers the schema from the annotations.
"""

from typing import Optional

import torch

from ..graphs.moe import routed_experts
from ..io.quant import dequant_fp8_block, dequant_mxfp4
from .ops import NAMESPACE

# The fp8 expert kernels' k tile is the largest power of two dividing the scale block; tl.dot takes >= 16.
MIN_K_TILE = 16


def fp8_block_unserved(block: int) -> Optional[str]:
    """Why the fp8 expert kernels cannot serve scale blocks of ``block``, or None (DeepSeek's
    released blocks, 128 and 32, are served)."""
    if (block & -block) >= MIN_K_TILE:
        return None
    return (
        f"fp8 scale block {block}: the expert kernels need a multiple of {MIN_K_TILE} (their k tile lies in one block)"
    )


@torch.library.custom_op(f"{NAMESPACE}::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
    block: int,
) -> torch.Tensor:
    """``moe_experts`` with fp8 block-scaled expert weights (see the module docstring)."""
    experts = {
        "w1": dequant_fp8_block(w1, w1_scale, block, x.dtype),
        "w3": dequant_fp8_block(w3, w3_scale, block, x.dtype),
        "w2": dequant_fp8_block(w2, w2_scale, block, x.dtype),
    }
    return getattr(routed_experts, "reference", routed_experts)(experts, limit, x, idx, weight)


def _experts_fake(x: torch.Tensor, *weights_and_routing: object) -> torch.Tensor:
    """Both ops' fake: fp32 rows of x's shape."""
    return x.new_empty(x.shape, dtype=torch.float32)


moe_experts_fp8.register_fake(_experts_fake)


@torch.library.custom_op(f"{NAMESPACE}::moe_experts_fp4", mutates_args=())
def moe_experts_fp4(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``moe_experts`` with MXFP4 expert weights (see the module docstring)."""
    experts = {
        "w1": dequant_mxfp4(w1, w1_scale, x.dtype),
        "w3": dequant_mxfp4(w3, w3_scale, x.dtype),
        "w2": dequant_mxfp4(w2, w2_scale, x.dtype),
    }
    return getattr(routed_experts, "reference", routed_experts)(experts, limit, x, idx, weight)


moe_experts_fp4.register_fake(_experts_fake)
