"""The first index of each row's maximum over a vocabulary, in two reductions.

``torch.argmax`` over a 129k-entry vocabulary compiles (Inductor) to one program a row, which
reduces the whole row alone; two stages (the maximum of each of 128 groups, then the first group
holding the largest) spread a row over many programs and give the same index, ties included:
``max`` and ``argmax`` both return the first maximum (docs/decisions.md, "Argmax in two stages").
"""

from __future__ import annotations

import torch

_GROUPS = 128
_MIN_WIDTH = 4096  # narrower rows (tiny test vocabularies) are one reduction anyway


def first_argmax(z: torch.Tensor) -> torch.Tensor:
    """``z.argmax(-1)``: the first index of the largest value along the last dim (int64)."""
    v = z.shape[-1]
    if v < _MIN_WIDTH:
        return z.argmax(-1)
    pad = (-v) % _GROUPS
    if pad:
        z = torch.nn.functional.pad(z, (0, pad), value=float("-inf"))
    groups = z.unflatten(-1, (_GROUPS, -1))
    best, within = groups.max(-1)
    g = best.argmax(-1, keepdim=True)
    return (g * groups.shape[-1] + within.gather(-1, g)).squeeze(-1)
