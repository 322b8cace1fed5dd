"""The MoE router's choice and weights as one Triton kernel: the CUDA implementation of
``deepinfer::route_topk`` (``graphs/moe.py::route_weights``).

Compiled as written, a layer's routing after the gate GEMV is up to four launches: scores plus
bias, torch.topk's radix select, the gather and sum, the normalisation. In the H200 profile of a
P8 decode step at batch 1 they were 26 launches and ~59 us a step, 4.8 us of every learned
layer in ``gatherTopK`` alone (``bench/results/p8_vs_hf_s9.json``). Here a program holds one
token's E logits in registers and does all of it: the scores, then k rounds of "the largest
score + bias, the lowest expert id on a tie", the chosen scores summed in that order. A P8
decode step with it against the traced routing (two ABBA rounds of separate processes, one
call, random weights, PDL on; ``bench/results/router_bt1_ab_s10.json``): b1 2.169 against
2.196 ms (spreads 3 and 1 us), b8 4.912 against 4.969 ms (spread 92 us: not resolved).

The ids come out in descending order of ``score + bias``; torch.topk(sorted=False) leaves its
order unspecified, and since each token's k expert results are summed in id order, the bits of
the MoE output can differ from the unswapped path's in the last place. The weights are within a
few ulp of the reference (its exp/log/sqrt are other implementations). Every row is computed on
its own (max/min are exact, the k-sum is sequential, the tiling reads shapes only), so a
token's ids and weights are the same bits alone or in any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import ROUTE_KINDS, route_unserved  # (importing it declares deepinfer::route_topk before we register for it)
from ...graphs.moe import route_weights
from .pdl import pdl_args, wait_previous

_reference = getattr(route_weights, "reference", route_weights)

_KINDS = {kind: i for i, kind in enumerate(ROUTE_KINDS)}  # the kernel's KIND: 0 sqrtsoftplus, 1 sigmoid, 2 softmax
# One token a program: the k rounds are a chain of dependent reductions, and 8 tokens on one
# warp (the first version) compiled to 2751 PTX instructions with 480 shuffles and took 8.6 us
# a launch on the H200 at decode (bench/results/router_ab_s9.json); one token compiles to 385
# with 60.
_ELEMS_PER_WARP = 256


@triton.jit
def _log1p(y):
    """log(1 + y) for y >= 0 to a few ulp (log(u) * y / (u - 1) with u = 1 + y rounded)."""
    u = 1.0 + y
    d = tl.where(u == 1.0, 1.0, u - 1.0)  # the unused branch must not divide by zero
    return tl.where(u == 1.0, y, tl.log(u) * tl.div_rn(y, d))


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    idx_ptr,
    w_ptr,
    n_tokens,
    stride_l,
    stride_ids,
    temp,
    scale,
    E: tl.constexpr,
    EP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    KIND: tl.constexpr,
    HASHED: tl.constexpr,
    NORM: tl.constexpr,
    BT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    row_ok = rows < n_tokens
    e = tl.arange(0, EP)
    e_ok = e < E
    x = tl.load(logits_ptr + rows[:, None] * stride_l + e[None, :], mask=row_ok[:, None] & e_ok[None, :], other=0.0)
    x = tl.div_rn(x.to(tl.float32), temp)
    if KIND == 0:  # sqrt(softplus(x)), softplus with torch's threshold of 20
        soft = tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))
        score = tl.sqrt_rn(tl.where(x > 20.0, x, soft))
    elif KIND == 1:
        score = tl.div_rn(1.0, 1.0 + tl.exp(-x))
    else:
        z = tl.where(e_ok[None, :], x, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        score = tl.div_rn(p, tl.sum(p, axis=1)[:, None])
    kk = tl.arange(0, KP)
    ids = tl.zeros([BT, KP], tl.int64)
    ws = tl.zeros([BT, KP], tl.float32)
    total = tl.zeros([BT], tl.float32)
    if not HASHED:
        bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
        sel = tl.where(e_ok[None, :], score + bias[None, :], float("-inf"))
    for r in tl.static_range(K):
        if HASHED:
            j = tl.load(ids_ptr + rows * stride_ids + r, mask=row_ok, other=0)
        else:
            top = tl.max(sel, axis=1)
            # the lowest id among the largest; min(.., E - 1) keeps a NaN row's ids in range
            j = tl.minimum(tl.min(tl.where(sel == top[:, None], e[None, :], EP), axis=1), E - 1).to(tl.int64)
            sel = tl.where(e[None, :] == j[:, None], float("-inf"), sel)
        wj = tl.sum(tl.where(e[None, :] == j[:, None], score, 0.0), axis=1)  # one term: exact
        total += wj
        ids = tl.where(kk[None, :] == r, j[:, None], ids)
        ws = tl.where(kk[None, :] == r, wj[:, None], ws)
    if NORM:
        ws = tl.div_rn(ws, total[:, None] + 1e-20)
    out = rows[:, None] * K + kk[None, :]
    ok = row_ok[:, None] & (kk[None, :] < K)
    tl.store(idx_ptr + out, ids, mask=ok)
    tl.store(w_ptr + out, ws * scale, mask=ok)


def route_topk_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor | None,
    k: int,
    kind: str,
    temp: float,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_weights`` in one launch: ids ``[T, k]`` int64 and weights ``[T, k]`` fp32. Shapes
    it does not tile (``ops.route_unserved``: too many experts, an unknown kind) go to the reference."""
    t, n_exp = logits.shape
    if route_unserved(n_exp, k, kind, ids is not None, bias is not None):
        idx, w = _reference(logits, bias, ids, k, kind, temp, norm, scale)
        return (idx if ids is None else idx.clone()), w
    idx = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    w = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return idx, w
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    hashed = ids is not None
    ids_rows = ids.contiguous() if hashed else idx  # unread without ids
    ep = triton.next_power_of_2(n_exp)
    _route_kernel[(t,)](
        logits,
        logits if bias is None else bias.contiguous(),
        ids_rows,
        idx,
        w,
        t,
        logits.stride(0),
        ids_rows.stride(0),
        float(temp),
        float(scale),
        E=n_exp,
        EP=ep,
        K=k,
        KP=triton.next_power_of_2(k),
        KIND=_KINDS[kind],
        HASHED=hashed,
        NORM=bool(norm),
        BT=1,
        num_warps=max(1, min(4, ep // _ELEMS_PER_WARP)),
        **pdl_args(logits.device),
    )
    return idx, w


torch.library.register_kernel("deepinfer::route_topk", "cuda", route_topk_triton)
