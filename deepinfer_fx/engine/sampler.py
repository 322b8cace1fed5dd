"""Token sampling on the device, free of host synchronisation.

``sample`` uses only fixed-shape tensor ops (no ``.item()``, no ``nonzero``, no Python branch on a
tensor value), so the runner can capture it inside a CUDA graph and sampled tokens never leave the
device between steps (DESIGN principle 6).

Randomness comes from a counter-based hash of (seed, position, vocab id), not from torch's global
generator: a request's token then depends only on its own seed, its position and its logits, never
on which batch or row it was scheduled in, so results survive changes of batch composition and
can be replayed exactly.

The hash is splitmix64 written in int64 arithmetic: torch has no uint64 multiply on every backend,
but two's-complement int64 multiply and add wrap exactly like uint64 ones; only the right shift
differs (arithmetic, not logical), which masking off the sign-extended bits fixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..graphs.argmax import first_argmax
from ..graphs.pointwise import log_softmax, softmax
from ..graphs.reduce import cumsum_over, top_values
from .sampling import SamplingParams

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 stream increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch rejects ints >= 2**63)."""
    return c - (1 << 64) if c >= 1 << 63 else c


# ---------------------------------------------------------------------------------------------
# Pure-Python reference (uint64 via masking); the tests hold the torch version to it, and the
# engine uses it on the host to derive default seeds.


def mix64_py(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def row_key_py(seed: int, position: int) -> int:
    # Two rounds so that nearby (seed, position) pairs give unrelated keys.
    return mix64_py(mix64_py(seed + _GOLDEN) ^ (position & _M64))


def hash_py(seed: int, position: int, index: int) -> int:
    """The index-th output of a splitmix64 stream whose state is the row key."""
    return mix64_py(row_key_py(seed, position) + (index + 1) * _GOLDEN)


def derive_seed(engine_seed: int, request_index: int) -> int:
    """Default seq_seed for a request that gave none: reproducible from the engine seed and the
    request's index, and inside the int64 range the device tensors hold."""
    return hash_py(engine_seed, request_index, -1) >> 1


# ---------------------------------------------------------------------------------------------
# Torch version: int64 with wraparound.


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits: arithmetic shift, then clear the copied sign bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: Tensor) -> Tensor:
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def row_key(seed: Tensor, position: Tensor) -> Tensor:
    return mix64(mix64(seed + _signed(_GOLDEN)) ^ position)


def hash_bits(key: Tensor, index: Tensor) -> Tensor:
    """64 random bits (as int64) per (row key [B, 1], vocab index [B, N])."""
    return mix64(key + (index + 1) * _signed(_GOLDEN))


def exponentials(key: Tensor, index: Tensor) -> Tensor:
    """Exp(1) draws (float32) for each (row, vocab index).

    Uses the top 23 bits k to form u = (2k + 1) / 2**24: odd multiples of 2**-24 are exact in
    float32 and lie strictly inside (0, 1), so E = -log(u) is finite and > 0 (a u of exactly 0 or
    1 would give an infinite or zero E and break the race below). float32 rather than float64
    because not every accelerator we target has fast (or any) float64.
    """
    k = _shr(hash_bits(key, index), 41)
    u = (2 * k + 1).to(torch.float32) * (2.0**-24)
    return -torch.log(u)


# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingTensors:
    """Per-row sampling controls, each a [B] tensor on the sampling device."""

    temperature: Tensor  # float32; 0 = greedy
    top_k: Tensor  # int64; 0 = off
    top_p: Tensor  # float32; 1 = off
    min_p: Tensor  # float32; 0 = off
    seed: Tensor  # int64
    position: Tensor  # int64: position of the token being sampled

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str | None = None,
    ) -> SamplingTensors:
        """Build the tensors on the host (seeds already resolved, see ``derive_seed``)."""
        n = len(params_list)
        if len(seeds) != n or len(positions) != n:
            raise ValueError(
                f"SamplingTensors.from_params: {n} params but {len(seeds)} seeds and {len(positions)} positions"
            )

        def col(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=col([p.temperature for p in params_list], torch.float32),
            top_k=col([max(p.top_k, 0) for p in params_list], torch.int64),
            top_p=col([p.top_p for p in params_list], torch.float32),
            min_p=col([p.min_p for p in params_list], torch.float32),
            seed=col(list(seeds), torch.int64),
            position=col(list(positions), torch.int64),
        )


# What a step's rows ask of the sampler, from cheapest to most general; a step runs the
# cheapest mode that serves every row, and a row's token is the same in every mode that serves it
# (greedy rows take the argmax, the race meets the same noise), so the choice never moves a result.
MODES = ("greedy", "plain", "sorted")


def mode_for(temperature: float, top_k: int, top_p: float) -> str:
    """The cheapest mode that serves one row: greedy (argmax), plain (temperature and min-p:
    no sort) or sorted (top-k or top-p)."""
    if temperature == 0:
        return "greedy"
    return "sorted" if top_k > 0 or top_p < 1.0 else "plain"


def sample_mode(logits: Tensor, t: SamplingTensors, mode: str, vocab_ids: Tensor | None = None) -> Tensor:
    """``sample`` for rows that ``mode`` serves: ``greedy`` is one argmax, ``plain`` races the
    temperature-scaled (min-p filtered) distribution over the whole vocabulary without a sort,
    ``sorted`` is ``sample``. ``vocab_ids``: ``arange(V)`` as a tensor the caller keeps; a
    compiled step passes it in, since Inductor turns an arange inside the graph into its int32
    loop index, and the hash's 64-bit constants times that index fail to compile (torch 2.11)."""
    if mode == "greedy":
        return first_argmax(logits.float())
    if mode == "sorted":
        return sample(logits, t)
    if mode != "plain":
        raise ValueError(f"sampler mode must be one of {MODES}, got {mode!r}")
    logits = logits.float()
    greedy = t.temperature == 0
    temp = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
    probs = softmax(logits / temp.unsqueeze(-1), -1)
    keep = probs >= t.min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    if vocab_ids is None:
        vocab_ids = torch.arange(logits.shape[-1], device=logits.device)
    key = row_key(t.seed, t.position).unsqueeze(-1)
    score = torch.where(keep, probs, torch.zeros_like(probs)) / exponentials(key, vocab_ids.unsqueeze(0))
    return torch.where(greedy, first_argmax(logits), first_argmax(score))


def sample(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Sample one token per row of ``logits`` [B, V]; returns [B] int64, all on the device.

    Order of the filters: temperature, then top-k, then top-p on the top-k-renormalised
    distribution (as vLLM does), then min-p relative to the largest probability. The surviving
    tokens race: token = argmax(p / E) with E ~ Exp(1) i.i.d., which picks token i with probability
    p_i / sum(p) (the first arrival of independent Poisson clocks with rates p), so no
    renormalisation or cumulative search is needed.
    """
    logits = logits.float()
    V = logits.shape[-1]
    greedy_tok = first_argmax(logits)
    greedy = t.temperature == 0
    # Greedy rows still flow through the arithmetic (fixed shapes); a dummy temperature of 1
    # keeps them finite and torch.where discards their result.
    temp = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
    probs = softmax(logits / temp.unsqueeze(-1), -1)

    # One sort serves top-k and top-p; stable so equal probabilities order by vocab id and a
    # row's outcome cannot depend on the sort's treatment of its neighbours.
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device).unsqueeze(0)
    k = torch.where((t.top_k > 0) & (t.top_k < V), t.top_k, torch.full_like(t.top_k, V)).unsqueeze(-1)
    keep = rank < k

    # Top-k keeps a prefix of the sorted row, so the cumulative sum of the raw sorted
    # probabilities already is the top-k one; renormalising means comparing with top_p times the
    # kept mass (the cumsum at rank k-1) instead of dividing. Scanning the plain sort output also
    # sidesteps an Inductor (torch 2.11) codegen failure on a split scan fused with pointwise ops.
    csum = cumsum_over(sorted_p, -1)
    kept_mass = csum.gather(-1, k - 1)
    top_p = t.top_p.unsqueeze(-1)
    # top_p = 1 means off: without the explicit test, float32 rounding of the cumulative sum can
    # reach the total early and silently drop tail tokens. Rank 0 always has mass 0 before it.
    keep = keep & ((csum - sorted_p < top_p * kept_mass) | (top_p >= 1.0))

    keep = keep & (sorted_p >= t.min_p.unsqueeze(-1) * sorted_p[:, :1])

    # The noise is keyed by the original vocab id, so it does not matter that we race in sorted
    # order: each token meets the same E wherever the sort put it.
    key = row_key(t.seed, t.position).unsqueeze(-1)
    score = torch.where(keep, sorted_p, torch.zeros_like(sorted_p)) / exponentials(key, order)
    sampled = order.gather(-1, first_argmax(score).unsqueeze(-1)).squeeze(-1)
    return torch.where(greedy, greedy_tok, sampled)


def apply_token_mask(logits: Tensor, mask: Tensor, vocab_ids: Tensor) -> Tensor:
    """``logits`` [B, V] with every token that ``mask`` (int32 [B, ceil(V / 32)], xgrammar's
    layout: bit i % 32 of word i // 32) leaves out set to -inf. Pure tensor ops, so it fuses into
    the compiled sampler (one pointwise pass) and needs no kernel of its own on any device."""
    bits = (mask[:, vocab_ids >> 5] >> (vocab_ids & 31)) & 1
    return logits.masked_fill(bits == 0, float("-inf"))


def logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities as vLLM reports them: from the raw logits (before temperature and
    filters). Returns (logprob of ``tokens`` [B], top-k ids [B, k], top-k logprobs [B, k])."""
    V = logits.shape[-1]
    if not 0 <= k <= V:
        raise ValueError(f"logprobs: k must be in [0, {V}], got {k}")
    lp = log_softmax(logits.float(), -1)
    token_lp = lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = top_values(lp, k)
    return token_lp, top_ids, top_lp
