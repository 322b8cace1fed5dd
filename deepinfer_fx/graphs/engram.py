"""Engram n-gram memory (spec §7.7): table lookup and the gated residual update of the streams.

The hash ids come from ``engram_hash``; this module turns them into rows and applies
``X_k += γ_k · value`` before the layer's attention mHC site.

The released tables are ~98 GB each (384M rows × 256 fp8 + 8 ue8m0 bytes), far beyond what a
reference path may load, so a checkpoint-backed table memory-maps both planes straight from the
safetensors shard and a lookup touches only the pages of the rows it gathers.  Random tiny models
use a dense in-memory table behind the same ``lookup``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from deepinfer_fx.io.checkpoint import CheckpointError, CheckpointReader, RawTensor
from deepinfer_fx.io.quant import ue8m0_to_float
from deepinfer_fx.graphs.norm import linear
from deepinfer_fx.graphs.pointwise import sigmoid

__all__ = ["EngramTable", "engram_apply"]

# One ue8m0 scale per this many consecutive channels of a quantised row (spec §9).
SCALE_BLOCK = 32
# Stored dtypes a table may have without scales: numpy dtype of the same bytes, torch dtype they
# are reinterpreted as (numpy has no bfloat16, so BF16 travels as uint16 and is viewed after).
_PLAIN: dict[str, tuple[np.dtype[Any], torch.dtype]] = {
    "BF16": (np.dtype("<u2"), torch.bfloat16),
    "F16": (np.dtype("<f2"), torch.float16),
    "F32": (np.dtype("<f4"), torch.float32),
}
_SCALE_DTYPES = ("F8_E8M0", "U8")  # ue8m0 bytes; some writers tag them as plain uint8


def _memmap(raw: RawTensor, dtype: np.dtype[Any]) -> np.memmap:
    # Read-only: the checkpoint must never be written through, and "r" lets the OS share pages.
    return np.memmap(raw.path, dtype=dtype, mode="r", offset=raw.offset, shape=raw.shape)


class EngramTable:
    """An Engram embedding table; ``lookup`` returns float32 rows on the ids' device.

    Build with ``from_tensor`` (dense) or ``from_checkpoint`` (memory-mapped, fp8 + ue8m0 or
    unquantised); do not call the constructor directly.
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        head_dim: int,
        *,
        dense: torch.Tensor | None = None,
        weight: np.memmap | None = None,
        scale: np.memmap | None = None,
        view_as: torch.dtype | None = None,
    ) -> None:
        self.name = name
        self._num_rows = num_rows
        self._head_dim = head_dim
        self._dense = dense
        self._weight = weight  # memmap of the stored row bytes (never materialised whole)
        self._scale = scale  # memmap of ue8m0 bytes [rows, head_dim / 32], fp8 tables only
        self._view_as = view_as  # torch dtype the gathered weight bytes are reinterpreted as

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_tensor(cls, rows: torch.Tensor, name: str = "engram table") -> "EngramTable":
        """Dense table over ``rows [num_rows, head_dim]`` (kept as given; lookups cast to fp32)."""
        if rows.dim() != 2:
            raise ValueError(f"{name}: rows must be 2-D [num_rows, head_dim], got shape {tuple(rows.shape)}")
        return cls(name, rows.shape[0], rows.shape[1], dense=rows)

    @classmethod
    def from_checkpoint(cls, reader: CheckpointReader, weight_key: str, scale_key: str | None = None) -> "EngramTable":
        """Memory-map ``weight_key`` (F8_E4M3 with ue8m0 ``scale_key`` [rows, head_dim/32], or an
        unquantised BF16/F16/F32 table with ``scale_key=None`` or an empty ``[rows, 0]`` scale)
        from its safetensors shard."""
        w = reader.raw(weight_key)
        name = f"{weight_key} ({w.path.name})"
        if len(w.shape) != 2:
            raise CheckpointError(f"{name}: Engram table must be 2-D [rows, head_dim], got {list(w.shape)}")
        rows, head_dim = w.shape
        if w.dtype == "F8_E4M3":
            if scale_key is None:
                raise CheckpointError(f"{name}: an F8_E4M3 table needs its ue8m0 scale key")
            s = reader.raw(scale_key)
            want = [rows, head_dim // SCALE_BLOCK]
            if s.dtype not in _SCALE_DTYPES or list(s.shape) != want or head_dim % SCALE_BLOCK:
                raise CheckpointError(
                    f"{name}: scale '{scale_key}' is {s.dtype} {list(s.shape)}; expected F8_E8M0 {want} "
                    f"(one ue8m0 per {SCALE_BLOCK} channels)"
                )
            return cls(
                name,
                rows,
                head_dim,
                weight=_memmap(w, np.dtype(np.uint8)),
                scale=_memmap(s, np.dtype(np.uint8)),
                view_as=torch.float8_e4m3fn,
            )
        if w.dtype in _PLAIN:
            # HF transformers' save_pretrained writes an empty [rows, 0] scale beside an
            # unquantised table: a placeholder with no values, so nothing to apply.
            s = None if scale_key is None else reader.raw(scale_key)
            if s is not None and list(s.shape) != [rows, 0]:
                raise CheckpointError(
                    f"{name}: {w.dtype} table is unquantised but scale '{scale_key}' "
                    f"({s.dtype} {list(s.shape)}) was given"
                )
            np_dtype, torch_dtype = _PLAIN[w.dtype]
            return cls(name, rows, head_dim, weight=_memmap(w, np_dtype), view_as=torch_dtype)
        raise CheckpointError(
            f"{name}: unsupported Engram table dtype {w.dtype} (F8_E4M3 + F8_E8M0 scale, BF16, F16 or F32)"
        )

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def is_dense(self) -> bool:
        return self._dense is not None

    def resident(self, device: torch.device | str) -> "EngramTable":
        """The whole table dequantised to float32 on ``device`` (what a compiled step reads)."""
        rows = self.lookup(torch.arange(self._num_rows))
        return EngramTable.from_tensor(rows.to(device), name=self.name)

    def __repr__(self) -> str:
        kind = "dense" if self._dense is not None else f"memmap {self._view_as}"
        return f"EngramTable({self.name!r}, rows={self._num_rows}, head_dim={self._head_dim}, {kind})"

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids [...]`` (int) -> float32 ``[..., head_dim]`` on ``ids.device``."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{self.name}: ids must be an integer tensor, got {ids.dtype}")
        out_shape = (*ids.shape, self._head_dim)
        if ids.numel() == 0:
            return torch.zeros(out_shape, dtype=torch.float32, device=ids.device)
        if self._dense is not None and torch.compiler.is_compiling():
            # compiled steps: ids come from engram_hash (mod prime + offset), in range by construction
            return self._dense[ids.to(self._dense.device)].to(torch.float32).to(ids.device)
        # Eager: a host sync for the range check is acceptable.  Negative ids would otherwise
        # wrap silently in both torch and numpy indexing.
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self._num_rows:
            raise ValueError(f"{self.name}: row ids must lie in [0, {self._num_rows}); got min {lo}, max {hi}")
        if self._dense is not None:
            rows = self._dense[ids.to(self._dense.device)].to(torch.float32)
            return rows.to(ids.device)
        assert self._weight is not None and self._view_as is not None
        flat = ids.detach().reshape(-1).cpu().numpy()
        # Fancy indexing on a memmap copies just the gathered rows into a fresh ndarray.
        w = torch.from_numpy(self._weight[flat]).view(self._view_as).to(torch.float32)
        if self._scale is not None:
            s = ue8m0_to_float(torch.from_numpy(self._scale[flat]))  # [M, head_dim / 32], exact 2^(b-127)
            w = (w.view(flat.size, -1, SCALE_BLOCK) * s.unsqueeze(-1)).view(flat.size, self._head_dim)
        return w.view(out_shape).to(ids.device)


def engram_apply(
    p: dict[str, Any], X: torch.Tensor, hash_ids: torch.Tensor, eps: float, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Gated Engram residual on the mHC streams ``X [N, hc, D]`` (spec §7.7).

    ``p``: ``embed`` (EngramTable), ``wkv [(hc+1)*D, n_cols*head_dim]``, ``q_weight``/``k_weight``
    ``[hc, D]``.  ``hash_ids [N, n_cols]`` are global row ids into the table.  ``token_mask [N]``
    (bool, optional): False forces the gate to 0 so those rows of X come back unchanged (image
    tokens are dead for Engram).  Gate math is fp32; the result is in X's dtype.
    """
    if X.dim() != 3:
        raise ValueError(f"engram: X must be [N, hc, D], got shape {tuple(X.shape)}")
    n, hc, d = X.shape
    table: EngramTable = p["embed"]
    wkv: torch.Tensor = p["wkv"]
    if hash_ids.dim() != 2 or hash_ids.shape[0] != n:
        raise ValueError(f"engram: hash_ids must be [N={n}, n_cols], got shape {tuple(hash_ids.shape)}")
    n_cols = hash_ids.shape[1]
    want = ((hc + 1) * d, n_cols * table.head_dim)
    if tuple(wkv.shape) != want:
        raise ValueError(
            f"engram: wkv is {tuple(wkv.shape)}; expected {want} for hc={hc}, D={d}, "
            f"{n_cols} columns of head_dim {table.head_dim}"
        )
    for k in ("q_weight", "k_weight"):
        if tuple(p[k].shape) != (hc, d):
            raise ValueError(f"engram: {k} is {tuple(p[k].shape)}; expected {(hc, d)}")

    rows = table.lookup(hash_ids).to(X.device).reshape(n, n_cols * table.head_dim)
    kv = linear(rows.to(X.dtype), wkv)  # the projection runs in the activations' dtype, like any linear
    key = kv[:, : hc * d].view(n, hc, d).float()
    value = kv[:, hc * d :].float()  # one value shared by all streams

    xf = X.float()
    # q_weight and k_weight only ever appear as a product (the two RMSNorm weights fold together).
    weight = p["q_weight"].float() * p["k_weight"].float()
    r = torch.rsqrt(xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [N, hc]
    dot = (xf * weight * key).sum(-1) * r / math.sqrt(d)
    # Signed square root compresses large logits; the floor keeps the sqrt's gradient finite at 0.
    gate = sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    out = xf + gate.unsqueeze(-1) * value.unsqueeze(1)
    if token_mask is not None:
        if token_mask.shape != (n,) or token_mask.dtype != torch.bool:
            raise ValueError(
                f"engram: token_mask must be bool [N={n}], got {token_mask.dtype} {tuple(token_mask.shape)}"
            )
        # where, not gate * mask: 0 · (inf or nan value) would still leak into masked rows.
        out = torch.where(token_mask.to(X.device).view(n, 1, 1), out, xf)
    return out.to(X.dtype)
