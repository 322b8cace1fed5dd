"""The custom ops the fast paths swap in, declared once in the ``deepinfer`` namespace.

Each op has a pure-torch reference (registered for every device through ``custom_op``'s
default kernel, i.e. CompositeExplicitAutograd, so it runs on CPU and CUDA alike) and a fake
implementation that only computes output metadata, so torch.compile traces through the op
without running it. Accelerator kernels (Triton, torch_npu) later register per-device kernels
on top of these and are tested against the references here.

Where the model already has the math as a function in ``graphs/`` the op is declared from it
(``declare.declare_op``: its signature, its math), so the op cannot drift from the model;
``tests/compile/test_ops.py`` pins every op to its graphs function.

The ops are inference-only: no autograd formula is registered (``custom_op`` then raises on
backward rather than silently returning wrong gradients).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..graphs.attention import mqa_ring, mqa_with_sink
from ..graphs.indexer import index_scores, score_topk, top_k_mask
from ..graphs.mhc import sinkhorn
from ..graphs.moe import route_weights, routed_experts, shared_expert, swiglu_act
from ..graphs.norm import rms_norm as _graphs_rms_norm
from .declare import declare_op

# ``weight * x / rms(x)`` over the last dim, fp32 statistics, result in x's dtype.
rms_norm = declare_op("rms_norm", _graphs_rms_norm, lambda x, **_: torch.empty_like(x))

# ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (limit 0: no clamps).
swiglu_clamp = declare_op(
    "swiglu_clamp",
    swiglu_act,
    lambda gate, up, **_: gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=torch.float32),
)

# logits ``[..., n, n]`` -> the doubly-stochastic ``comb`` of ``graphs/mhc.py::mhc_coeffs``, in fp32.
mhc_sinkhorn = declare_op(
    "mhc_sinkhorn", sinkhorn, lambda logits, **_: logits.new_empty(logits.shape, dtype=torch.float32)
)

# q ``[..., T, H, d]`` over shared K = V ``[..., N, d]`` under an additive bias ``[..., T, N]``
# with a per-head sink (``graphs/attention.py::mqa_with_sink``); ``ring_mqa``: decode attention
# over the window ring and the entry pool where they lie (``mqa_ring``). einsum may hand back a
# permuted view; the fake promises a contiguous tensor (``fresh``).
sparse_mqa = declare_op("sparse_mqa", mqa_with_sink, lambda q, **_: q.new_empty(q.shape), fresh=True)
ring_mqa = declare_op("ring_mqa", mqa_ring, lambda q, **_: q.new_empty(q.shape), fresh=True)

# Boolean ``[T, N]``: per query the top ``k`` visible entries by the V4 indexer score
# (``graphs/indexer.py::score_topk``); ``indexer_scores``: the fp32 scores before the top-k, -inf
# where not visible (``index_scores``; V4.1 selects from them in two levels).
indexer_topk = declare_op(
    "indexer_topk", score_topk, lambda visible, **_: visible.new_empty(visible.shape, dtype=torch.bool)
)
indexer_scores = declare_op(
    "indexer_scores",
    index_scores,
    lambda q, visible, **_: q.new_empty(visible.shape, dtype=torch.float32),
    fresh=True,
)
# Bool ``[..., N]``: per row the ``k`` largest fp32 scores above -inf (``graphs/indexer.py::top_k_mask``,
# V4.1's selections); the kernel is the one ``indexer_topk`` runs after its scores.
topk_mask = declare_op("topk_mask", top_k_mask, lambda scores, **_: scores.new_empty(scores.shape, dtype=torch.bool))


def topk_mask_unserved(scores: torch.Tensor, k: int) -> str | None:
    """Why the top-k kernel cannot serve a call, or None: it reads fp32 scores."""
    return None if scores.dtype == torch.float32 else f"scores in {scores.dtype}: the top-k kernel reads fp32"


# --- routed MoE experts ----------------------------------------------------------------------

EXPERTS = ("w1", "w3", "w2")  # a routed expert's weights: gate and up [E, I, D], down [E, D, I]


def experts_op(
    name: str, weights: tuple[str, ...], math: Callable[..., torch.Tensor], *extra: tuple[str, type]
) -> torch._library.custom_ops.CustomOpDef:
    """Declare ``deepinfer::<name>(x, *weights, idx, weight, limit, *extra)`` -> fp32 ``[T, D]``:
    x ``[T, D]`` through the routed experts ``idx`` ``[T, k]``, the routing ``weight`` scaling
    the hidden activation before w2 and the sum over the k experts accumulating in fp32. The
    family's arguments are spelled here once (the Triton launchers, ``kernels/triton/moe.py``,
    take them in this order); ``math(x, weights_by_name, idx, weight, limit, *extra)``."""
    arg = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = [("x", torch.Tensor), *((w, torch.Tensor) for w in weights)]
    names += [("idx", torch.Tensor), ("weight", torch.Tensor), ("limit", float), *extra]
    sig = inspect.Signature([inspect.Parameter(n, arg, annotation=t) for n, t in names], return_annotation=torch.Tensor)

    def reference(*args: Any, **kwargs: Any) -> torch.Tensor:
        a = sig.bind(*args, **kwargs).arguments
        return math(a["x"], {w: a[w] for w in weights}, a["idx"], a["weight"], a["limit"], *(a[n] for n, _ in extra))

    reference.__signature__ = sig  # type: ignore[attr-defined]
    return declare_op(name, reference, lambda x, **_: x.new_empty(x.shape, dtype=torch.float32))


moe_experts = experts_op(
    "moe_experts", EXPERTS, lambda x, w, idx, weight, limit: routed_experts.reference(w, limit, x, idx, weight)
)


def _with_shared(x: torch.Tensor, w: dict, idx: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    routed = routed_experts.reference({n: w[n] for n in EXPERTS}, limit, x, idx, weight)
    return routed + shared_expert({n: w[f"s{n}"] for n in EXPERTS}, limit, x).float()


# ``moe_experts`` plus the shared expert (sw1/sw3 ``[I, D]``, sw2 ``[D, I]``, the routed experts'
# dtype and I) added to each token's routed sum in fp32, the order of
# ``graphs/moe.py::experts_with_shared``; one op so that a kernel can run the shared expert as one
# more routed expert that every token takes with weight 1.
moe_experts_shared = experts_op("moe_experts_shared", (*EXPERTS, "sw1", "sw3", "sw2"), _with_shared)


# --- Router ------------------------------------------------------------------------------------

# The router kernel holds a token's logits in one program's registers, up to this many experts.
ROUTE_MAX_EXPERTS = 1024
ROUTE_KINDS = ("sqrtsoftplus", "sigmoid", "softmax")


def route_unserved(n_experts: int, k: int, kind: str, hashed: bool, has_bias: bool) -> str | None:
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


def _route_fake(logits: torch.Tensor, k: int, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return logits.new_empty((t, k), dtype=torch.int64), logits.new_empty((t, k), dtype=torch.float32)


# Expert ids ``[T, k]`` and routing weights ``[T, k]`` from router logits
# (``graphs/moe.py::route_weights``); ``ids`` given (hash layers), a copy of them is the choice.
route_topk = declare_op("route_topk", route_weights, _route_fake, fresh=True)


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
        "topk_mask",
        "moe_experts",
        "moe_experts_shared",
        "route_topk",
    )
}
