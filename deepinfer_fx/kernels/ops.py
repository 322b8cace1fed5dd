"""The custom ops the fast paths swap in, declared once in the ``deepinfer`` namespace.

Each op has a pure-torch reference (registered for every device through ``custom_op``'s
default kernel, i.e. CompositeExplicitAutograd, so it runs on CPU and CUDA alike) and a fake
implementation that only computes output metadata, so torch.compile traces through the op
without running it. Accelerator kernels (Triton, torch_npu) later register per-device kernels
on top of these and are tested against the references here.

Where the model already has the math as a function in ``graphs/`` the reference calls it, so
the op cannot drift from the model; where the math sits inline in a larger graphs function
(mHC Sinkhorn, indexer scoring) the reference restates those lines and
``tests/compile/test_ops.py`` pins it to the graphs function.

The ops are inference-only: no autograd formula is registered (``custom_op`` then raises on
backward rather than silently returning wrong gradients).

No ``from __future__ import annotations`` here: ``custom_op`` infers the schema from the real
annotation objects.
"""

from typing import Optional

import torch

from ..graphs.attention import mqa_ring, mqa_with_sink
from ..graphs.indexer import index_scores, score_topk
from ..graphs.mhc import sinkhorn
from ..graphs.moe import route_weights, routed_experts, shared_expert, swiglu_act
from ..graphs.norm import rms_norm as _graphs_rms_norm

NAMESPACE = "deepinfer"


# --- RMSNorm -------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim, fp32 statistics, result in x's dtype."""
    return _graphs_rms_norm(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return torch.empty_like(x)


# --- SwiGLU with clamp -----------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::swiglu_clamp", mutates_args=())
def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (limit 0: no clamps)."""
    return swiglu_act(gate, up, limit)


@swiglu_clamp.register_fake
def _swiglu_clamp_fake(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    shape = torch.broadcast_shapes(gate.shape, up.shape)
    return gate.new_empty(shape, dtype=torch.float32)


# --- mHC Sinkhorn ----------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::mhc_sinkhorn", mutates_args=())
def mhc_sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """logits ``[..., n, n]`` -> the doubly-stochastic ``comb`` of ``graphs/mhc.py::mhc_coeffs``:
    softmax over the last dim plus eps, a column normalisation, then ``iters - 1`` rounds of
    row-then-column normalisation, all in fp32."""
    return sinkhorn.reference(logits, eps, iters)


@mhc_sinkhorn.register_fake
def _mhc_sinkhorn_fake(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    return logits.new_empty(logits.shape, dtype=torch.float32)


# --- sparse MQA with sink --------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::sparse_mqa", mutates_args=())
def sparse_mqa(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """q ``[..., T, H, d]`` over shared K = V ``kv`` ``[..., N, d]`` with additive ``bias``
    ``[..., T, N]`` (0 / -inf selects the window and the chosen compressed entries) and a
    per-head sink ``[H]``; the leading dims are the model's groups of chunks ``[C]``. The
    values' rotary tails are turned back by the queries' rope tables ``cos`` / ``sin``
    ``[..., T, rd/2]``."""
    # einsum may hand back a permuted view; the fake promises a contiguous tensor.
    return mqa_with_sink.reference(q, kv, bias, sink, cos, sin).contiguous()


@sparse_mqa.register_fake
def _sparse_mqa_fake(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{NAMESPACE}::ring_mqa", mutates_args=())
def ring_mqa(
    q: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    entries: Optional[torch.Tensor],
    entry_rows: Optional[torch.Tensor],
    entry_bias: Optional[torch.Tensor],
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Decode attention over the window ring and the entry pool where they lie
    (``graphs/attention.py::mqa_ring``)."""
    return mqa_ring.reference(q, ring, slots, pos, entries, entry_rows, entry_bias, sink, cos, sin).contiguous()


@ring_mqa.register_fake
def _ring_mqa_fake(
    q: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    entries: Optional[torch.Tensor],
    entry_rows: Optional[torch.Tensor],
    entry_bias: Optional[torch.Tensor],
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    return q.new_empty(q.shape)


# --- indexer scoring and top-k ---------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::indexer_topk", mutates_args=())
def indexer_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Boolean ``[T, N]``: per query the top ``k`` visible entries by the V4 score
    ``sum_h head_w[t, h] * relu(q[t, h] . keys[n])`` (the lines of ``graphs/indexer.py``
    after its projections; ``head_w`` already carries the head scaling). With ``slots``, keys
    is a pool read by slot (``index_scores``)."""
    return score_topk.reference(q, keys, head_w, visible, k, slots)


@indexer_topk.register_fake
def _indexer_topk_fake(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return visible.new_empty(visible.shape, dtype=torch.bool)


@torch.library.custom_op(f"{NAMESPACE}::indexer_scores", mutates_args=())
def indexer_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    dot_scale: float,
    slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """fp32 ``[..., T, N]``: the indexer scores before the top-k, -inf where not ``visible``
    (``graphs/indexer.py::index_scores``; V4.1 selects from them in two levels)."""
    # einsum may hand back a permuted view; the fake promises a contiguous tensor.
    return index_scores.reference(q, keys, head_w, visible, dot_scale, slots).contiguous()


@indexer_scores.register_fake
def _indexer_scores_fake(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    dot_scale: float,
    slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return q.new_empty(visible.shape, dtype=torch.float32)


# --- routed MoE experts ----------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x ``[T, D]`` through the routed experts ``idx`` ``[T, k]`` (w1/w3 ``[E, I, D]``,
    w2 ``[E, D, I]``); the routing ``weight`` scales the hidden activation before w2 and the
    sum over the k experts accumulates in fp32, so the result ``[T, D]`` is fp32."""
    experts = {"w1": w1, "w3": w3, "w2": w2}
    return routed_experts.reference(experts, limit, x, idx, weight)


@moe_experts.register_fake
def _moe_experts_fake(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::moe_experts_shared", mutates_args=())
def moe_experts_shared(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    sw1: torch.Tensor,
    sw3: torch.Tensor,
    sw2: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``moe_experts`` plus the shared expert (sw1/sw3 ``[I, D]``, sw2 ``[D, I]``, the routed
    experts' dtype and I) added to each token's routed sum in fp32, the order of
    ``graphs/moe.py::experts_with_shared``; one op so that a kernel can run the shared expert as
    one more routed expert that every token takes with weight 1."""
    routed = routed_experts.reference({"w1": w1, "w3": w3, "w2": w2}, limit, x, idx, weight)
    return routed + shared_expert({"w1": sw1, "w3": sw3, "w2": sw2}, limit, x).float()


@moe_experts_shared.register_fake
def _moe_experts_shared_fake(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    sw1: torch.Tensor,
    sw3: torch.Tensor,
    sw2: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


# --- Router ------------------------------------------------------------------------------------

# The router kernel holds a token's logits in one program's registers, up to this many experts.
ROUTE_MAX_EXPERTS = 1024
ROUTE_KINDS = ("sqrtsoftplus", "sigmoid", "softmax")


def route_unserved(n_experts: int, k: int, kind: str, hashed: bool, has_bias: bool) -> Optional[str]:
    """Why the router kernel cannot serve a layer's routing, or None: too many experts for one
    program, a score function it does not know, or a learned choice (not hashed) without a
    selection bias or with more picks than experts."""
    if n_experts > ROUTE_MAX_EXPERTS:
        return f"{n_experts} experts: the router kernel holds at most {ROUTE_MAX_EXPERTS} a token"
    if kind not in ROUTE_KINDS:
        return f"score function {kind!r}: the router kernel knows {list(ROUTE_KINDS)}"
    if not hashed and not has_bias:
        return "a learned choice without selection bias: the router kernel adds one"
    if not hashed and k > n_experts:
        return f"top-{k} of {n_experts} experts"
    return None


@torch.library.custom_op(f"{NAMESPACE}::route_topk", mutates_args=())
def route_topk(
    logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    ids: Optional[torch.Tensor],
    k: int,
    kind: str,
    temp: float,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids ``[T, k]`` and routing weights ``[T, k]`` from router logits
    (``graphs/moe.py::route_weights``); ``ids`` given (hash layers), they are the choice."""
    idx, w = route_weights.reference(logits, bias, ids, k, kind, temp, norm, scale)
    return (idx if ids is None else idx.clone()), w  # an op's outputs never alias its inputs


@route_topk.register_fake
def _route_topk_fake(
    logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    ids: Optional[torch.Tensor],
    k: int,
    kind: str,
    temp: float,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return logits.new_empty((t, k), dtype=torch.int64), logits.new_empty((t, k), dtype=torch.float32)


# The OpOverloads, for passes that insert calls and for tests that run opcheck on each.
OPS: dict[str, torch._ops.OpOverload] = {
    name: getattr(torch.ops.deepinfer, name).default
    for name in (
        "rms_norm",
        "swiglu_clamp",
        "mhc_sinkhorn",
        "sparse_mqa",
        "ring_mqa",
        "indexer_topk",
        "indexer_scores",
        "moe_experts",
        "moe_experts_shared",
        "route_topk",
    )
}
