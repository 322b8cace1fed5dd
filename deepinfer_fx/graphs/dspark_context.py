"""The DSpark drafter's context step (``dspark.py`` drafts from it), after every target forward
for the rows whose tokens are verified: ``h_p = concat_l mean_k X^(l)_{p,k}`` over the target
layers ``dspark_target_layer_ids`` (each layer's *input* streams, as
``forward_batch(..., captured=dspark_capture(c))`` records them),
``main_x_p = RMSNorm(main_proj h_p; main_norm)``, and for every stage s the window entry
``latent_kv_s(main_x_p)`` (= fake-quantised RoPE(RMSNorm(Wkv_s main_x; kv_norm_s)) at position
p, window-only theta: the backbone's own window-kv map) at slot ``p % window`` of
``state["dspark"][s]``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import ModelConfig
from . import fake_quant as fq
from .attention import latent_kv
from .batch import Batch, Group
from .norm import held, linear, rms_norm
from .rope import cos_sin, inv_freq
from .state import write_rows


def dspark_capture(c: ModelConfig) -> dict[int, None]:
    """The ``captured`` argument of ``forward_batch`` that records the drafter's target layers."""
    return {layer: None for layer in c.dspark_target_layer_ids}


def check_drafter(params: dict, state: dict, c: ModelConfig) -> None:
    """Refuse a config, parameters or state without the drafter (the host entry points check)."""
    if not c.dspark_stages:
        raise ValueError(f"this {c.model_type} config has no DSpark drafter (no dspark_target_layer_ids / stages)")
    mtp = params.get("mtp")
    if not mtp or "main_proj" not in mtp[0]:
        raise ValueError(
            "the parameters hold no DSpark weights (mtp.0.main_proj); load the checkpoint with its mtp.* tensors"
        )
    if "dspark" not in state:
        raise ValueError("the state has no DSpark windows; allocate it with init_state(..., mtp=True)")


def window_freq(c: ModelConfig) -> torch.Tensor:
    """The stages' rope frequencies (context windows and block alike)."""
    return inv_freq(c, compressed=False)  # the stages are window-only: rope_theta, no YaRN


@torch.no_grad()
def dspark_context(
    params: dict,
    state: dict,
    c: ModelConfig,
    captured: dict[int, torch.Tensor],
    batch: Batch,
    verified: Sequence[int] | None = None,
) -> None:
    """Write the stages' context windows for the verified rows of a target forward.

    ``captured``: layer -> input streams ``[N, hc, D]`` of the rows of ``batch`` (filled by
    ``forward_batch(..., captured=dspark_capture(c))``). ``verified[i]``: how many leading rows
    of chunk i hold verified tokens (default: all; after a verify pass, the accepted drafts plus
    the token they followed). Rows past it are never written, so the windows hold target-derived
    context of verified positions only. The host's form of ``context_rows`` (one call per group)."""
    check_drafter(params, state, c)
    missing = [layer for layer in c.dspark_target_layer_ids if captured.get(layer) is None]
    if missing:
        raise ValueError(
            f"captured has no streams for target layers {missing}; run forward_batch with captured=dspark_capture(c)"
        )
    by_slot = {}
    for i, ch in enumerate(batch.chunks):
        n = ch.length if verified is None else int(verified[i])
        if not 0 <= n <= ch.length:
            raise ValueError(f"chunk {i} (slot {ch.slot}) has {ch.length} rows; verified={n} is outside 0..{ch.length}")
        by_slot[ch.slot] = n
    for g in batch.groups:
        known = torch.tensor([by_slot[s] for s in g.slots.tolist()], device=g.slots.device)
        context_rows(params, state, c, captured, g, known)


def context_rows(
    params: dict, state: dict, c: ModelConfig, captured: dict[int, torch.Tensor], group: Group, known: torch.Tensor
) -> None:
    """``dspark_context`` for one group ``[C, L]``: chunk c's first ``known[c]`` rows are
    verified. Only the last ``sliding_window`` of them can survive in the ring, and a chunk has
    at most ``L``, so ``min(window, L)`` rows a chunk are projected (the missing ones, before a
    chunk's start, are written to the scratch slot): one shape for every step of the bucket,
    and a decode or verify chunk projects its few rows, not a window's worth."""
    w = c.sliding_window
    L = group.index.shape[1]
    n = min(w, L)
    j = known[:, None] - n + torch.arange(n, device=known.device)  # [C, n] chunk rows
    real = j >= 0
    idx = group.index.gather(1, j.clamp(0, L - 1))
    dtype = captured[c.dspark_target_layer_ids[0]].dtype
    h = torch.cat([captured[layer][idx].float().mean(-2) for layer in c.dspark_target_layer_ids], dim=-1).to(dtype)
    m0 = params["mtp"][0]
    main_x = rms_norm(linear(h, *held(m0, "main_proj")), m0["main_norm"], c.rms_norm_eps)
    positions = group.starts[:, None] + j
    cos, sin = cos_sin(positions, window_freq(c))
    for s in range(c.dspark_stages):
        ring = state["dspark"][s]["window"]
        kv = latent_kv(params["mtp"][s]["attn"], c, main_x, cos, sin)
        write_rows(ring, group.slots, torch.remainder(positions, w), fq.window_kv(c, kv, fq.is_packed(ring)), real)
