"""Steps whose batch is built on the host and run eagerly as one packed forward: context
parallelism (this rank's share of the chunks; every CP rank then samples from every row alike)
and steps with image spans, whose rows take their merged embeddings."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..api import Model
from ..graphs.batch import Batch, Chunk, context_gather, group_chunks
from ..graphs.model import forward_batch
from ..vision.requests import ImageInputs, batch_embeddings
from .cache import CachePool
from .scheduler import SchedulerOutputs
from .step_inputs import Layout, SampledRow, fill
from .steps import StepOut, sample_rows


def host_step(
    model: Model,
    pool: CachePool,
    next_token: torch.Tensor,
    vocab_ids: torch.Tensor,
    sched: SchedulerOutputs,
    mode: str,
    k: int | None,
    split: Callable[[Batch], Batch] | None,
    masks: Callable[[], torch.Tensor | None],
    encode_images: Callable[[Model, list[ImageInputs]], None],
) -> tuple[StepOut, list[tuple[int, int] | None], list[int]]:
    """``sched``'s step as one eager packed forward of a batch built on the host (``split``:
    context parallelism's share of it; the requests' images are encoded here, at their first
    prefill step, all in one pass of ``encode_images``), then every sampled row sampled with
    ``mode`` (``k``: top logprobs). ``masks``: called after the forward, returns the sampled
    rows' token bitmasks (None: no constrained row). Returns the step's results (every row's logits), per chunk the
    (part, row) of its sampled token (None if it samples nothing), and each chunk's first row."""
    device = model.device
    c, params = model
    ids, pos, dev_rows, dev_slots, chunks, sampled, where = [], [], [], [], [], [], []
    offset = 0
    for ch in sched.chunks:
        seq = ch.seq
        if ch.from_device:
            ids.append(0)
            dev_rows.append(offset)
            dev_slots.append(seq.slot)
        else:
            ids.extend(seq.prompt_ids[ch.start : ch.start + ch.length])
        pos.extend(range(ch.start, ch.start + ch.length))
        chunks.append(Chunk(seq.slot, ch.start, offset, ch.length))
        where.append((0, len(sampled)) if ch.sample else None)
        if ch.sample:
            sampled.append(SampledRow(offset + ch.length - 1, seq.slot, seq.controls, ch.start + ch.length))
        offset += ch.length
    token_ids = torch.tensor(ids, device=device)
    if dev_rows:
        token_ids[torch.tensor(dev_rows, device=device)] = next_token[torch.tensor(dev_slots, device=device)]
    batch = Batch(token_ids, torch.tensor(pos, device=device), group_chunks(chunks, device), tuple(chunks))
    spans = [
        (chunks[i].offset, ch.start, ch.length, ch.seq.images)
        for i, ch in enumerate(sched.chunks)
        if ch.seq.images is not None and not ch.from_device
    ]
    if spans:
        encode_images(model, [item for *_, item in spans])
        embeds, image_rows = batch_embeddings(model, token_ids, spans)
        batch = dataclasses.replace(batch, embeds=embeds, image_rows=image_rows)
        for ch in sched.chunks:
            if ch.seq.images is not None and ch.start + ch.length >= ch.seq.images.positions()[-1][1]:
                ch.seq.images = None  # past its last span: its later chunks are text, the features are dropped
    if split is not None:
        batch = split(batch)
    logits, _ = forward_batch(params, pool.state, c, batch)
    if batch.split is not None:  # this step's chunks were split: gather every row
        logits = context_gather(logits, batch.split)
    layout = Layout("decode", len(sampled))
    buf = torch.tensor(fill(layout, [0] * layout.model_size, sampled, pool.slots), dtype=torch.long, device=device)
    mask = masks()
    mask = None if mask is None else mask.to(device)
    out = StepOut(
        *sample_rows(logits, next_token, layout.sampling_part(buf), mode, k, vocab_ids, mask),
        logits,
    )
    return out, where, [ch.offset for ch in chunks]
