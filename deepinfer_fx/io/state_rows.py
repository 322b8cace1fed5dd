"""State rows held in the format the model was trained to see (``DEEPINFER_KV_FORMAT=trained``).

The fake-quant points (``graphs/fake_quant.py``) round the window kv, the compressed entries and
the index keys to fp8 or fp4 before anything reads them. A state that keeps those values in the
activation dtype spends 2-4x the bytes they carry; a ``RowCodec`` keeps each row as the bytes of
its codes and scales instead (uint8 ``[..., nbytes]``), and ``unpack(pack(x))`` is the fake-quant
point's result for ``x``, bit for bit: both take their values and scales from the same
``io/quant.py`` helpers, and every value is a code times a scale, exact in float32 and in bf16.

A row's bytes, in order (padded to a multiple of 4, so the tail stays aligned):

- ``fp8`` (``fq8``: window kv, V4's compressed entries): the ``tail`` channels kept in the
  activation dtype (V4's rotary part; none in V4.1), then ``dim - tail`` e4m3 codes, then one
  ue8m0 scale per ``block`` of them. V4 at bf16: 128 + 448 + 7 -> 584 B; V4.1: 512 + 16 = 528 B.
- ``mxfp4`` (``fq4_ue8m0``: index keys): ``dim / 2`` bytes of e2m1 codes (low nibble = even
  channel), then one ue8m0 scale per ``block``. 128 dims: 64 + 4 = 68 B.
- ``nvfp4`` (``fq4_e4m3``: V4.1's compressed entries): the same codes, then one e4m3 scale per
  ``block``. 512 dims: 256 + 32 = 288 B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .quant import e2m1_pack, e2m1_unpack, fp4_e4m3_blocks, fp4_ue8m0_blocks, fp8_blocks, ue8m0_to_float

FORMATS = ("fp8", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class RowCodec:
    """How one state row of ``dim`` values is held as bytes (see the module docstring)."""

    fmt: str
    dim: int
    block: int
    tail: int = 0  # trailing channels kept in the activation dtype (fp8 only)

    def __post_init__(self) -> None:
        coded = self.dim - self.tail
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown row format {self.fmt!r}; known: {FORMATS}")
        if self.tail and self.fmt != "fp8":
            raise ValueError(f"only fp8 rows keep a tail in the activation dtype, not {self.fmt}")
        if coded <= 0 or coded % self.block or self.block % 2:
            raise ValueError(
                f"{self.fmt} rows of {self.dim} values ({self.tail} kept as is) do not tile into blocks of {self.block}"
            )

    @property
    def spec(self) -> str:
        """The row layout as a string ops take as an argument: ``fmt/block/tail`` (the width is the op's)."""
        return f"{self.fmt}/{self.block}/{self.tail}"

    @classmethod
    def from_spec(cls, spec: str, dim: int) -> "RowCodec":
        """``spec``'s inverse for rows of ``dim`` values."""
        try:
            fmt, block, tail = spec.split("/")
            return cls(fmt, dim, int(block), int(tail))
        except ValueError as e:
            raise ValueError(f"state row spec {spec!r} is not fmt/block/tail for rows of {dim} values: {e}") from None

    @property
    def coded(self) -> int:
        return self.dim - self.tail

    def _code_bytes(self) -> int:
        return self.coded if self.fmt == "fp8" else self.coded // 2

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one row, its tail in ``dtype``."""
        raw = self.tail * dtype.itemsize + self._code_bytes() + self.coded // self.block
        return -(-raw // 4) * 4

    def pack(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``x`` ``[..., dim]`` -> uint8 ``[..., nbytes(dtype)]``: codes and scales from x's values
        (fp32 compressor latents, say), the tail rounded to ``dtype`` (None: x's), the state's
        value dtype, as a model-format state would store it."""
        lead, n, dtype = x.shape[:-1], self.coded, dtype or x.dtype
        if self.fmt == "fp8":
            q, e = fp8_blocks(x[..., :n], self.block)
            codes, scales = q.reshape(*lead, n).view(torch.uint8), (e.squeeze(-1) + 127).to(torch.uint8)
        elif self.fmt == "mxfp4":
            q, e = fp4_ue8m0_blocks(x, self.block)
            codes, scales = e2m1_pack(q.reshape(*lead, n)), (e.squeeze(-1) + 127).to(torch.uint8)
        else:
            q, s = fp4_e4m3_blocks(x, self.block)
            codes, scales = e2m1_pack(q.reshape(*lead, n)), s.squeeze(-1).view(torch.uint8)
        parts = [codes, scales]
        if self.tail:
            parts.insert(0, _to_bytes(x[..., n:].to(dtype)))
        pad = self.nbytes(dtype) - sum(t.shape[-1] for t in parts)
        if pad:
            parts.append(torch.zeros(*lead, pad, dtype=torch.uint8, device=x.device))
        return torch.cat(parts, -1)

    def unpack(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """uint8 rows ``[..., nbytes(dtype)]`` -> their values ``[..., dim]`` in ``dtype``."""
        if t.dtype != torch.uint8 or t.shape[-1] != self.nbytes(dtype):
            raise ValueError(
                f"{self.fmt} rows of {self.dim} values in {dtype} are uint8 [..., {self.nbytes(dtype)}], "
                f"got {t.dtype} {list(t.shape)}"
            )
        tb, cb, n = self.tail * dtype.itemsize, self._code_bytes(), self.coded
        codes, scales = t[..., tb : tb + cb], t[..., tb + cb : tb + cb + n // self.block]
        if self.fmt == "fp8":
            q = codes.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            q = e2m1_unpack(codes)
        s = scales.view(torch.float8_e4m3fn).to(torch.float32) if self.fmt == "nvfp4" else ue8m0_to_float(scales)
        values = (q.unflatten(-1, (-1, self.block)) * s[..., None]).flatten(-2).to(dtype)
        if not self.tail:
            return values
        return torch.cat([values, _from_bytes(t[..., :tb], dtype)], -1)


# Bit patterns through same-size integer views and shifts: Inductor (torch 2.11, CUDA) fails to
# lower a view between dtypes of different sizes (uint8 <-> bf16) inside a step.
_INT = {2: torch.int16, 4: torch.int32}


def _to_bytes(x: Tensor) -> Tensor:
    """``[..., n]`` of a 2- or 4-byte dtype -> its little-endian bytes, uint8 ``[..., n * size]``."""
    bits = x.view(_INT[x.dtype.itemsize]).to(torch.int64)
    return torch.stack([(bits >> (8 * i)) & 0xFF for i in range(x.dtype.itemsize)], -1).flatten(-2).to(torch.uint8)


def _from_bytes(b: Tensor, dtype: torch.dtype) -> Tensor:
    """``_to_bytes``' inverse."""
    size = dtype.itemsize
    parts = b.unflatten(-1, (-1, size)).to(torch.int64)
    bits = sum(parts[..., i] << (8 * i) for i in range(size))
    bits = torch.where(bits >= 1 << (8 * size - 1), bits - (1 << (8 * size)), bits)  # two's complement
    return bits.to(_INT[size]).view(dtype)
