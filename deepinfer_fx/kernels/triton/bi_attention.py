"""``deepinfer::bi_attend`` on CUDA (``kernels/ops_bi.py``): multi-query attention with a sink over
each query's visible keys taken in the canonical order (``graphs/batch_invariant.py::
canonical_order``), for batch-invariant inference (``passes/batch_invariant.py``).

One program holds one query and a block of ``BH`` heads (``heads_per_program``; their fp32
accumulator stays in registers) and walks the query's visible keys ``keys[c, order[c, t, j]]``, j from 0 to
``count[c, t]``, in tiles of ``BN`` gathered rows, with an online softmax (running max, rescaled
sum and accumulator) in fp32; the sink joins the denominator once, after the last tile.

Why a query's bits depend only on its own operands (q[c, t, h], its visible key sequence and
sink[h]): key j always sits at row ``j % BN`` of tile ``j // BN``, whatever N, C, T or the hidden
keys are, since ``order`` lists the visible keys first; the loop stops at ``count``, so a hidden key
is never read, and a tile's rows past it are exact zeros at the same places for the same sequence;
the keys are never split across programs and nothing is accumulated atomically; a tensor-core MMA
reduces each output element alike in whichever row of the tile it sits; and the tiles, warps and
stages are functions of H, D and the dtypes, never of C, T or N. fp32 operands multiply in IEEE
fp32 (no TF32). Like the batch-invariant matmul, simple by design: no split-K/flash-decoding, no
skipped tiles, no PDL.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import ops_bi  # noqa: F401  (declares deepinfer::bi_attend before we register for it)

# Functions of the model's widths, never of C, T or N (which would move a query's bits). At the
# released widths (D 512, bf16, 64 or 128 heads) a program takes 64 heads: each gathered key tile
# then serves four times the heads, and on an H100 P8's 4096-token prefill attention took 2.1 ms
# against 4.1 with 16 (the two head tilings give different bits, so the choice is one of H and
# the dtypes only). sm_90 offline: 235 registers, no spills, one program an SM at 8 warps and
# 2 stages. fp32 and narrow heads keep 16 heads a program (118 registers, 3 stages: a tile's
# key indices read a tile ahead). The 32-key tile is fixed (64-key tiles spilled).
BN = 32
WARPS = 8


def heads_per_program(h: int, dtype: torch.dtype) -> tuple[int, int]:
    """(heads a program, pipeline stages) for ``h`` heads of ``dtype`` q / keys: never of C, T or N."""
    return (64, 2) if h >= 64 and dtype != torch.float32 else (16, 3)


_LOG2E = math.log2(math.e)


@triton.jit(do_not_specialize=["T"])  # one binary for every T
def _bi_attend_kernel(
    q_ptr,
    k_ptr,
    order_ptr,
    count_ptr,
    sink_ptr,
    out_ptr,
    T,
    H,
    qk_scale,
    sqc,
    sqt,
    sqh,
    sqd,
    skc,
    skn,
    skd,
    soc,
    sot,
    son,
    scc,
    sct,
    BH: tl.constexpr,
    HB: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Head blocks of one query are neighbours in launch order, so the keys they share stay in L2.
    pid = tl.program_id(0)
    row = (pid // HB).to(tl.int64)  # flattened (c, t); int64: long offsets
    c = row // T
    t = row % T
    offs_h = (pid % HB) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BLOCK_D)
    in_h = offs_h < H
    in_d = offs_d < D
    q_rows = q_ptr + c * sqc + t * sqt + offs_h[:, None] * sqh
    q = tl.load(q_rows + offs_d[None, :] * sqd, mask=in_h[:, None] & in_d[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    count = tl.load(count_ptr + c * scc + t * sct)
    order_row = order_ptr + c * soc + t * sot
    k_chunk = k_ptr + c * skc
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BLOCK_D], tl.float32)
    for j0 in range(0, count, BN):
        offs_n = j0 + tl.arange(0, BN)
        seen = offs_n < count
        idx = tl.load(order_row + offs_n * son, mask=seen, other=0)
        k = tl.load(k_chunk + idx[:, None] * skn + offs_d[None, :] * skd, mask=seen[:, None] & in_d[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(seen[None, :], s * qk_scale, float("-inf"))
        # Every tile holds at least one visible key, so m_new is finite and no exp2 sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = tl.dot(p, k, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
        m = m_new
    # The sink in the denominator, against the larger of it and m: no count = 0 (m = -inf) NaN.
    sink = tl.load(sink_ptr + offs_h, mask=in_h, other=0.0).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m, sink)
    w = tl.exp2(m - top)
    out = acc * (w / (l * w + tl.exp2(sink - top)))[:, None]
    out_rows = out_ptr + row * (H * D) + offs_h[:, None] * D
    tl.store(out_rows + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=in_h[:, None] & in_d[None, :])


def bi_attend_triton(
    q: torch.Tensor, keys: torch.Tensor, order: torch.Tensor, count: torch.Tensor, sink: torch.Tensor
) -> torch.Tensor:
    """``graphs/batch_invariant.py::attend_sorted``: q ``[C, T, H, D]`` over the keys ``[C, N, D]``
    (K = V) ``keys[c, order[c, t, :count[c, t]]]`` in that order, order ``[C, T, N]`` and count
    ``[C, T]`` integer, sink ``[H]`` -> ``[C, T, H, D]`` contiguous in q's dtype, each (c, t, h)
    independent of C, T, N and the hidden keys. Inputs may be strided views."""
    c, t, h, d = q.shape
    n = keys.shape[1]
    if (
        list(keys.shape) != [c, n, d]
        or list(order.shape) != [c, t, n]
        or list(count.shape) != [c, t]
        or list(sink.shape) != [h]
    ):
        shapes = f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, order {tuple(order.shape)}, count {tuple(count.shape)}"
        raise ValueError(f"bi_attend: mismatched shapes {shapes}, sink {tuple(sink.shape)}")
    out = torch.empty(c, t, h, d, device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    dot_fp32 = q.dtype == torch.float32 or q.dtype != keys.dtype
    bh, stages = heads_per_program(h, torch.float32 if dot_fp32 else q.dtype)
    head_blocks = triton.cdiv(h, bh)
    _bi_attend_kernel[(c * t * head_blocks,)](
        q,
        keys,
        order,
        count,
        sink,
        out,
        t,
        h,
        d**-0.5 * _LOG2E,
        *q.stride(),
        *keys.stride(),
        *order.stride(),
        *count.stride(),
        BH=bh,
        HB=head_blocks,
        BN=BN,
        BLOCK_D=triton.next_power_of_2(d),
        D=d,
        DOT_FP32=dot_fp32,
        num_warps=WARPS,
        num_stages=stages,
    )
    return out


torch.library.register_kernel("deepinfer::bi_attend", "cuda", bi_attend_triton)
