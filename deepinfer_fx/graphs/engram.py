"""Engram n-gram memory (spec §7.7): table lookup and the gated residual update of the streams.

The hash ids come from ``engram_hash``; this module turns them into rows and applies
``X_k += γ_k · value`` before the layer's attention mHC site.

The released tables are ~98 GB each (384M rows × 256 fp8 + 8 ue8m0 bytes), far beyond what a
reference path may load, so a checkpoint-backed table memory-maps both planes straight from the
safetensors shard and a lookup touches only the pages of the rows it gathers.  Random tiny models
use a dense in-memory table behind the same ``lookup``. Compiled steps read tables held as
tensors (``gather_rows``), on the device or in host memory (``engine/engram_tables.py``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from deepinfer_fx.io.checkpoint import CheckpointError
from deepinfer_fx.io.checkpoint_reader import CheckpointReader, RawTensor
from deepinfer_fx.io.quant import ue8m0_to_float
from deepinfer_fx.graphs.norm import linear
from deepinfer_fx.graphs.pointwise import sigmoid
from deepinfer_fx.graphs.reduce import mean_over, sum_over
from deepinfer_fx.graphs.swap import swappable

__all__ = ["EngramTable", "dequant_rows", "engram_apply", "gather_rows"]

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


@swappable
def gather_rows(weight: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids [...]`` of a table held as tensors -> float32 ``[..., head_dim]`` on ``ids.device``:
    ``weight [rows, head_dim]`` float8_e4m3fn with ue8m0 ``scale [rows, head_dim / 32]``, or an
    unquantised table (``scale`` None). A table on another device than the ids (a host table)
    round-trips the ids, which only an eager step may do: compiled steps on a GPU swap in
    ``deepinfer::engram_rows`` (``engine/engram_tables.py``), which reads host rows on the device."""
    flat = ids.reshape(-1).to(weight.device)
    rows = dequant_rows(weight[flat], None if scale is None else scale[flat])
    return rows.view(*ids.shape, weight.shape[1]).to(ids.device)


def dequant_rows(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """Gathered rows ``w [M, head_dim]`` (and their ue8m0 bytes ``s [M, head_dim / 32]``) as float32."""
    w = w.to(torch.float32)
    if s is None:
        return w
    return (w.view(w.shape[0], -1, SCALE_BLOCK) * ue8m0_to_float(s).unsqueeze(-1)).view(w.shape)


class EngramTable:
    """An Engram embedding table; ``lookup`` returns float32 rows on the ids' device.

    Build with ``from_tensor`` (tensors, on any device; ``engine/engram_tables.py`` places a
    checkpoint's tables as tensors on the device or in host memory for compiled steps) or
    ``from_checkpoint`` (memory-mapped, fp8 + ue8m0 or unquantised: eager steps); do not call the
    constructor directly.
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        head_dim: int,
        *,
        dense: torch.Tensor | None = None,
        dense_scale: torch.Tensor | None = None,
        weight: np.memmap | None = None,
        scale: np.memmap | None = None,
        view_as: torch.dtype | None = None,
    ) -> None:
        self.name = name
        self._num_rows = num_rows
        self._head_dim = head_dim
        self._dense = dense
        self._dense_scale = dense_scale  # ue8m0 bytes beside an fp8 ``dense`` table
        self._weight = weight  # memmap of the stored row bytes (never materialised whole)
        self._scale = scale  # memmap of ue8m0 bytes [rows, head_dim / 32], fp8 tables only
        self._view_as = view_as  # torch dtype the gathered weight bytes are reinterpreted as

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_tensor(
        cls, rows: torch.Tensor, name: str = "engram table", scale: torch.Tensor | None = None
    ) -> "EngramTable":
        """Table over ``rows [num_rows, head_dim]`` (kept as given; lookups cast to fp32); with
        ``scale`` (uint8 ue8m0 ``[num_rows, head_dim / 32]``) the rows are float8_e4m3fn."""
        if rows.dim() != 2:
            raise ValueError(f"{name}: rows must be 2-D [num_rows, head_dim], got shape {tuple(rows.shape)}")
        if scale is not None and (
            rows.dtype != torch.float8_e4m3fn
            or scale.dtype != torch.uint8
            or tuple(scale.shape) != (rows.shape[0], rows.shape[1] // SCALE_BLOCK)
        ):
            raise ValueError(
                f"{name}: a scaled table is float8_e4m3fn rows with uint8 scales [rows, head_dim / {SCALE_BLOCK}]; "
                f"got {rows.dtype} {tuple(rows.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
        return cls(name, rows.shape[0], rows.shape[1], dense=rows, dense_scale=scale)

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

    @property
    def nbytes(self) -> int:
        """Bytes of the table as stored (rows and scales): what placing it costs."""
        if self._dense is not None:
            extra = 0 if self._dense_scale is None else self._dense_scale.numel()
            return self._dense.numel() * self._dense.element_size() + extra
        assert self._weight is not None
        return self._weight.nbytes + (0 if self._scale is None else self._scale.nbytes)

    @property
    def device(self) -> torch.device:
        """Where the rows are: ``cpu`` for memory-mapped and host tables."""
        return torch.device("cpu") if self._dense is None else self._dense.device

    def planes(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``lo:hi`` as stored: the weight (float8_e4m3fn, or the unquantised dtype) and its
        uint8 ue8m0 scales (None: unquantised), on the host for a memory-mapped table."""
        if self._dense is not None:
            return self._dense[lo:hi], None if self._dense_scale is None else self._dense_scale[lo:hi]
        assert self._weight is not None and self._view_as is not None
        w = torch.from_numpy(np.array(self._weight[lo:hi])).view(self._view_as)
        return w, None if self._scale is None else torch.from_numpy(np.array(self._scale[lo:hi]))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tensor table's weight and scales (``from_tensor``)."""
        if self._dense is None:
            raise ValueError(f"{self.name} is memory-mapped; place it first (engine/engram_tables.py)")
        return self._dense, self._dense_scale

    def __repr__(self) -> str:
        kind = f"{self._dense.dtype} on {self._dense.device}" if self._dense is not None else f"memmap {self._view_as}"
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
            return gather_rows(self._dense, self._dense_scale, ids)
        # Eager: a host sync for the range check is acceptable.  Negative ids would otherwise
        # wrap silently in both torch and numpy indexing.
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self._num_rows:
            raise ValueError(f"{self.name}: row ids must lie in [0, {self._num_rows}); got min {lo}, max {hi}")
        if self._dense is not None:
            return gather_rows(self._dense, self._dense_scale, ids)
        assert self._weight is not None and self._view_as is not None
        flat = ids.detach().reshape(-1).cpu().numpy()
        # Fancy indexing on a memmap copies just the gathered rows into a fresh ndarray.
        w = torch.from_numpy(self._weight[flat]).view(self._view_as)
        s = None if self._scale is None else torch.from_numpy(self._scale[flat])  # exact 2^(b-127)
        return dequant_rows(w, s).view(out_shape).to(ids.device)


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
    kv = linear(
        rows.to(X.dtype), wkv, p.get("wkv_scale")
    )  # the projection runs in the activations' dtype, like any linear
    key = kv[:, : hc * d].view(n, hc, d).float()
    value = kv[:, hc * d :].float()  # one value shared by all streams

    xf = X.float()
    # q_weight and k_weight only ever appear as a product (the two RMSNorm weights fold together).
    weight = p["q_weight"].float() * p["k_weight"].float()
    r = torch.rsqrt(mean_over(xf.square(), -1) + eps) * torch.rsqrt(mean_over(key.square(), -1) + eps)  # [N, hc]
    dot = sum_over(xf * weight * key, -1) * r / math.sqrt(d)
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
