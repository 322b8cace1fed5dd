"""Explicit per-sequence cache state, allocated once and updated in place.

Everything a layer needs to continue a sequence at position ``start`` lives here, and nothing
else does: how many tokens came before is the caller's ``start``, and which slot holds which
position follows from it. So one-shot prefill, chunked prefill and token-by-token decode run
the same functions on the same state.

Per layer (a plain dict of tensors):
All tensors carry a leading slot dim (one slot per sequence of a batch) and one more row at
the end, the *scratch slot*: rows that must not land anywhere (padding of compiled steps,
compressor windows that did not complete) are written there, so every write is a static-shape
scatter with no host decision. Nothing real ever reads the scratch slot.

- ``window``: ring ``[sliding_window + spare, head_dim]`` of this layer's kv; position p sits
  at slot ``p % ring``.
- ``comp`` (layers with a compressor): ``rows_kv`` / ``rows_gate`` ring of raw projected rows
  (fp32, ``ratio`` slots, or ``2 * ratio`` where windows overlap, so the previous window's
  rows are still there; plus ``spare``), and ``entries`` ``[max_len // ratio, head_dim]`` of
  compressed kv.

``spare`` rows (speculative decoding: the most drafts a verify chunk carries, spec §8.4 a) make
every ring that a verify step writes hold that many positions more than its readers need: a
verify chunk of ``k + 1`` rows then writes its rows before reading (no copy of the ring), and
a rejected draft at ``p + j`` overwrites position ``p + j - ring``, older than anything a
committed query still reads. Rolling a rejection back is then only forgetting its positions.
- ``index`` (V4 CSA layers): the same for the indexer's own compressor (index keys).
- V4.1: only KV-source layers hold ``comp`` (with ``index_keys`` beside ``entries``); the
  other layers read their source's. ``engram.history`` holds, per slot, a ring of the compressed
  ids of the last ``engram_max_ngram_size - 1`` tokens (plus ``spare``), position p at ``p % ring``.
- ``mtp`` (configs with MTP-1 blocks): the block's ``window`` ring, and ``pending``
  ``[hc, hidden]``: the target's final streams at the last position of the slot's latest
  chunk, which the drafter (``graphs/mtp.mtp_draft``) runs once the token after it is known.
- ``dspark`` (configs with a DSpark drafter): one ``{"window": [slots, sliding_window, head_dim]}``
  per stage. It holds context derived from the target's states at verified positions only
  (``graphs/dspark.py``): drafting reads it and never writes it, so a rejected draft leaves
  nothing to roll back there.

``kv_format="trained"`` holds every window ring, compressed entries and index keys as the bytes
of their fake-quantised values (uint8 rows, ``io/state_rows.py``; ``fake_quant.read`` gives the
values back); ``"model"`` holds the values in the state dtype.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import fake_quant as fq

KV_FORMATS = ("model", "trained")


def _rows(c: ModelConfig, kind: str, slots: int, n: int, dtype: torch.dtype, device, kv_format: str) -> torch.Tensor:
    """``[slots, n, row]`` of ``kind`` rows: values in ``dtype``, or their trained-format bytes."""
    if kv_format == "trained":
        return torch.zeros(slots, n, fq.codec(c, kind).nbytes(dtype), dtype=torch.uint8, device=device)
    dim = c.index_head_dim if kind == "index" else c.head_dim
    return torch.zeros(slots, n, dim, dtype=dtype, device=device)


def _compressor_state(
    c: ModelConfig, slots: int, ratio: int, index: bool, max_len: int, dtype: torch.dtype, device, spare: int, fmt: str
) -> dict:
    """V4's overlapping compressors are CSA ones (the layer's and its indexer's, ``index``)."""
    overlap = not c.is_v41 and ratio == c.csa_ratio
    width = (c.index_head_dim if index else c.head_dim) * (2 if overlap else 1)
    ring = ratio * (2 if overlap else 1) + spare
    return {
        "rows_kv": torch.zeros(slots, ring, width, dtype=torch.float32, device=device),
        "rows_gate": torch.zeros(slots, ring, width, dtype=torch.float32, device=device),
        "entries": _rows(c, "index" if index else "entry", slots, max(max_len // ratio, 1), dtype, device, fmt),
    }


def layer_state(
    c: ModelConfig,
    ratio: int,
    max_len: int,
    dtype: torch.dtype,
    device=None,
    slots: int = 1,
    layer: int | None = None,
    spare: int = 0,
    kv_format: str = "model",
) -> dict:
    """One layer's state; ``layer`` is its backbone index (None for window-only draft blocks);
    ``spare``: the rings' rows past what their readers need (see the module docstring)."""
    st = {"window": _rows(c, "window", slots, c.sliding_window + spare, dtype, device, kv_format)}
    if c.is_v41:
        if ratio and layer is not None and c.is_kv_source(layer):  # other layers read their source's
            st["comp"] = _compressor_state(c, slots, ratio, False, max_len, dtype, device, spare, kv_format)
            st["comp"]["index_keys"] = _rows(c, "index", slots, max(max_len // ratio, 1), dtype, device, kv_format)
        return st
    if ratio:
        st["comp"] = _compressor_state(c, slots, ratio, False, max_len, dtype, device, spare, kv_format)
    if ratio == c.csa_ratio:
        st["index"] = _compressor_state(c, slots, ratio, True, max_len, dtype, device, spare, kv_format)
    return st


def init_state(
    c: ModelConfig,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    mtp: bool = True,
    slots: int = 1,
    spare: int = 0,
    kv_format: str = "model",
) -> dict:
    """State for ``slots`` sequences of up to ``max_len`` tokens each (backbone and draft model).
    Every tensor has the slot as its leading dim; ``slot_view`` gives one sequence's part.
    ``spare``: the most drafts a verify chunk carries (0 without speculation). The drafters'
    own windows hold verified positions only and get none. ``kv_format``: "model" or "trained"
    (see the module docstring)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format={kv_format!r} is not one of {KV_FORMATS}")
    if kv_format == "trained":
        fq.check_trained(c)
    n_mtp = c.num_nextn_predict_layers if mtp and not c.dspark_stages else 0
    rows = slots + 1  # the last row is the scratch slot
    state = {
        "max_len": max_len,
        "slots": slots,
        "layers": [
            layer_state(c, r, max_len, dtype, device, rows, i, spare, kv_format)
            for i, r in enumerate(c.compress_ratios)
        ],
        "mtp": [
            {
                **layer_state(c, 0, max_len, dtype, device, rows, kv_format=kv_format),
                "pending": torch.zeros(rows, c.hc_mult, c.hidden_size, dtype=dtype, device=device),
            }
            for _ in range(n_mtp)
        ],
    }
    if mtp and c.dspark_stages:  # the drafter's per-stage context windows (window-only blocks)
        state["dspark"] = [
            layer_state(c, 0, max_len, dtype, device, rows, kv_format=kv_format) for _ in range(c.dspark_stages)
        ]
    if c.engram_layer_ids:  # compressed ids of the tokens before each slot's next position
        hist = c.engram_max_ngram_size - 1 + spare
        state["engram"] = {"history": torch.zeros(rows, hist, dtype=torch.long, device=device)}
    return state


def scratch_slot(state: dict) -> int:
    """The extra slot that padding rows of compiled steps use."""
    return state["slots"]


def write_rows(
    buf: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> None:
    """``buf[slots[c], idx[c, j]] = values[c, j]`` where ``mask[c, j]``; other rows go to the
    scratch slot (the last row of ``buf``), so the write is one static-shape scatter."""
    scratch = buf.shape[0] - 1
    s = torch.where(mask, slots[:, None].expand_as(mask), scratch)
    buf[s, torch.where(mask, idx, 0)] = values.to(buf.dtype)


def slot_view(tree: dict, slot: int) -> dict:
    """One slot's state: the same dict shape, each tensor a view (writes land in the pool)."""
    return {k: slot_view(v, slot) if isinstance(v, dict) else v[slot] for k, v in tree.items()}


def check_room(state: dict, slot: int, start: int, n_tokens: int) -> None:
    end = start + n_tokens
    if not 0 <= slot < state["slots"]:
        raise ValueError(f"state slot {slot} does not exist; the state has {state['slots']} slots")
    if start < 0 or n_tokens < 1:
        raise ValueError(f"a step needs start >= 0 and at least one token (got start={start}, tokens={n_tokens})")
    if end > state["max_len"]:
        raise ValueError(
            f"sequence of {end} tokens does not fit the cache state allocated for {state['max_len']}; "
            "allocate the state with a larger max_len"
        )
