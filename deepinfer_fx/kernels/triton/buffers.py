"""The launchers' optional ``out`` argument, checked in one place."""

from __future__ import annotations

import torch


def out_buffer(
    out: torch.Tensor | None, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device, op: str
) -> torch.Tensor:
    """``out`` when it is a contiguous ``dtype`` tensor of ``shape``; a new one when None; else a
    ValueError naming ``op``, what it needs and what it got (a kernel would write out of bounds)."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"{op}: out must be a contiguous {dtype} tensor of shape {shape}, "
            f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (strided)'}"
        )
    return out
