"""Images in engine requests: vLLM's prompt shape ``{"prompt": str | ids, "multi_modal_data":
{"image": image | [images]}}``, the expansion of each placeholder into its image's span, and
the merged embeddings of a prefill chunk. Features are computed once per request, at its first
prefill step, for every request of that step together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .merge import encode, has_vision, text_embeddings, token_grids
from .processor import preprocess_one
from .spans import expand_placeholders, merge_span, span_length
from .vit import EAGER, BlockParts

PROMPT_KEYS = ("prompt", "multi_modal_data")


@dataclass
class ImageInputs:
    """A request's images: their patches (host memory until encoded), where their spans sit in
    the laid-out prompt, and, after the first prefill step, the span embeddings."""

    pixel_values: list[torch.Tensor]  # per image [patches, 588]
    grids: list[tuple[int, int]]  # ViT patch grids
    starts: list[int]  # first prompt position of each span
    lengths: list[int]
    spans: list[torch.Tensor] | None = None  # [length, hidden] each, once encoded

    def positions(self) -> list[tuple[int, int]]:
        return [(s, s + n) for s, n in zip(self.starts, self.lengths)]


def split_prompt(prompt: dict, where: str) -> tuple[Any, list[Any]]:
    """A multimodal prompt dict -> its text or ids and its list of images (one-line errors)."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown or "prompt" not in prompt:
        raise ValueError(
            f"{where}: a prompt dict takes 'prompt' (a str or token ids) and optionally "
            f"'multi_modal_data' ({{'image': image or list}}); got keys {sorted(prompt)}"
        )
    mm = prompt.get("multi_modal_data") or {}
    if not isinstance(mm, dict) or set(mm) - {"image"}:
        raise ValueError(f"{where}: multi_modal_data takes one key, 'image'; got {mm!r:.80}")
    images = mm.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return prompt["prompt"], images


def prepare(model: Any, ids: Sequence[int], images: Sequence[Any], where: str) -> tuple[list[int], ImageInputs | None]:
    """Preprocess a request's images (a corrupt file fails here, naming the request) and lay out
    its prompt: each ``image_token_id`` placeholder becomes its image's span. A model with a
    vision tower refuses placeholders without images, and the reverse."""
    c, params = model
    if images and (c.vision is None or not has_vision(params)):
        missing = "its config has no vision_config" if c.vision is None else "its checkpoint has no vision.* weights"
        raise ValueError(f"{where}: {len(images)} image(s) given, but the model has no vision tower ({missing})")
    if c.vision is None or not has_vision(params):
        return list(ids), None
    pixel_values, grids = [], []
    for j, image in enumerate(images):
        patches, grid = preprocess_one(image, c.vision, f"{where}: multi_modal_data['image'][{j}]")
        pixel_values.append(torch.from_numpy(patches))
        grids.append(grid)
    tgrids = token_grids(c, grids)
    laid_out, starts = expand_placeholders(list(ids), tgrids, c.image_token_id, where)
    if not images:
        return laid_out, None
    return laid_out, ImageInputs(pixel_values, grids, starts, [span_length(*g) for g in tgrids])


@torch.no_grad()
def encode_requests(model: Any, items: Sequence[ImageInputs], parts: BlockParts = EAGER, alone: bool = False) -> None:
    """Span embeddings of every request in ``items`` still without them: one ViT pass over all
    their images (each image still attends only to itself; ``parts``: how the blocks run).
    ``alone``: one pass per image, so that an image's bits do not depend on the images encoded
    with it (batch-invariant inference: the packed projections' GEMMs block by row count)."""
    todo = [it for it in items if it.spans is None]
    if not todo:
        return
    c, params = model
    grids = [g for it in todo for g in it.grids]
    pixels = [p for it in todo for p in it.pixel_values]
    if alone:
        feats = iter([f for px, g in zip(pixels, grids) for f in encode(model, px, [g], parts)])
    else:
        feats = iter(encode(model, torch.cat(pixels), grids, parts))
    for it in todo:
        spans = []
        for h, w in token_grids(c, it.grids):
            spans.append(
                merge_span(next(feats), h, w, params["image_start"], params["image_newline"], params["image_end"])
            )
        it.spans, it.pixel_values = spans, []  # the patches are not needed again


def chunk_rows(item: ImageInputs, start: int, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For the chunk of prompt positions ``[start, start + length)``: which rows are span rows
    (``[length]`` bool) and their span embeddings (``[n, hidden]``, in row order). A chunk may
    begin or end inside a span."""
    mask = torch.zeros(length, dtype=torch.bool)
    parts = []
    for (a, b), span in zip(item.positions(), item.spans):
        lo, hi = max(a, start), min(b, start + length)
        if lo < hi:
            mask[lo - start : hi - start] = True
            parts.append(span[lo - a : hi - a])
    width = item.spans[0].shape[-1]
    rows = torch.cat(parts) if parts else torch.empty(0, width, dtype=item.spans[0].dtype, device=item.spans[0].device)
    return mask.to(device), rows


def batch_embeddings(
    model: Any,
    token_ids: torch.Tensor,
    chunks: Sequence[tuple[int, int, int, ImageInputs | None]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged embeddings ``[N, hidden]`` and image rows ``[N]`` of a packed batch:
    ``chunks`` are ``(first packed row, prompt start, length, the request's images or None)``."""
    c, params = model
    dtype = params["norm"].dtype
    embeds = text_embeddings(c, params, token_ids, dtype)
    image_rows = torch.zeros(token_ids.shape[0], dtype=torch.bool, device=token_ids.device)
    for offset, start, length, item in chunks:
        if item is None:
            continue
        mask, rows = chunk_rows(item, start, length, token_ids.device)
        if rows.shape[0]:
            where = offset + torch.nonzero(mask).reshape(-1)
            embeds[where] = rows.to(dtype)
            image_rows[where] = True
    return embeds, image_rows
