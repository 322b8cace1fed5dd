"""Checkpoint -> parameter tree, driven by the parameter specs.

Each spec names the tensor it needs; the reader finds it under any of the accepted key
spellings and dequantises it (routed experts held as stored, ``held_experts``, come with their
scales). Shapes are checked against the config before any data is read, so a
checkpoint that does not match its config fails at once with the file and tensor named.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch

from ..config import ModelConfig, load_config
from ..graphs.param_spec import ParamSpec, build_tree, scale_path
from ..graphs.params import backbone_specs, mtp_specs
from ..vision.params import vision_specs
from ..graphs.engram import EngramTable
from ..graphs.engram_hash import compressed_vocab
from ..settings import argument
from .checkpoint import CheckpointError, resolve_model_dir
from .checkpoint_reader import CheckpointReader
from .quant import ue8m0_to_float
from .tokenizer import load_tokenizer

EXPERT_FORMAT = "DEEPINFER_EXPERT_FORMAT"
DENSE_FORMAT = "DEEPINFER_DENSE_FORMAT"
ExpertIds = Callable[[ParamSpec], Sequence[int]]


def _expected(spec: ParamSpec) -> tuple[int, ...]:
    return spec.shape[1:] if spec.stacked else spec.shape


def _load_one(
    reader: CheckpointReader, spec: ParamSpec, dtype: torch.dtype, device, experts: ExpertIds | None = None
) -> dict:
    """``{tree path: value}`` of one spec; a weight held as stored brings its scales along."""
    if spec.quant == "engram":  # ~98 GB tables: memory-mapped, rows read on lookup
        if tuple(reader.shape(spec.key)) != spec.shape:
            raise CheckpointError(
                f"{reader.location(spec.key)}: tensor '{spec.key}' has shape {list(reader.shape(spec.key))}, the config expects {list(spec.shape)}"
            )
        scale = spec.key[: -len(".weight")] + ".scale"
        return {spec.path: EngramTable.from_checkpoint(reader, spec.key, scale if _has_raw(reader, scale) else None)}
    if spec.stacked:  # a sharded rank reads only the experts it holds (replicas repeat an id)
        ids = range(spec.shape[0]) if experts is None else experts(spec)
        keys = [spec.key.format(e=e) for e in ids]
    else:
        keys = [spec.key]
    for key in keys:
        if key not in reader:
            raise CheckpointError(
                f"{reader.model_dir}: tensor '{key}' is missing; the config expects it (incomplete download?)"
            )
        got = tuple(reader.shape(key))
        if got != _expected(spec):
            raise CheckpointError(
                f"{reader.location(key)}: tensor '{key}' has shape {list(got)}, the config expects {list(_expected(spec))}"
            )
    if spec.held in ("fp8", "fp4"):  # as stored; the reader checks each scale grid
        weights, scales = zip(*((reader.get_fp8 if spec.held == "fp8" else reader.get_mxfp4)(key) for key in keys))
        w, s = torch.stack(weights).to(device), torch.stack(scales).to(device)
        _check_values(reader, spec, keys, w)
        _check_values(reader, spec, keys, s if spec.held == "fp8" else ue8m0_to_float(s), "the block scales of tensor")
        if not spec.stacked:  # a dense projection (dense_format="fp8"): one weight, no expert dim
            w, s = w[0], s[0]
        return {spec.path: w, scale_path(spec.path): s}
    target = spec.dtype(dtype)
    parts = [reader.get(key, dtype=target) for key in keys]
    t = (torch.stack(parts) if spec.stacked else parts[0]).to(target).to(device)
    _check_values(reader, spec, keys, t if spec.stacked else t[None])
    return {spec.path: t}


_CHECK_CHUNK = 1 << 24  # values per reduction: bounds the check's temporary mask on a nearly full device


def _bad_mask(x: torch.Tensor, high: int | None) -> torch.Tensor:
    if x.dtype == torch.float8_e4m3fn:
        return (x.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn has no inf; S.1111.111 is its NaN
    if x.is_floating_point():
        return ~torch.isfinite(x)
    return (x < 0) | (x >= high)


def _bad_counts(t: torch.Tensor, high: int | None) -> torch.Tensor | None:
    """Per leading row of ``t``, the count of values a sound checkpoint cannot hold (None: an
    integer tensor without a declared range)."""
    if not t.is_floating_point() and high is None:
        return None
    zero = torch.zeros((), dtype=torch.long, device=t.device)
    return torch.stack(
        [sum((_bad_mask(c, high).sum() for c in row.reshape(-1).split(_CHECK_CHUNK)), zero) for row in t]
    )


def _check_values(
    reader: CheckpointReader, spec: ParamSpec, keys: list[str], t: torch.Tensor, what: str = "tensor"
) -> None:
    """Refuse NaN/inf in float tensors (after dequantisation) and index tensors outside
    ``[0, spec.high)``: either means a damaged shard, which would otherwise run and emit NaN
    logprobs or index out of bounds deep in a step. ``t`` has one leading row per key; checked
    on its device, with one host sync for the whole tensor."""
    counts = _bad_counts(t, spec.high)
    if counts is None or not bool(counts.any()):
        return
    i = int(torch.nonzero(counts)[0])
    key, n = keys[i], int(counts[i])
    if t.is_floating_point():
        after = " after dequantisation" if spec.held is None and reader.quantised(key) else ""
        holds = f"{n} non-finite value(s) (NaN or inf){after}"
    else:
        holds = f"{n} index value(s) outside [0, {spec.high}) (range [{int(t[i].min())}, {int(t[i].max())}])"
    raise CheckpointError(
        f"{reader.location(key)}: {what} '{key}' holds {holds}; the shard is damaged or the weights are broken: re-download it"
    )


def load_params(
    reader: CheckpointReader,
    c: ModelConfig,
    dtype: torch.dtype,
    device=None,
    mtp: bool | None = None,
    experts: ExpertIds | None = None,
) -> dict:
    """The parameter tree of ``c`` from ``reader``. ``mtp=None`` loads the draft layers when the
    checkpoint carries them (HF-written checkpoints drop ``mtp.*``); the vision path
    (``vision.*``, ``aligner.*``, ``image_*``) loads when the config and the checkpoint have it. ``experts`` maps a stacked
    expert spec to the expert ids this rank holds, in slot order (``sharding.rules.expert_ids``);
    None loads every expert."""
    specs = backbone_specs(c)
    extra = mtp_specs(c)
    if mtp is None:
        mtp = bool(extra) and extra[0].key.replace("{e}", "0") in reader
    if mtp:
        specs = specs + extra
    vision = vision_specs(c)
    if vision and vision[0].key in reader:  # a checkpoint without the tower loads as a text-only model
        specs = specs + vision
    if c.tie_word_embeddings and "head.weight" not in reader:
        specs = [s for s in specs if s.path != "head"]
    flat = {
        path: value
        for s in specs
        if s.held != "scale"  # scales come with their weights
        for path, value in _load_one(reader, s, dtype, device, experts).items()
    }
    if "head" not in flat:
        flat["head"] = flat["embed"]
    if c.engram_layer_ids:
        flat["engram_vocab"] = engram_vocab(reader.model_dir, c).to(device)
    return build_tree(flat)


def _has_raw(reader: CheckpointReader, key: str) -> bool:
    try:
        reader.raw(key)
    except CheckpointError:
        return False
    return True


def engram_vocab(model_dir, c: ModelConfig) -> torch.Tensor:
    """Token id -> compressed class, from the checkpoint's own tokenizer (the Engram hashes
    were trained on it); ids past the tokenizer's vocabulary map to the pad class."""
    try:
        tok = load_tokenizer(model_dir)
    except FileNotFoundError:
        raise CheckpointError(
            f"{model_dir}: V4.1 Engram layers need the checkpoint's tokenizer.json to hash token ids; copy it in"
        ) from None
    lookup, n = compressed_vocab(tok)
    if c.engram_compressed_vocab_size is not None and n != c.engram_compressed_vocab_size:
        raise CheckpointError(
            f"{model_dir}: tokenizer.json gives {n} compressed classes but config.json says "
            f"engram_compressed_vocab_size={c.engram_compressed_vocab_size}; the tokenizer does not belong to this checkpoint"
        )
    table = torch.as_tensor(lookup, dtype=torch.long)
    if table.numel() < c.vocab_size:
        table = torch.cat([table, table[c.engram_pad_token_id].expand(c.vocab_size - table.numel())])
    return table[: c.vocab_size]


def held_experts(c: ModelConfig, expert_format: str | None, device=None) -> str | None:
    """How the routed experts of checkpoint config ``c`` are held on ``device``: "fp8" (float8_e4m3fn
    + fp32 block scales) or "fp4" (MXFP4 bytes + ue8m0 scales) as stored, or None (dequantised to
    the model dtype). ``expert_format`` (None: ``DEEPINFER_EXPERT_FORMAT``): "fp8" / "fp4" keep
    experts stored in that format (another format is an error), "dequant" converts them, "auto"
    keeps both as stored on CUDA, where the compiled steps run the fp8 and fp4 kernels at a half and
    a quarter of bf16's bytes, and converts them elsewhere (every eager call would dequantise
    again; docs/decisions.md)."""
    fmt = argument(EXPERT_FORMAT, expert_format)
    stored = None if c.fp8_block is None or c.expert_dtype == "bf16" else ("fp8" if c.expert_dtype == "fp8" else "fp4")
    if fmt in ("fp8", "fp4") and fmt != stored:
        names = {"fp8": "block-FP8", "fp4": "MXFP4", None: "unquantised"}
        raise CheckpointError(
            f"expert_format={fmt!r} keeps {names[fmt]} routed experts, but this checkpoint's are "
            f"{names[stored]}; use 'auto' or 'dequant'"
        )
    if fmt == "auto":
        return stored if torch.device(device or "cpu").type == "cuda" else None
    return None if fmt == "dequant" else stored


def held_dense(
    c: ModelConfig, dense_format: str | None, device=None, dtype: torch.dtype = torch.bfloat16
) -> str | None:
    """How the block-FP8 dense projections of checkpoint config ``c`` are held: "fp8" (float8_e4m3fn
    + fp32 block scales, dequantised inside each projection) or None (dequantised to ``dtype`` on
    load). ``dense_format`` (None: ``DEEPINFER_DENSE_FORMAT``): "fp8" keeps them (an unquantised
    checkpoint is an error), "dequant" converts them, "auto" keeps them on CUDA with bf16
    activations, where decode steps read them as stored (``skinny_linear_fp8``, up to 64 rows;
    P8 decode on the H100 as fast or faster than bf16 weights at 1, 8 and 64 rows, prefill the
    same: docs/decisions.md), and converts them elsewhere (every other call dequantises the
    whole weight again)."""
    fmt = argument(DENSE_FORMAT, dense_format)
    if fmt == "fp8" and c.fp8_block is None:
        raise CheckpointError(
            "dense_format='fp8' keeps block-FP8 dense weights, but this checkpoint's are unquantised; use 'auto' or 'dequant'"
        )
    if fmt == "auto":
        on_cuda = torch.device(device or "cpu").type == "cuda"
        return "fp8" if c.fp8_block is not None and on_cuda and dtype == torch.bfloat16 else None
    return "fp8" if fmt == "fp8" else None


def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype,
    device=None,
    fake_quant: bool | None = None,
    experts: ExpertIds | None = None,
    expert_format: str | None = None,
    dense_format: str | None = None,
):
    """-> (config, params, model_dir). ``fake_quant`` overrides the config's switch; ``experts``
    as in ``load_params``; ``expert_format`` as in ``held_experts``, ``dense_format`` as in
    ``held_dense``."""
    model_dir = resolve_model_dir(path)
    c = load_config(model_dir)
    if fake_quant is not None:
        c = c.replace(fake_quant=fake_quant)
    c = c.replace(
        held_experts=held_experts(c, expert_format, device), held_dense=held_dense(c, dense_format, device, dtype)
    )
    reader = CheckpointReader(model_dir, fp8_block=c.fp8_block)
    try:
        params = load_params(reader, c, dtype, device, experts=experts)
    finally:
        reader.close()
    return c, params, model_dir
