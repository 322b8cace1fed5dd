"""The DSpark drafter (``mtp.0..S-1``) of DeepSeek-V4.1-Flash and DeepSeek-V4-Flash-0731.

A semi-autoregressive block drafter (spec §7.9, §3.11): a parallel backbone drafts a whole block
of ``dspark_block_size`` tokens in one pass, a low-rank Markov head re-introduces the dependency
of each token on the one before it, and a confidence head scores each drafted token. Two steps:

``dspark_context`` (``dspark_context.py``, after every target forward)
    The verified rows' target-layer streams become every stage's window entries.

``dspark_draft`` / ``dspark_propose`` (after the target produced ``x_{p+1}``)
    Block ids ``[x_{p+1}, noise, ..., noise]`` at positions ``p+1 .. p+block``, embedded with the
    target's ``embed`` into the hc streams, run through the stages. Each stage is the backbone's
    ``block`` with ratio 0 and the drafter's own expert count / top-k (``dspark_stage_config``);
    only its attention differs: block queries attend, non-causally, to the stage window and to
    all block tokens' own kv, and the window is not written. Then the final collapse, the last
    stage's ``norm`` and the target ``head`` give base logits ``U_k``; the Markov head and the
    confidence head run sequentially over the block.

V4.1 and V4-0731 differ only in data: the mHC wiring (V4.1 single-pass with the ``pre`` chained
across stages and the last FFN site's ``pre`` as final collapse; V4 per-site ``pre`` and a
learned ``mtp.{S-1}.hc_head_*``), the per-head q norm and window fake-quant (read by the shared
attention helpers from the config), and the drafter's experts (config fields).

Formula choices where the spec leaves room (spec §12 items 4 and 7, and details no source pins):

- Target states (§12.4): the *input* streams of each target layer (after Engram), averaged over
  the hc streams in fp32, for both generations; one port reads "the last layers' outputs" for
  V4-0731 — for layers 40..42 that is a one-layer shift, and the caller's ``captured`` decides.
- Markov weight names (§12.7): ``markov_head.embed`` (E_m, indexed by the previous token) and
  ``markov_head.head`` (W_m, projecting to the vocabulary) as vLLM's V4.1 loader names them; the
  checkpoint reader also maps the ``markov_head.markov_w1`` / ``markov_w2`` spelling onto them.
- V4.1 mHC entry: the first stage's first collapse reads stream 0 alone (the streams are equal
  copies of the embedding), as the backbone's layer 0 and vLLM's draft layers with no incoming
  pre-mix do; the ``pre`` then chains through the stages like consecutive backbone layers.
- Context span: every block query sees the same last ``sliding_window`` verified positions
  ``p-window+1 .. p`` (the official ``forward_spec`` index list), not a per-query band.
- Block kv goes through the same fake-quant as window kv (one map for every window entry, as
  an engine with a quantised window cache stores it); the context kv does too.
- Markov head: ``y_0 = x_{p+1}``, ``b_k = W_m E_m[y_k]`` in fp32, ``y_{k+1} = pick(U_k + b_k)``;
  the drafted tokens are ``y_1 .. y_block``. ``pick`` is argmax (temperature 0), a sample of
  ``softmax(z / T)``, or a caller's sampler.
- Confidence: ``c_k = sigmoid(w · [h~_k ; E_m[y_k]])`` in fp32, with ``h~_k`` the collapsed
  pre-norm hidden of block position k and ``E_m[y_k]`` the Markov embedding of the token that
  enters step k (the official head pairs the hidden with that step's Markov embedding); ``c_k``
  scores the drafted token ``y_{k+1}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..config import ModelConfig
from . import fake_quant as fq
from .argmax import first_argmax
from .attention import grouped_output, latent_kv, mqa_with_sink, query
from .batch import Batch, Group
from .dspark_context import check_drafter, window_freq
from .mhc import first_stream, hc_head, mhc_collapse
from .model import block, embed, output_head
from .norm import linear_fp32, rms_norm
from .params import dspark_stage_config
from .rope import cos_sin

# Drafted-token picker: fp32 logits ``[B, vocab]`` (U_k + b_k) -> token ids ``[B]``.
Sampler = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [B, used] long: y_1 .. y_used (used: the block unless fewer were asked)
    confidences: torch.Tensor  # [B, used] fp32 in [0, 1]: c_k scores tokens[:, k]
    logits: torch.Tensor  # [B, used, vocab] fp32: U_k + b_k, the distribution tokens[:, k] was picked from


def _stage_attention(
    p: dict, states: list, c: ModelConfig, x: torch.Tensor, batch: Batch, layer: int, ratio: int, ctx: dict
) -> torch.Tensor:
    """A stage's attention sublayer (``block``'s ``attn``): the backbone's projections, keys from
    the stage's context window (read only) plus the block itself, every block query seeing
    every real key (no causal mask). A chunk's context ends at the position before its start:
    the ring holds positions ``start - window .. start - 1`` there (slots before position 0 are
    empty). ``layer`` is the stage index; the batch is one packed group of blocks ``[C, k]``."""
    g = batch.groups[0]
    C, k = g.index.shape
    cos, sin = cos_sin(batch.positions, window_freq(c))
    _, q = query(p, c, x, cos, sin)
    kv = latent_kv(p, c, x, cos, sin).view(C, k, -1)
    ring = fq.read(c, "window", states[layer]["window"][g.slots], kv.dtype)  # [C, w, d]
    w = ring.shape[1]
    last = (g.starts - 1)[:, None]
    held = last - torch.remainder(last - torch.arange(w, device=kv.device), w)  # the position each ring slot holds
    ok = torch.cat([held >= 0, torch.ones(C, k, dtype=torch.bool, device=kv.device)], dim=1)
    bias = torch.zeros(ok.shape, device=kv.device).masked_fill(~ok, float("-inf"))[:, None].expand(C, k, w + k)
    o = mqa_with_sink(
        q.view(C, k, *q.shape[1:]),
        torch.cat([ring, kv], dim=1),
        bias,
        p["attn_sink"],
        cos.view(C, k, -1),
        sin.view(C, k, -1),
    )
    return grouped_output(o.reshape(q.shape), p, c.o_groups)


def _temperature_sampler(temperature: float, generator: torch.Generator | None) -> Sampler:
    if temperature == 0:
        return first_argmax
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return lambda z: torch.multinomial(torch.softmax(z / temperature, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def dspark_propose(
    params: dict,
    state: dict,
    c: ModelConfig,
    last_token: torch.Tensor,
    positions: torch.Tensor,
    slots: Sequence[int],
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    generator: torch.Generator | None = None,
) -> Draft:
    """Draft one block for each of B requests. ``last_token`` ``[B]``: the target's newest token
    ``x_{p+1}``; ``positions`` ``[B]``: its position ``p+1`` (context written up to p);
    ``slots``: each request's state slot. ``sampler`` (fp32 logits ``[B, vocab]`` -> ids ``[B]``)
    overrides ``temperature``. Reads the drafter windows, writes nothing. The checked host form
    of ``draft_blocks``."""
    check_drafter(params, state, c)
    vocab = c.vocab_size
    if not 0 <= c.dspark_noise_token_id < vocab:
        raise ValueError(f"dspark_noise_token_id {c.dspark_noise_token_id} is not a token id below vocab_size {vocab}")
    last_token = torch.as_tensor(last_token, dtype=torch.long).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    n = last_token.numel()
    if not (positions.numel() == len(slots) == n) or n == 0:
        raise ValueError(
            f"dspark_propose needs one position and one slot per request; got {n} tokens, {positions.numel()} positions, {len(slots)} slots"
        )
    if int(positions.min()) < 1:
        raise ValueError("a draft needs context: positions (of x_{p+1}) must be >= 1")
    if len(set(slots)) != n:
        raise ValueError(f"dspark_propose drafts one block per state slot; got slots {list(slots)}")
    device = params["norm"].device
    return draft_blocks(
        params,
        state,
        c,
        last_token.to(device),
        positions.to(device),
        torch.tensor(list(slots), device=device),
        torch.ones(n, dtype=torch.bool, device=device),
        sampler or _temperature_sampler(temperature, generator),
    )


def draft_blocks(
    params: dict,
    state: dict,
    c: ModelConfig,
    last_token: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    live: torch.Tensor,
    pick: Sampler,
    used: int | None = None,
) -> Draft:
    """``dspark_propose`` on tensors (the engine's steps call it inside their graphs): one block
    ``[x_{p+1}, noise, ...]`` per slot at ``positions``; ``live`` False for padding blocks
    (their rows are no chunk's tokens). ``used`` (default the block): the drafted tokens wanted,
    the first ones of the block. The stages still run the whole block (its queries see every
    block token), but the vocabulary head, the Markov steps and the confidence head run for the
    used positions only, whose values do not depend on the rest."""
    k = c.dspark_block_size
    used = k if used is None else used
    if not 0 < used <= k:
        raise ValueError(f"DSpark drafts 1 to {k} tokens of a block, {used} asked")
    n = last_token.shape[0]
    device = last_token.device
    ids = torch.cat(
        [last_token[:, None], torch.full((n, k - 1), c.dspark_noise_token_id, dtype=torch.long, device=device)], 1
    )
    group = Group(torch.arange(n * k, device=device).view(n, k), slots, positions, live.long() * k, packed=True)
    batch = Batch(ids.reshape(-1), group.positions.reshape(-1), (group,))
    stage_c = dspark_stage_config(c)

    X = embed(params, c, batch.token_ids, params["norm"].dtype)
    pre = None
    if c.is_v41:  # single-pass mHC, as the backbone: the first collapse reads stream 0 alone
        pre = first_stream(X)
    for s in range(c.dspark_stages):
        X, pre_f = block(
            params["mtp"][s], state["dspark"], stage_c, X, batch, s, 0, pre_prev=pre, attn=_stage_attention
        )
        if c.is_v41:
            pre = pre_f
    last = params["mtp"][c.dspark_stages - 1]
    if c.is_v41:
        h = mhc_collapse(X, pre)
    else:
        h = hc_head(X, last["hc_head_fn"], last["hc_head_base"], last["hc_head_scale"], c.rms_norm_eps, c.hc_eps)
    h = h.view(n, k, -1)[:, :used]
    base = output_head(params, rms_norm(h, last["norm"], c.rms_norm_eps), draft=True)  # [n, used, vocab]

    markov = last["markov_head"]
    y = last_token
    tokens, embeds, logits = [], [], []
    for j in range(used):  # sequential: each step's bias depends on the token picked before it
        e = markov["embed"][y]  # in the weights' dtype, so the head's GEMV reads it as stored
        z = base[:, j] + linear_fp32(e, markov["head"])
        y = pick(z).long()
        tokens.append(y)
        embeds.append(e.float())
        logits.append(z)
    w = last["confidence_head"]["proj"]
    conf = torch.sigmoid(linear_fp32(torch.cat([h.float(), torch.stack(embeds, 1)], dim=-1), w)).squeeze(-1)
    return Draft(torch.stack(tokens, 1), conf, torch.stack(logits, 1))


def dspark_draft(
    params: dict,
    state: dict,
    c: ModelConfig,
    last_token: torch.Tensor,
    positions: torch.Tensor,
    slots: Sequence[int],
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dspark_propose``'s draft tokens ``[B, block]`` and confidences ``[B, block]``."""
    d = dspark_propose(params, state, c, last_token, positions, slots, temperature, sampler, generator)
    return d.tokens, d.confidences
