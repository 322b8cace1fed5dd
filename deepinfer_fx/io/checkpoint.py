"""Read DeepSeek-V4 safetensors checkpoints under DeepSeek's own tensor names (spec §5).

Accepted on disk: (a) DeepSeek release names, (b) HF ``save_pretrained(save_original_format=False)``
names with fused experts, (c) HF ``save_original_format=True`` names (a partial reverse map).
All three go through the same data tables, so naming, reading and dequantising each have one path.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import pathlib
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_fx.io.quant import dequant_fp8_block, dequant_mxfp4, ue8m0_to_float
from deepinfer_fx.settings import setting

ENV_MODEL_DIR = "DEEPINFER_HF_MODEL_DIR"
INDEX_FILE = "model.safetensors.index.json"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt"]

# HF -> DeepSeek renames, applied in order (each with re.sub) after a leading
# "model." is stripped.  Canonical names are fixed points of every rule, so
# scheme (a) passes through untouched.  Order matters: the indexer is moved
# out of the compressor before the generic compressor rules run.
_RENAMES: list[tuple[str, str]] = [
    (r"^lm_head\.weight$", "head.weight"),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.q_(a|b)_proj\.", r".wq_\1."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.o_(a|b)_proj\.", r".wo_\1."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    # HF's forward rule `.norm.` -> `.kv_norm.` is meant for compressor norms;
    # save_original_format=True inverts it blindly and writes the attention
    # kv_norm as `attn.norm`, which no DeepSeek checkpoint contains.
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    # DSpark Markov head: some tools name its factors markov_w1 / markov_w2 (spec §12.7).
    (r"\.markov_head\.markov_w1\.", ".markov_head.embed."),
    (r"\.markov_head\.markov_w2\.", ".markov_head.head."),
]
_RENAME_RES = [(re.compile(p), r) for p, r in _RENAMES]

# Fused HF expert tensors [E, n*rows, ...]: chunk i of dim 1 for expert e is
# canonical "{prefix}.{e}.{parts[i]}.weight" (gate_up_proj holds w1 rows first).
_FUSED: list[tuple[re.Pattern[str], tuple[str, ...]]] = [
    (re.compile(r"^(.+\.ffn\.experts)\.gate_up_proj$"), ("w1", "w3")),
    (re.compile(r"^(.+\.ffn\.experts)\.down_proj$"), ("w2",)),
]

# Quantisation scales are siblings of "<base>.weight"; DeepSeek writes
# "<base>.scale", HF fine-grained FP8 writes "<base>.weight_scale_inv".
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_FP8_BLOCKS = (128, 64, 32, 16)


class CheckpointError(ValueError):
    """A checkpoint problem; the message is one line naming file and tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def canonical_name(stored: str) -> str:
    """Map a stored tensor name of any supported scheme to DeepSeek's name."""
    name = stored[len("model.") :] if stored.startswith("model.") else stored
    if name.startswith(("vision.", "aligner.")):  # the vision tower's names are its own (`.mlp.` is no text FFN)
        return name
    for pattern, repl in _RENAME_RES:
        name = pattern.sub(repl, name)
    return name


def resolve_model_dir(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """Local directory, $DEEPINFER_HF_MODEL_DIR, or a hub repo id -> directory."""
    from_env = model is None
    if from_env:
        model = setting(ENV_MODEL_DIR)
        if not model:
            raise CheckpointError(
                f"no model given and {ENV_MODEL_DIR} is not set; pass a checkpoint directory "
                f"or hub repo id, or export {ENV_MODEL_DIR}=/path/to/checkpoint"
            )
    text = os.fspath(model)
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    # Anything path-shaped must exist locally; only bare "org/name" goes to the hub.
    if from_env or isinstance(model, os.PathLike) or text.startswith(("/", ".", "~")) or path.exists():
        where = f" (from {ENV_MODEL_DIR})" if from_env else ""
        raise CheckpointError(f"{text}{where}: no such directory; pass an existing checkpoint directory")
    import huggingface_hub  # deferred: only hub ids need it
    from huggingface_hub import errors as hf_errors

    # Read the offline switch at call time: huggingface_hub caches it at import.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return pathlib.Path(
            huggingface_hub.snapshot_download(text, allow_patterns=_HUB_PATTERNS, local_files_only=offline)
        )
    except (OSError, ValueError, hf_errors.HfHubHTTPError, hf_errors.OfflineModeIsEnabled) as exc:
        raise CheckpointError(
            f"hub repo '{text}' could not be fetched (offline? {type(exc).__name__}); pass a local "
            f"checkpoint directory path instead, or set {ENV_MODEL_DIR}=/path/to/checkpoint"
        ) from exc


@dataclass(frozen=True)
class _Stored:
    """One tensor as written on disk (from the shard header; nothing read yet)."""

    shard: pathlib.Path
    name: str
    dtype: str  # safetensors dtype tag, e.g. "F8_E4M3", "I8", "BF16"
    shape: tuple[int, ...]


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

    src: _Stored
    scale: _Stored | None = None
    chunk: tuple[int, int, int] | None = None  # (expert, row start, row stop) in a fused tensor


def _read_header(shard: pathlib.Path) -> dict[str, _Stored]:
    """Parse a safetensors header ourselves: cheap, and catches truncation early."""
    bad = f"{shard}: not a valid safetensors file"
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as fh:
            head = fh.read(8)
            hlen = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            header = json.loads(fh.read(hlen)) if hlen <= size - 8 else None
    except OSError as exc:
        raise CheckpointError(f"{shard}: cannot read shard ({exc})") from exc
    except ValueError as exc:  # JSON or UTF-8 decoding
        raise CheckpointError(f"{bad} (header is not JSON: {exc}); re-download it") from exc
    if header is None:
        raise CheckpointError(f"{bad} (header length {hlen} does not fit in {size} bytes); re-download it")
    out: dict[str, _Stored] = {}
    for name, info in header.items() if isinstance(header, dict) else [("<header>", None)]:
        if name == "__metadata__":
            continue
        try:
            end = 8 + hlen + int(info["data_offsets"][1])
            out[name] = _Stored(shard, name, str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{bad} (bad header entry for tensor '{name}'); re-download it") from exc
        if end > size:  # the usual symptom of an interrupted download
            raise CheckpointError(
                f"{bad} (truncated: tensor '{name}' ends at byte {end}, file has {size}); re-download it"
            )
    return out


class CheckpointReader:
    """Canonical-name view over a directory of safetensors shards."""

    def __init__(self, model_dir: str | os.PathLike[str], fp8_block: int | None = None) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.fp8_block = fp8_block
        self._handles: dict[pathlib.Path, Any] = {}
        self._entries = self._build(self._scan())

    # ---- construction -------------------------------------------------------------
    def _scan(self) -> list[_Stored]:
        """All stored tensors, validated against the index and shard headers."""
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"{index}: unreadable or corrupt index ({type(exc).__name__}: {exc}); "
                    f"it needs a 'weight_map' of tensor name -> shard file"
                ) from exc
            by_shard: dict[str, list[str]] = {}
            for name, shard in weight_map.items():
                by_shard.setdefault(str(shard), []).append(name)
            stored: list[_Stored] = []
            for shard_name, names in sorted(by_shard.items()):
                shard = self.model_dir / shard_name
                if not shard.is_file():
                    raise CheckpointError(
                        f"{shard}: shard listed in {INDEX_FILE} is missing (it should hold tensor "
                        f"'{names[0]}'); re-download it"
                    )
                header = _read_header(shard)
                for name in names:
                    if name not in header:
                        raise CheckpointError(f"{shard}: tensor '{name}' listed in {INDEX_FILE} is not in this shard")
                    stored.append(header[name])
            return stored
        shards = sorted(self.model_dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(
                f"{self.model_dir}: no *.safetensors files and no {INDEX_FILE}; "
                f"point at a directory holding the checkpoint"
            )
        return [t for shard in shards for t in _read_header(shard).values()]

    def _build(self, stored: list[_Stored]) -> dict[str, _Entry]:
        canon: dict[str, _Stored] = {}
        for t in stored:
            key = canonical_name(t.name)
            if key in canon:
                raise CheckpointError(f"{t.shard}: tensor '{t.name}' and {self._loc(canon[key])} both map to '{key}'")
            canon[key] = t
        scales = {k for k in canon for s in _SCALE_SUFFIXES if k.endswith(s) and k[: -len(s)] + ".weight" in canon}
        entries: dict[str, _Entry] = {}
        for key, t in canon.items():
            if key in scales:
                continue  # consumed by its weight
            base = key[: -len(".weight")] if key.endswith(".weight") else None
            scale = next((canon[base + s] for s in _SCALE_SUFFIXES if base and base + s in scales), None)
            fused = next(((m, parts) for rx, parts in _FUSED if (m := rx.match(key))), None)
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

    def _loc(self, t: _Stored) -> str:
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
            for suffix in _SCALE_SUFFIXES:
                owner = self._entries.get(key[: -len(suffix)] + ".weight") if key.endswith(suffix) else None
                if owner is not None and owner.scale is not None and canonical_name(owner.scale.name) == key:
                    t = owner.scale
        if t is None:
            self._entry(key)  # raises the usual "not found" error, with a near-miss hint
            raise CheckpointError(f"tensor '{key}' not found in checkpoint {self.model_dir}")
        if e is not None and e.chunk is not None:
            raise CheckpointError(f"{self.location(key)}: '{key}' is a slice of a fused tensor, not a stored tensor")
        # _Stored does not keep offsets (nothing else needs them), so re-read this shard's header;
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

    def _read(self, t: _Stored, index: tuple[Any, ...] | None = None) -> torch.Tensor:
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
