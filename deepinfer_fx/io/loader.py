"""Checkpoint -> parameter tree, driven by the parameter specs.

Each spec names the tensor it needs; the reader finds it under any of the accepted key
spellings and dequantises it. Shapes are checked against the config before any data is read,
so a checkpoint that does not match its config fails at once with the file and tensor named.
"""

from __future__ import annotations

import os

import torch

from ..config import ModelConfig, load_config
from ..graphs.params import ParamSpec, backbone_specs, build_tree, mtp_specs
from .checkpoint import CheckpointError, CheckpointReader, resolve_model_dir


def _expected(spec: ParamSpec) -> tuple[int, ...]:
    return spec.shape[1:] if spec.stacked else spec.shape


def _load_one(reader: CheckpointReader, spec: ParamSpec, dtype: torch.dtype, device) -> torch.Tensor:
    keys = [spec.key.format(e=e) for e in range(spec.shape[0])] if spec.stacked else [spec.key]
    for key in keys:
        if key not in reader:
            raise CheckpointError(f"{reader.model_dir}: tensor '{key}' is missing; the config expects it (incomplete download?)")
        got = tuple(reader.shape(key))
        if got != _expected(spec):
            raise CheckpointError(
                f"{reader.location(key)}: tensor '{key}' has shape {list(got)}, the config expects {list(_expected(spec))}"
            )
    target = torch.float32 if spec.fp32 else dtype
    parts = [reader.get(key, dtype=target) for key in keys]
    t = torch.stack(parts) if spec.stacked else parts[0]
    return (t.long() if spec.integer else t.to(target)).to(device)


def load_params(reader: CheckpointReader, c: ModelConfig, dtype: torch.dtype, device=None, mtp: bool | None = None) -> dict:
    """The parameter tree of ``c`` from ``reader``. ``mtp=None`` loads the MTP block when the
    checkpoint carries it (HF-written checkpoints drop ``mtp.*``)."""
    specs = backbone_specs(c)
    extra = mtp_specs(c)
    if mtp is None:
        mtp = bool(extra) and extra[0].key.replace("{e}", "0") in reader
    if mtp:
        specs = specs + extra
    if c.tie_word_embeddings and "head.weight" not in reader:
        specs = [s for s in specs if s.path != "head"]
    flat = {s.path: _load_one(reader, s, dtype, device) for s in specs}
    if "head" not in flat:
        flat["head"] = flat["embed"].float()
    return build_tree(flat)


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype, device=None, fake_quant: bool | None = None):
    """-> (config, params, model_dir). ``fake_quant`` overrides the config's switch."""
    model_dir = resolve_model_dir(path)
    c = load_config(model_dir)
    if fake_quant is not None:
        c = c.replace(fake_quant=fake_quant)
    reader = CheckpointReader(model_dir, fp8_block=c.fp8_block)
    try:
        params = load_params(reader, c, dtype, device)
    finally:
        reader.close()
    return c, params, model_dir
