"""The official reference's fake-quant points (QAT semantics), behind ``ModelConfig.fake_quant``.

V4:
- window kv and main compressed entries: fp8 (e4m3, ue8m0 scales) on the non-rotary channels,
  blocks of 64; the rotary tail stays in the activation dtype;
- indexer keys and queries: Hadamard rotation, then fp4 (e2m1, ue8m0 scales) in blocks of 32.
V4.1:
- window kv: fp8 over all channels, blocks of 32;
- compressed entries: fp4 with e4m3 scales per 16 (NVFP4-like);
- index keys and queries: fp4 with ue8m0 scales per 32, no Hadamard.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..io.quant import fq4_e4m3, fq4_ue8m0, fq8, hadamard

V4_KV_FP8_BLOCK = 64
V41_KV_FP8_BLOCK = 32
INDEX_FP4_BLOCK = 32
V41_ENTRY_FP4_BLOCK = 16


def window_kv(c: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    if not c.fake_quant:
        return x
    if c.is_v41:
        return fq8(x, V41_KV_FP8_BLOCK)
    nope = x.shape[-1] - c.rope_dim
    return torch.cat([fq8(x[..., :nope], V4_KV_FP8_BLOCK), x[..., nope:]], dim=-1)


def compressed_entry(c: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    if not c.fake_quant:
        return x
    if c.is_v41:
        return fq4_e4m3(x, V41_ENTRY_FP4_BLOCK)
    return window_kv(c, x)


def index_vector(c: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Index keys and queries."""
    if not c.fake_quant:
        return x
    return fq4_ue8m0(x if c.is_v41 else hadamard(x), INDEX_FP4_BLOCK)
