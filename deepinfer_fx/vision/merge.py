"""From images to the text model's input embeddings: ViT, aligner, span layout, merge (``encode``, ``input_embeddings``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .aligner import aligner
from .processor import Plan, preprocess
from .spans import merge_span, span_length
from .vit import EAGER, BlockParts, vit


def has_vision(params: dict) -> bool:
    """Whether a parameter tree holds a vision tower (a checkpoint may leave it out)."""
    return "vision" in params and "aligner" in params


def _require_vision(c: Any, params: dict, where: str = "this model") -> None:
    if c.vision is None or not has_vision(params):
        missing = "its config has no vision_config" if c.vision is None else "its checkpoint has no vision.* weights"
        raise ValueError(f"{where}: the model has no vision tower ({missing}); it takes no images")


def token_grids(c: Any, grids: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The aligner grids ``(H, W)`` of images with ViT patch grids ``grids``."""
    p, r = c.vision.patch_size, c.vision.downsample_ratio
    return [Plan(gh * p, gw * p, p, r).tokens for gh, gw in grids]


@torch.no_grad()
def encode(
    model: Any, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int]], parts: BlockParts = EAGER
) -> list[torch.Tensor]:
    """Packed patches of ``preprocess`` -> one ``[H * W, hidden]`` tensor per image: the
    aligner's tokens in raster order of the image's aligner grid, in the weights' dtype
    (``parts``: how the ViT's blocks run, ``vision/compiled.py``)."""
    c, params = model
    _require_vision(c, params)
    grids = [(int(h), int(w)) for h, w in grids]
    return aligner(params["aligner"], c.vision, vit(params["vision"], c.vision, pixel_values, grids, parts), grids)


def span_embeddings(model: Any, images: Any | Sequence[Any]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Images -> each one's span embeddings ``[span_length, hidden]`` and aligner grid ``(H, W)``."""
    c, params = model
    _require_vision(c, params)
    pixel_values, grids = preprocess(images, c)
    feats = encode(model, pixel_values, grids)
    tgrids = token_grids(c, grids)
    spans = [
        merge_span(f, h, w, params["image_start"], params["image_newline"], params["image_end"])
        for f, (h, w) in zip(feats, tgrids)
    ]
    return spans, tgrids


def span_starts(
    ids: Sequence[int], image_token_id: int, tgrids: Sequence[tuple[int, int]], where: str = "token_ids"
) -> list[int]:
    """The first position of each image's span in laid-out ``ids``: spans are read in order,
    each the length its grid gives, every position ``image_token_id``."""
    starts, i, k = [], 0, 0
    n = len(ids)
    while i < n:
        if ids[i] != image_token_id:
            i += 1
            continue
        if k == len(tgrids):
            raise ValueError(f"{where}: more image-span positions than the spans of {len(tgrids)} image(s)")
        length = span_length(*tgrids[k])
        if any(t != image_token_id for t in ids[i : i + length]) or i + length > n:
            raise ValueError(
                f"{where}: the span at position {i} is shorter than image {k}'s {length} positions "
                f"(aligner grid {tgrids[k]})"
            )
        starts.append(i)
        i += length
        k += 1
    if k != len(tgrids):
        raise ValueError(f"{where}: spans of {k} image(s) laid out, but {len(tgrids)} image(s) given")
    return starts


def text_embeddings(c: Any, params: dict, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``embed`` rows of ``token_ids``, as ``graphs.model.embed`` reads them (a generated image
    token id is text); an ``image_token_id`` past the vocabulary (tiny models) reads row 0 instead,
    which span positions' callers overwrite."""
    ids = token_ids
    if c.image_token_id is not None and c.image_token_id >= params["embed"].shape[0]:
        ids = torch.where(ids == c.image_token_id, torch.zeros_like(ids), ids)
    return params["embed"][ids].to(dtype)


@torch.no_grad()
def input_embeddings(model: Any, token_ids: Sequence[int] | torch.Tensor, images: Any | Sequence[Any]) -> torch.Tensor:
    """The merged input embeddings ``[T, hidden]`` (the text model's activation dtype) of a
    token sequence whose image spans are already laid out (``spans.expand_placeholders``):
    text positions take their ``embed`` rows, span positions their image's span embeddings."""
    c, params = model
    dev, dtype = params["norm"].device, params["norm"].dtype
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    out = text_embeddings(c, params, ids.to(dev), dtype)
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        return out
    spans, tgrids = span_embeddings(model, items)
    for start, span in zip(span_starts(ids.tolist(), c.image_token_id, tgrids), spans):
        out[start : start + span.shape[0]] = span.to(dtype)
    return out
