"""Random parameter trees of any config, from the same specs that drive loading."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..io.quant import quant_fp8_block, quant_mxfp4, ue8m0_to_float
from .engram import EngramTable
from .param_spec import build_tree, init_param, scale_path
from .params import param_specs


def random_flat(
    c: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, mtp: bool = True, device=None
) -> dict[str, torch.Tensor]:
    """Flat ``{tree path: tensor}`` with every parameter drawn from one seeded generator on
    ``device`` (a GPU draws benchmark-sized models in seconds; values differ from the CPU's).
    Weights held as stored (fp8, fp4) are the quantisation of the value drawn in ``dtype``, so the
    generator draws the same values as for the dequantised config."""
    gen = torch.Generator(device=device or "cpu").manual_seed(seed)
    flat: dict[str, torch.Tensor] = {}
    for s in param_specs(c, mtp=mtp):
        if s.held == "scale":
            continue  # made with its weight
        value = init_param(s, gen, dtype, c.n_routed_experts)
        if s.held == "fp8":
            value, scale = quant_fp8_block(value, c.fp8_block)
            flat[scale_path(s.path)] = ue8m0_to_float(scale)
        elif s.held == "fp4":  # expert by expert: the rounding's fp32 temporaries of a whole layer fill a GPU
            parts = [quant_mxfp4(v) for v in value.split(1)]
            value = torch.cat([q.view(torch.uint8) for q, _ in parts])
            flat[scale_path(s.path)] = torch.cat([e.view(torch.uint8) for _, e in parts])
        flat[s.path] = value
    return flat


def random_params(
    c: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device=None, mtp: bool = True
) -> dict:
    flat = random_flat(c, seed, dtype, mtp, device=torch.device(device) if device is not None else None)
    for path in [p for p in flat if p.endswith(".engram.embed")]:
        flat[path] = EngramTable.from_tensor(flat[path], name=path)
    if c.engram_layer_ids:
        flat["engram_vocab"] = default_engram_vocab(c).to(device)
    return build_tree(flat)


def default_engram_vocab(c: ModelConfig) -> torch.Tensor:
    """Token id -> compressed class for a model without a tokenizer (random models): ids fold
    onto ``engram_compressed_vocab_size`` classes. Real checkpoints derive it from the tokenizer."""
    classes = c.engram_compressed_vocab_size or c.vocab_size
    return torch.arange(c.vocab_size) % classes
