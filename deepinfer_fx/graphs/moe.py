"""MoE FFN: a router (learned top-k with a selection-only bias, or a fixed hash table on the
first layers), routed SwiGLU experts with clamps, and an always-on shared expert.

Two nested swap places hold the experts: ``experts_with_shared`` (routed + shared expert, where a
kernel may run the shared expert as one more routed expert that every token takes, saving its
own launches) around ``expert_parallel`` (the routed experts alone, which expert parallelism
replaces with its dispatch and combine)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..io.quant import dequant_fp8_block, dequant_mxfp4, fp8_block_of
from .norm import held, linear, linear_fp32
from .param_spec import scale_path
from .pointwise import sigmoid, silu, softmax, softplus
from .swap import swappable

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def held_format(p: dict) -> str | None:
    """How routed experts ``p`` are held (``load_model(..., expert_format=...)``): "fp8"
    (float8_e4m3fn with fp32 block scales), "fp4" (MXFP4 bytes with ue8m0 scales) or None
    (dequantised)."""
    if scale_path("w1") not in p:
        return None
    return "fp8" if p["w1"].dtype == torch.float8_e4m3fn else "fp4"


def dequant_experts(p: dict, dtype: torch.dtype) -> dict:
    """Held experts ``p`` in ``dtype``: the values a load with ``expert_format="dequant"`` holds."""
    if held_format(p) == "fp8":
        return {
            n: dequant_fp8_block(p[n], p[scale_path(n)], fp8_block_of(p[n].shape, p[scale_path(n)].shape), dtype)
            for n in EXPERT_WEIGHTS
        }
    return {n: dequant_mxfp4(p[n], p[scale_path(n)], dtype) for n in EXPERT_WEIGHTS}


def _score(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return softplus(logits).sqrt()
    if kind == "sigmoid":
        return sigmoid(logits)
    return softmax(logits, -1)


def route(
    p: dict, c: ModelConfig, x: torch.Tensor, token_ids: torch.Tensor, image_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> expert ids ``[T, k]`` and routing weights ``[T, k]`` (fp32). ``image_rows`` ``[T]``
    bool (V4.1): those rows choose their experts with ``bias_vl`` instead of ``bias``."""
    gate = p["gate"]
    logits = linear_fp32(x, gate["weight"])
    if "tid2eid" in gate:
        return route_weights(
            logits,
            None,
            gate["tid2eid"][token_ids].long(),
            c.num_experts_per_tok,
            c.scoring_func,
            c.gate_temp,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
    args = (c.num_experts_per_tok, c.scoring_func, c.gate_temp, c.norm_topk_prob, c.routed_scaling_factor)
    idx, w = route_weights(logits, gate["bias"], None, *args)
    if image_rows is None:
        return idx, w
    # two selections rather than a per-row bias: route_weights (and its kernel) takes one bias vector
    idx_vl, w_vl = route_weights(logits, gate["bias_vl"], None, *args)
    pick = image_rows[:, None]
    return torch.where(pick, idx_vl, idx), torch.where(pick, w_vl, w)


@swappable
def route_weights(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor | None,
    k: int,
    kind: str,
    temp: float,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` (fp32) -> expert ids ``[T, k]`` (int64) and weights ``[T, k]``
    (fp32): scores ``kind(logits / temp)``; the k largest ``scores + bias`` choose the experts
    unless ``ids`` (hash layers) gives them; the weights are the chosen scores, divided by their
    sum when ``norm``, times ``scale``."""
    scores = _score(logits / temp, kind)
    idx = ids if ids is not None else torch.topk(scores + bias.float(), k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scale


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (limit 0: no clamps)."""
    g, u = gate.float(), up.float()
    if limit:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return silu(g) * u


def swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
    s1: torch.Tensor | None = None,
    s3: torch.Tensor | None = None,
) -> torch.Tensor:
    """``swiglu_act`` of x's two projections; ``s1`` / ``s3``: block scales of weights held in FP8."""
    return swiglu_act(linear(x, w1, s1), linear(x, w3, s3), limit)


@swappable
def routed_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Routed experts as grouped GEMMs over the (token, k) pairs sorted by expert. Static shapes
    and no host synchronisation, so the same code runs eagerly, compiled and in CUDA graphs.
    The routing weight scales the hidden activation before w2, as the official reference does;
    each token's k results are summed in a fixed order (no atomics: batch-invariant). Experts
    held as stored (fp8, fp4) are dequantised to the activation dtype on every call
    (``dequant_experts``); compiled steps on a GPU run the kernel of their format instead
    (the ``moe_experts_kernel`` swap)."""
    if held_format(p):
        p = dequant_experts(p, x.dtype)
    t, k = idx.shape
    n_exp = p["w1"].shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_exp, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    groups = (torch.cumsum(counts, 0, dtype=torch.int32), flat[order])
    xs = x[order // k]
    h = swiglu_act(_grouped(xs, p["w1"], groups), _grouped(xs, p["w3"], groups), limit) * w.reshape(-1)[order, None]
    y = _grouped(h.to(x.dtype), p["w2"], groups).float()
    out = torch.empty_like(y)
    out[order] = y
    return out.view(t, k, y.shape[-1]).sum(1)


def _grouped(x: torch.Tensor, w: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times ``w[e].T`` (``w`` stacked ``[E, out, in]``, the
    checkpoint's linear layout). ``groups``: each expert's end offset and each row's expert.
    bf16 runs torch's grouped GEMM; other dtypes (fp32, which that kernel does not take)
    multiply each row by its gathered expert matrix, except eager steps on a GPU: there the
    gathered matrices of a model-sized batch would not fit (hundreds of GiB), so each expert's
    rows are multiplied in turn, reading the group ends on the host (never inside a graph)."""
    offs, expert = groups
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w.to(x.dtype).transpose(-2, -1), offs=offs)
    if x.is_cuda and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
        ends = offs.tolist()
        return torch.cat([x[a:b] @ w[e].to(x.dtype).T for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
    return torch.einsum("pi,poi->po", x, w.to(x.dtype)[expert])


@swappable
def expert_parallel(
    p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """The region expert parallelism replaces with dispatch -> local experts -> combine
    (``sharding/ep.py``); in one process every expert is local. ``real`` ``[T]`` bool marks the
    rows that are tokens rather than a compiled bucket's padding: the dispatch sends no pair of
    a padding row (its capacity is sized for real tokens); here every row is computed alike."""
    return routed_experts(p, limit, x, idx, w)


def shared_expert(p: dict, limit: float, x: torch.Tensor) -> torch.Tensor:
    """The always-on shared expert (dense weights ``[I, D]``, ``[I, D]``, ``[D, I]``), in x's
    dtype: the same SwiGLU-with-clamp as a routed expert with routing weight 1."""
    h = swiglu(x, p["w1"], p["w3"], limit, p.get("w1_scale"), p.get("w3_scale"))
    return linear(h.to(x.dtype), *held(p, "w2"))


@swappable
def experts_with_shared(
    pe: dict, ps: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """The routed experts ``pe`` plus the shared expert ``ps`` -> fp32 ``[T, D]``: each token's
    routed sum first, then its shared output. A place of its own because a kernel can run the
    shared expert as one more routed expert inside the routed launches (``passes/swaps.py``);
    ``real`` as in ``expert_parallel``."""
    return expert_parallel(pe, limit, x, idx, w, real) + shared_expert(ps, limit, x).float()


def moe(
    p: dict,
    c: ModelConfig,
    x: torch.Tensor,
    token_ids: torch.Tensor,
    real: torch.Tensor,
    image_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FFN sublayer; ``real`` as in ``expert_parallel``, ``image_rows`` as in ``route``."""
    idx, w = route(p, c, x, token_ids, image_rows)
    return experts_with_shared(p["experts"], p["shared_experts"], c.swiglu_limit, x, idx, w, real).to(x.dtype)
