"""MoE FFN: a router (learned top-k with a selection-only bias, or a fixed hash table on the
first layers), routed SwiGLU experts with clamps, and an always-on shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .norm import linear, linear_fp32


def _score(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def route(p: dict, c: ModelConfig, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> expert ids ``[T, k]`` and routing weights ``[T, k]`` (fp32)."""
    gate = p["gate"]
    scores = _score(linear_fp32(x, gate["weight"]) / c.gate_temp, c.scoring_func)
    if "tid2eid" in gate:
        idx = gate["tid2eid"][token_ids].long()
    else:
        idx = torch.topk(scores + gate["bias"].float(), c.num_experts_per_tok, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    if c.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * c.routed_scaling_factor


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (limit 0: no clamps)."""
    g, u = gate.float(), up.float()
    if limit:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    return swiglu_act(linear(x, w1), linear(x, w3), limit)


def routed_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference routed experts: loop over the experts that received tokens. The routing weight
    scales the hidden activation before w2, as the official reference does."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        h = swiglu(x[tok], p["w1"][e], p["w3"][e], limit) * w[tok, slot, None]
        out.index_add_(0, tok, linear(h.to(x.dtype), p["w2"][e]).float())
    return out


def moe(p: dict, c: ModelConfig, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    idx, w = route(p, c, x, token_ids)
    routed = routed_experts(p["experts"], c.swiglu_limit, x, idx, w)
    sh = p["shared_experts"]
    shared = linear(swiglu(x, sh["w1"], sh["w3"], c.swiglu_limit).to(x.dtype), sh["w2"])
    return (routed + shared.float()).to(x.dtype)
