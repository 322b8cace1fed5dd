"""The official reference's fake-quant points (QAT semantics), behind ``ModelConfig.fake_quant``.

V4:
- window kv and main compressed entries: fp8 (e4m3, ue8m0 scales) on the non-rotary channels,
  blocks of 64; the rotary tail stays in the activation dtype;
- indexer keys and queries: Hadamard rotation, then fp4 (e2m1, ue8m0 scales) in blocks of 32.
V4.1:
- window kv: fp8 over all channels, blocks of 32;
- compressed entries: fp4 with e4m3 scales per 16 (NVFP4-like);
- index keys and queries: fp4 with ue8m0 scales per 32, no Hadamard.

A state in the trained format (``init_state(..., kv_format="trained")``) holds what these
points produce as codes and scales (``io/state_rows.py``): with ``packed=True`` a point returns
its result's bytes, and ``read`` gives a state tensor's values whichever way it holds them.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..io.quant import fq4_e4m3, fq4_ue8m0, fq8, hadamard
from ..io.state_rows import RowCodec

V4_KV_FP8_BLOCK = 64
V41_KV_FP8_BLOCK = 32
INDEX_FP4_BLOCK = 32
V41_ENTRY_FP4_BLOCK = 16


KINDS = ("window", "entry", "index")


def codec(c: ModelConfig, kind: str) -> RowCodec:
    """How a trained-format state holds rows of ``kind``: window kv, compressed entries or index keys."""
    if kind == "index":
        return RowCodec("mxfp4", c.index_head_dim, INDEX_FP4_BLOCK)
    if kind not in KINDS:
        raise ValueError(f"unknown state row kind {kind!r}; known: {KINDS}")
    if not c.is_v41:  # V4's windows and entries alike: fp8 on the non-rotary channels
        return RowCodec("fp8", c.head_dim, V4_KV_FP8_BLOCK, tail=c.rope_dim)
    if kind == "window":
        return RowCodec("fp8", c.head_dim, V41_KV_FP8_BLOCK)
    return RowCodec("nvfp4", c.head_dim, V41_ENTRY_FP4_BLOCK)


def check_trained(c: ModelConfig) -> None:
    """Refuse a trained-format state for a model that does not fake-quantise (its values would
    change) or whose widths do not tile the blocks."""
    if not c.fake_quant:
        raise ValueError(
            "kv_format='trained' stores the values the fake-quant points produce, but this model runs with "
            "fake_quant off; turn fake_quant on or use kv_format='model'"
        )
    for kind in KINDS:
        try:
            codec(c, kind)
        except ValueError as e:
            raise ValueError(f"kv_format='trained' cannot hold this model's {kind} rows: {e}") from None


def is_packed(t: torch.Tensor) -> bool:
    """Whether a state tensor holds trained-format rows (bytes) rather than values."""
    return t.dtype == torch.uint8


def read(c: ModelConfig, kind: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``[..., dim]`` in ``dtype`` that state rows ``t`` of ``kind`` hold."""
    return codec(c, kind).unpack(t, dtype) if is_packed(t) else t.to(dtype)


def _packed(c: ModelConfig, kind: str, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if not c.fake_quant:
        check_trained(c)
    return codec(c, kind).pack(x, dtype)


# ``packed`` (below): the bytes a trained-format state holds for x's fake-quantised values, with
# ``dtype`` the state's value dtype (None: x's), which the rows' unquantised tail is rounded to.


def window_kv(c: ModelConfig, x: torch.Tensor, packed: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``packed``: x may be fake-quantised already (fq8 maps its own results to themselves)."""
    if packed:
        return _packed(c, "window", x, dtype)
    if not c.fake_quant:
        return x
    if c.is_v41:
        return fq8(x, V41_KV_FP8_BLOCK)
    nope = x.shape[-1] - c.rope_dim
    return torch.cat([fq8(x[..., :nope], V4_KV_FP8_BLOCK), x[..., nope:]], dim=-1)


def compressed_entry(
    c: ModelConfig, x: torch.Tensor, packed: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``packed``: x before its fake-quant (V4.1's fp4 with e4m3 scales does not map every result
    to itself)."""
    if packed:
        return _packed(c, "entry", x, dtype)
    if not c.fake_quant:
        return x
    if c.is_v41:
        return fq4_e4m3(x, V41_ENTRY_FP4_BLOCK)
    return window_kv(c, x)


def index_vector(
    c: ModelConfig, x: torch.Tensor, packed: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Index keys and queries; ``packed``: an index key's bytes (no tail: any dtype)."""
    if packed:
        return _packed(c, "index", x if c.is_v41 else hadamard(x), dtype)
    if not c.fake_quant:
        return x
    return fq4_ue8m0(x if c.is_v41 else hadamard(x), INDEX_FP4_BLOCK)
