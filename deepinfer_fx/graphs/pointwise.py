"""Pointwise functions and softmaxes whose bits depend on more than their operands.

torch's CPU loops run the last ``numel % 16`` elements of a contiguous float tensor through the
scalar function: ``sigmoid``, ``silu`` and ``softplus`` then differ from the vectorised ones in
the last bit now and then, so an element's bits depend on where it sits in the tensor, that is,
on how many rows the batch has. ``softmax`` and ``log_softmax`` are one fused kernel eagerly but
decomposed in compiled steps (Inductor's decompositions), which round differently. The model
and the sampler call them here, one place each (``graphs/swap.py``), so that batch-invariant
inference (``passes/batch_invariant.py``) can put forms built only from ``exp``, ``log``,
``log1p``, reductions and IEEE arithmetic in their stead, whose vector and scalar kernels agree
and which compile to the same ops (measured: ``docs/decisions.md``, batch invariance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .swap import swappable


@swappable
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


@swappable
def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


@swappable
def softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x)


@swappable
def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x, dim=dim)


@swappable
def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.log_softmax(x, dim=dim)
