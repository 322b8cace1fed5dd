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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..graphs.moe import routed_experts
from ..io.quant import dequant_fp8_block, dequant_mxfp4
from .ops import EXPERTS, experts_op

# The fp8 expert kernels' k tile is the largest power of two dividing the scale block; tl.dot takes >= 16.
MIN_K_TILE = 16


def fp8_block_unserved(block: int) -> str | None:
    """Why the fp8 expert kernels cannot serve scale blocks of ``block``, or None (DeepSeek's
    released blocks, 128 and 32, are served)."""
    if (block & -block) >= MIN_K_TILE:
        return None
    return (
        f"fp8 scale block {block}: the expert kernels need a multiple of {MIN_K_TILE} (their k tile lies in one block)"
    )


def _held(dequant: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The math of the experts held as stored: each weight dequantised (``dequant(w, scale, *block,
    dtype)``), then the bf16 math of ``graphs/moe.py``."""

    def math(
        x: torch.Tensor, w: dict, idx: torch.Tensor, weight: torch.Tensor, limit: float, *block: int
    ) -> torch.Tensor:
        experts = {n: dequant(w[n], w[f"{n}_scale"], *block, x.dtype) for n in EXPERTS}
        return getattr(routed_experts, "reference", routed_experts)(experts, limit, x, idx, weight)

    return math


SCALED = tuple(name for n in EXPERTS for name in (n, f"{n}_scale"))  # w1, w1_scale, w3, w3_scale, w2, w2_scale
moe_experts_fp8 = experts_op("moe_experts_fp8", SCALED, _held(dequant_fp8_block), ("block", int))
moe_experts_fp4 = experts_op("moe_experts_fp4", SCALED, _held(dequant_mxfp4))
