"""Image spans in the token stream: ``[image_start] + ([IMG] x W + [image_newline]) x H +
[image_end]`` for an aligner grid of ``H x W`` tokens, every position carrying
``image_token_id``; the span's own layout (which position is which) follows from the grid.
A prompt names each image with one placeholder, the id itself, which expands to the span."""

from __future__ import annotations

from collections.abc import Sequence

import torch

START, IMAGE, NEWLINE, END = 0, 1, 2, 3  # the kinds of span positions


def span_length(h: int, w: int) -> int:
    """Positions of the span of an ``h x w`` aligner grid."""
    return h * (w + 1) + 2


def span_kinds(h: int, w: int) -> torch.Tensor:
    """``[span_length]`` int64: each position's kind, in span order."""
    row = torch.cat([torch.full((w,), IMAGE), torch.tensor([NEWLINE])])
    return torch.cat([torch.tensor([START]), row.repeat(h), torch.tensor([END])])


def span_ids(h: int, w: int, image_token_id: int) -> list[int]:
    """The span's token ids: ``image_token_id`` at every position."""
    return [image_token_id] * span_length(h, w)


def merge_span(
    features: torch.Tensor, h: int, w: int, start: torch.Tensor, newline: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """Span embeddings ``[span_length, D]``: the aligner's ``[h * w, D]`` rows in raster order,
    a newline after each row, the start and end embeddings around them."""
    rows = features.reshape(h, w, -1)
    nl = newline.to(features.dtype).expand(h, 1, -1)
    body = torch.cat([rows, nl], dim=1).reshape(h * (w + 1), -1)
    return torch.cat([start.to(features.dtype)[None], body, end.to(features.dtype)[None]])


def expand_placeholders(
    ids: Sequence[int], grids: Sequence[tuple[int, int]], image_token_id: int, where: str = "prompt"
) -> tuple[list[int], list[int]]:
    """Prompt ids with one ``image_token_id`` placeholder per image -> the ids with each
    placeholder replaced by its image's span, and each span's first position. ``grids`` are the
    aligner grids ``(H, W)`` in image order; a count that differs from the placeholders' is a
    one-line ``ValueError`` naming ``where``."""
    marks = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(marks) != len(grids):
        raise ValueError(
            f"{where}: {len(marks)} image placeholder(s) (token id {image_token_id}) but "
            f"{len(grids)} image(s); put one placeholder where each image goes"
        )
    out: list[int] = []
    starts: list[int] = []
    prev = 0
    for mark, (h, w) in zip(marks, grids):
        out.extend(ids[prev:mark])
        starts.append(len(out))
        out.extend(span_ids(h, w, image_token_id))
        prev = mark + 1
    out.extend(ids[prev:])
    return out, starts
