"""The official reference's fake-quant points (QAT semantics), behind ``ModelConfig.fake_quant``.

- window kv and main compressed entries: fp8 (e4m3, ue8m0 scales) on the non-rotary channels,
  blocks of 64; the rotary tail stays in the activation dtype;
- indexer keys and queries: Hadamard rotation, then fp4 (e2m1, ue8m0 scales) in blocks of 32.
"""

from __future__ import annotations

import torch

from ..io.quant import fq4_ue8m0, fq8, hadamard

KV_FP8_BLOCK = 64
INDEX_FP4_BLOCK = 32


def kv_fake_quant(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    nope = x.shape[-1] - rope_dim
    return torch.cat([fq8(x[..., :nope], KV_FP8_BLOCK), x[..., nope:]], dim=-1)


def index_fake_quant(x: torch.Tensor) -> torch.Tensor:
    return fq4_ue8m0(hadamard(x), INDEX_FP4_BLOCK)
