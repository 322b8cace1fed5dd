"""Float sums, means and scans over one dim, and the top-k of a row: the model's and the sampler's
reductions, one place each (``graphs/swap.py``).

On the CPU a sum over a fixed-length dim reduces alike for every row count, but torch's CUDA
reductions choose how threads split a row from the number of rows (and a scan of one row runs
another kernel than a scan of many), so a row's bits follow the batch; ``topk`` orders equal
values as its algorithm, chosen by the shape, happens to. Batch-invariant inference
(``passes/batch_invariant.py``) puts fixed-order forms in these places (``deepinfer::bi_sum``,
``bi_mean``, ``bi_cumsum``; a stable sort for the top-k); otherwise they are torch's own.
"""

from __future__ import annotations

import torch

from .swap import swappable


@swappable
def sum_over(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.sum(dim, keepdim=keepdim)


@swappable
def mean_over(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.mean(dim, keepdim=keepdim)


@swappable
def cumsum_over(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim=dim)


@swappable
def top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row over the last dim and their indices, largest first
    (``torch.topk``, whose choice among equal values is its own)."""
    return x.topk(k, dim=-1)
