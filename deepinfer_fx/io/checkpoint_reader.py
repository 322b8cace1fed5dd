"""Read DeepSeek-V4 safetensors checkpoints under DeepSeek's own tensor names (spec §5).

Accepted on disk: (a) DeepSeek release names, (b) HF ``save_pretrained(save_original_format=False)``
names with fused experts, (c) HF ``save_original_format=True`` names (a partial reverse map).
All three go through the same data tables (``io/tensor_names.py``), so naming, reading and
dequantising each have one path; the files themselves are found by ``io/checkpoint.py``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_fx.io.checkpoint import CheckpointError, StoredTensor, scan_shards
from deepinfer_fx.io.quant import dequant_fp8_block, dequant_mxfp4, ue8m0_to_float
from deepinfer_fx.io.tensor_names import FUSED, SCALE_SUFFIXES, canonical_name

_FP8_BLOCKS = (128, 64, 32, 16)


@dataclass(frozen=True)
class RawTensor:
    """Where a stored tensor's bytes sit on disk, for callers that memory-map them directly
    (tables far too large to read, such as the ~98 GB Engram embeddings)."""

    path: pathlib.Path
    offset: int  # absolute byte offset of the tensor data in the file
    dtype: str  # safetensors dtype tag as stored, e.g. "F8_E4M3", "F8_E8M0", "BF16"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Entry:
    """A canonical key: where its data lives and how to turn it into a tensor."""

    src: StoredTensor
    scale: StoredTensor | None = None
    chunk: tuple[int, int, int] | None = None  # (expert, row start, row stop) in a fused tensor


class CheckpointReader:
    """Canonical-name view over a directory of safetensors shards."""

    def __init__(self, model_dir: str | os.PathLike[str], fp8_block: int | None = None) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.fp8_block = fp8_block
        self._handles: dict[pathlib.Path, Any] = {}
        self._entries = self._build(scan_shards(self.model_dir))

    # ---- construction -------------------------------------------------------------
    def _build(self, stored: list[StoredTensor]) -> dict[str, _Entry]:
        canon: dict[str, StoredTensor] = {}
        for t in stored:
            key = canonical_name(t.name)
            if key in canon:
                raise CheckpointError(f"{t.shard}: tensor '{t.name}' and {self._loc(canon[key])} both map to '{key}'")
            canon[key] = t
        scales = {k for k in canon for s in SCALE_SUFFIXES if k.endswith(s) and k[: -len(s)] + ".weight" in canon}
        entries: dict[str, _Entry] = {}
        for key, t in canon.items():
            if key in scales:
                continue  # consumed by its weight
            base = key[: -len(".weight")] if key.endswith(".weight") else None
            scale = next((canon[base + s] for s in SCALE_SUFFIXES if base and base + s in scales), None)
            fused = next(((m, parts) for rx, parts in FUSED if (m := rx.match(key))), None)
            if fused is None:
                entries[key] = _Entry(t, scale)
                continue
            m, parts = fused
            if len(t.shape) < 3 or t.shape[1] % len(parts) or scale is not None:
                raise CheckpointError(f"{self._loc(t)}: unsupported fused expert layout {list(t.shape)}")
            rows = t.shape[1] // len(parts)
            for e in range(t.shape[0]):
                for i, part in enumerate(parts):
                    entries[f"{m.group(1)}.{e}.{part}.weight"] = _Entry(t, None, (e, i * rows, (i + 1) * rows))
        return dict(sorted(entries.items()))

    # ---- queries ------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            near = difflib.get_close_matches(key, self._entries, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise CheckpointError(f"tensor '{key}' not found in checkpoint {self.model_dir}{hint}") from None

    def _loc(self, t: StoredTensor) -> str:
        return f"{t.shard.name}:{t.name}"

    def location(self, key: str) -> str:
        """ "shard-file:stored-name" (plus the slice of a fused tensor), for messages."""
        e = self._entry(key)
        return self._loc(e.src) + ("" if e.chunk is None else "[{}, {}:{}]".format(*e.chunk))

    def quantised(self, key: str) -> bool:
        """Whether ``key`` is stored with a quantisation scale (``get`` dequantises it)."""
        return self._entry(key).scale is not None

    def shape(self, key: str) -> tuple[int, ...]:
        """Logical (dequantised) shape from the header alone."""
        e = self._entry(key)
        shape = e.src.shape
        if e.chunk is not None:
            shape = (e.chunk[2] - e.chunk[1], *shape[2:])
        if e.scale is not None and e.src.dtype in ("I8", "U8"):
            shape = (*shape[:-1], shape[-1] * 2)  # two FP4 values per byte
        return shape

    def raw(self, key: str) -> RawTensor:
        """File, data offset, stored dtype and shape of one stored tensor, read from nothing but
        the shard header.  ``key`` is canonical; a quantisation scale (normally consumed by its
        weight and absent from ``keys()``) is addressed by its own canonical name."""
        e = self._entries.get(key)
        t = e.src if e is not None else None
        if e is None:
            for suffix in SCALE_SUFFIXES:
                owner = self._entries.get(key[: -len(suffix)] + ".weight") if key.endswith(suffix) else None
                if owner is not None and owner.scale is not None and canonical_name(owner.scale.name) == key:
                    t = owner.scale
        if t is None:
            self._entry(key)  # raises the usual "not found" error, with a near-miss hint
            raise CheckpointError(f"tensor '{key}' not found in checkpoint {self.model_dir}")
        if e is not None and e.chunk is not None:
            raise CheckpointError(f"{self.location(key)}: '{key}' is a slice of a fused tensor, not a stored tensor")
        # StoredTensor does not keep offsets (nothing else needs them), so re-read this shard's header;
        # it was validated at construction and is small next to the data.
        try:
            with open(t.shard, "rb") as fh:
                hlen = struct.unpack("<Q", fh.read(8))[0]
                start = int(json.loads(fh.read(hlen))[t.name]["data_offsets"][0])
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise CheckpointError(
                f"{t.shard}: cannot locate tensor '{t.name}' for '{key}' ({type(exc).__name__}: {exc})"
            ) from exc
        return RawTensor(t.shard, 8 + hlen + start, t.dtype, t.shape)

    def get(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Read (and dequantise) a tensor; integer tensors come back as int64."""
        w, scale = self._stored(key)
        if scale is not None:
            return self._dequant(key, w, scale, dtype)
        if not w.dtype.is_floating_point:
            return w.to(torch.int64)  # index tables such as tid2eid; dtype is for weights
        return w.to(dtype)

    def get_fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A block-FP8 weight as stored, for kernels that dequantise tile by tile: float8_e4m3fn
        ``[N, K]`` and its scales (ue8m0 or float on disk) as fp32 ``[ceil(N/b), ceil(K/b)]``."""
        w, scale = self._stored(key)
        if scale is None or w.dtype != torch.float8_e4m3fn:
            what = "no scale" if scale is None else "a scale"
            raise CheckpointError(f"{self.location(key)}: '{key}' is {w.dtype} with {what}, not a block-FP8 weight")
        self._fp8_block(key, w, scale)
        return w, ue8m0_to_float(scale)

    def get_mxfp4(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An MXFP4 weight as stored, for kernels that decode tile by tile: uint8 ``[N, K/2]`` (two
        e2m1 codes a byte, the even k in the low nibble) and its ue8m0 scales as uint8 ``[N, K/32]``."""
        w, scale = self._stored(key)
        ws = list(w.shape)
        if scale is None or w.dtype not in (torch.int8, torch.uint8):
            what = "no scale" if scale is None else "a scale"
            raise CheckpointError(f"{self.location(key)}: '{key}' is {w.dtype} with {what}, not an MXFP4 weight")
        if (
            list(scale.shape) != [ws[0], ws[1] // 16]
            or ws[1] % 16
            or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8)
        ):
            raise CheckpointError(
                f"{self.location(key)}: packed FP4 weight {ws} needs ue8m0 scale [N, K/32] = "
                f"[{ws[0]}, {ws[1] // 16}], got {scale.dtype} {list(scale.shape)}"
            )
        return w.view(torch.uint8), scale.view(torch.uint8)

    def _stored(self, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor of ``key`` as stored and its quantisation scale (None: not quantised)."""
        e = self._entry(key)
        w = self._read(e.src, None if e.chunk is None else (e.chunk[0], slice(*e.chunk[1:])))
        if e.scale is None:
            return w, None
        scale = self._read(e.scale)
        if w.dim() != 2 or scale.dim() != 2:
            raise CheckpointError(
                f"{self.location(key)}: quantised weight {list(w.shape)} and its scale "
                f"{list(scale.shape)} must both be 2-D"
            )
        return w, scale

    def _read(self, t: StoredTensor, index: tuple[Any, ...] | None = None) -> torch.Tensor:
        try:
            handle = self._handles.get(t.shard)
            if handle is None:
                from safetensors import safe_open

                handle = self._handles[t.shard] = safe_open(str(t.shard), framework="pt")
            return handle.get_tensor(t.name) if index is None else handle.get_slice(t.name)[index]
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{t.shard}: cannot read tensor '{t.name}' ({type(exc).__name__}: {exc})") from exc

    def _fp8_block(self, key: str, w: torch.Tensor, scale: torch.Tensor) -> int:
        """The block that tiles FP8 weight ``key`` onto its scale grid, or an error naming both."""
        ws, ss = list(w.shape), list(scale.shape)
        # An explicit fp8_block is checked, not trusted; otherwise take the largest
        # block that tiles the weight onto the scale grid (ties give equal results).
        blocks = _FP8_BLOCKS if self.fp8_block is None else (self.fp8_block,)
        fits = [b for b in blocks if [math.ceil(ws[0] / b), math.ceil(ws[1] / b)] == ss]
        if not fits:
            b = self.fp8_block
            fix = (
                "pass fp8_block"
                if b is None
                else (
                    f"fp8_block={b} is wrong or the shard is damaged (block {b} needs scale "
                    f"{[math.ceil(ws[0] / b), math.ceil(ws[1] / b)]})"
                )
            )
            raise CheckpointError(f"{self.location(key)}: FP8 scale {ss} of '{key}' does not tile weight {ws}; {fix}")
        return fits[0]

    def _dequant(self, key: str, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        where, ws, ss = self.location(key), list(w.shape), list(scale.shape)
        if w.dtype == torch.float8_e4m3fn:
            return dequant_fp8_block(w, scale, self._fp8_block(key, w, scale), dtype)
        if w.dtype in (torch.int8, torch.uint8):
            if ss != [ws[0], ws[1] // 16] or ws[1] % 16:
                raise CheckpointError(
                    f"{where}: packed FP4 weight {ws} needs scale [N, K/32] = [{ws[0]}, {ws[1] // 16}], got {ss}"
                )
            return dequant_mxfp4(w, scale, dtype)
        raise CheckpointError(f"{where}: has a scale but dtype {w.dtype} is neither FP8 e4m3 nor packed FP4")

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mmap when dropped
