"""The Lightning indexer on CUDA: ``deepinfer::indexer_scores``, ``deepinfer::indexer_topk`` and
``deepinfer::topk_mask`` (the top-k of given scores: V4.1's selections).

Scoring: one program scores ``BLOCK_Q`` queries against ``BLOCK_N`` entries. The queries'
heads are the rows of one ``tl.dot`` (``[BLOCK_Q * Hi, di] x [di, BLOCK_N]``, fp32
accumulation), so decode (one query per row of the batch) still fills a tensor-core tile;
ReLU, the head weights and the sum over heads follow in registers. A tile with no visible
entry stores -inf without loading its keys: the entry buffer spans the slot's whole context,
of which a short sequence sees only the start. Keys held in a trained-format state (uint8 rows
of MXFP4 codes and scales, ``io/state_rows.py``) are decoded tile by tile as they are loaded
(``state_rows.load_values``: the values ``RowCodec.unpack`` gives), so the dot runs on exactly
the values it would read from the unpacked keys and the pool is never unpacked whole.

Top-k: one program per query finds the k-th largest score by bisection on an integer image of
the fp32 bits whose order is the float order, counting the entries at or above each candidate
in block loops over the row (32 rounds pin the threshold exactly, with no sort and no scratch
beyond the scores). It then marks every entry above the threshold and, lowest index first, as
many of the entries equal to it as make exactly ``min(k, #visible)``. Only entries above -inf
are eligible, so a non-visible entry is never marked.

A query's scores depend on its own q, weights and keys alone (the tiling depends on Hi and di,
never on T or the batch), and its selection on its own row of scores: results are bitwise the
same alone and in any batch. The scores ``[R, N]`` (fp32, R queries) are a scratch tensor
between the two kernels.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import ops, ops_bi  # noqa: F401  (declares the deepinfer ops before the registrations below)
from ...io.state_rows import RowCodec
from .buffers import out_buffer
from .pdl import pdl_args, wait_previous
from .state_rows import FMT_VALUES, format_args, load_values, words_fit

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Rows of (query, head) pairs per scoring program: two queries at Hi = 64, a tensor-core tile.
_BLOCK_M = 128
_BLOCK_N = 64
_NUM_WARPS = 4
# Entries a top-k program holds per block; a longer row loops (each round re-reads it from cache).
_SELECT_BLOCK = 4096

# The integer image of -inf (0xFF800000 with its magnitude bits flipped, see _order_keys):
# everything eligible lies above it.
_KEY_NEG_INF = -2139095041


@triton.jit
def _scores_kernel(
    q_ptr,
    k_ptr,
    slot_ptr,
    w_ptr,
    v_ptr,
    out_ptr,
    T,
    H,
    N,
    n_tiles,
    q_blocks,
    dot_scale,
    stride_qr,
    stride_qh,
    stride_kc,
    stride_kn,
    stride_wr,
    stride_wh,
    stride_vr,
    stride_vn,
    stride_or,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    KEY_FMT: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    KEY_TAIL: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    KEY_WORDS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    # The entry tiles of one query block are neighbours in launch order: the block's queries stay
    # in cache while its keys (one slot's, small enough for L2) stream past.
    pid = tl.program_id(0)
    tile = pid % n_tiles
    qb = pid // n_tiles
    c = (qb // q_blocks).to(tl.int64)  # the leading (chunk) index; int64: long offsets
    t0 = (qb % q_blocks) * BLOCK_Q
    offs_t = t0 + tl.arange(0, BLOCK_Q)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = c * T + offs_t
    out_mask = (offs_t < T)[:, None] & (offs_n < N)[None, :]
    vis = tl.load(v_ptr + rows[:, None] * stride_vr + offs_n[None, :] * stride_vn, mask=out_mask, other=0) != 0
    scores = tl.full([BLOCK_Q, BLOCK_N], float("-inf"), tl.float32)
    if tl.max(vis.to(tl.int32)) > 0:
        offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
        m_t = t0 + offs_m // BLOCK_H
        m_h = offs_m % BLOCK_H
        m_row = c * T + m_t
        m_ok = (m_t < T) & (m_h < H)
        offs_d = tl.arange(0, BLOCK_D)
        in_d = offs_d < D
        # Padded heads and queries load zeros (weight 0 too), so they add exactly 0 to the sum.
        q = tl.load(
            q_ptr + m_row[:, None] * stride_qr + m_h[:, None] * stride_qh + offs_d[None, :],
            mask=m_ok[:, None] & in_d[None, :],
            other=0.0,
        )
        kc = tl.load(slot_ptr + c).to(tl.int64) if HAS_SLOTS else c  # the chunk's keys: its pool slot
        key_rows = k_ptr + kc * stride_kc + offs_n * stride_kn
        if KEY_FMT == FMT_VALUES:
            keys = tl.load(key_rows[:, None] + offs_d[None, :], mask=(offs_n < N)[:, None] & in_d[None, :], other=0.0)
        else:  # uint8 rows: their values in fp32 (exact), in q's dtype as unpacked ones would be
            keys = load_values(key_rows, offs_n < N, KEY_FMT, KEY_BLOCK, KEY_TAIL, D, BLOCK_D, VALUE_BYTES, KEY_WORDS)
            if not DOT_FP32:
                keys = keys.to(q.dtype)
        if DOT_FP32:
            dots = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(q, tl.trans(keys))
        w = tl.load(w_ptr + m_row * stride_wr + m_h * stride_wh, mask=m_ok, other=0.0).to(tl.float32) * dot_scale
        weighted = tl.maximum(dots, 0.0) * w[:, None]
        total = tl.sum(tl.reshape(weighted, [BLOCK_Q, BLOCK_H, BLOCK_N]), axis=1)
        scores = tl.where(vis, total, float("-inf"))
    tl.store(out_ptr + rows[:, None] * stride_or + offs_n[None, :], scores, mask=out_mask)


@triton.jit
def _order_keys(row_ptr, start, n, BLOCK: tl.constexpr):
    """A block of scores as int32 keys whose signed order is the float order (-0.0 is taken as
    +0.0, so the two tie as they do for torch); past the row's end, the key of -inf."""
    offs = start + tl.arange(0, BLOCK)
    s = tl.load(row_ptr + offs, mask=offs < n, other=float("-inf"))
    bits = tl.where(s == 0.0, 0, s.to(tl.int32, bitcast=True))
    # a negative float's magnitude bits grow as it falls: flip them
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_at_least(row_ptr, n, threshold, BLOCK: tl.constexpr):
    count = 0
    for start in range(0, n, BLOCK):
        count += tl.sum((_order_keys(row_ptr, start, n, BLOCK) >= threshold).to(tl.int32), axis=0)
    return count


@triton.jit
def _topk_mask_kernel(
    s_ptr, out_ptr, n, k, stride_sr, stride_or, KEY_NEG_INF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_sr
    n_vis = _count_at_least(s_row, n, KEY_NEG_INF + 1, BLOCK)
    # With at most k eligible, all of them: the threshold is -inf's key, nothing ties at it.
    threshold = tl.full([], KEY_NEG_INF, tl.int32)
    n_above = n_vis  # entries with a key above the threshold
    if n_vis > k:
        # Invariant: at least k keys >= lo, fewer than k >= hi (n_above of them). The span is
        # below 2**32, so 32 halvings leave hi = lo + 1 and lo is the k-th largest key.
        lo = tl.full([], KEY_NEG_INF + 1, tl.int64)
        hi = tl.full([], 2**31, tl.int64)
        n_above = tl.full([], 0, tl.int32)
        for _ in range(32):
            mid = (lo + hi) >> 1
            count = _count_at_least(s_row, n, mid.to(tl.int32), BLOCK)
            keep_lo = count >= k
            lo = tl.where(keep_lo, mid, lo)
            hi = tl.where(keep_lo, hi, mid)
            n_above = tl.where(keep_lo, n_above, count)
        threshold = lo.to(tl.int32)
    ties_wanted = tl.minimum(n_vis, k) - n_above
    ties_before = 0
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key = _order_keys(s_row, start, n, BLOCK)
        tie = (key == threshold).to(tl.int32)
        rank = ties_before + tl.cumsum(tie, axis=0)  # 1-based among the ties, in index order
        chosen = (key > threshold) | ((tie != 0) & (rank <= ties_wanted))
        tl.store(out_ptr + row * stride_or + offs, chosen.to(tl.uint8), mask=offs < n)
        ties_before += tl.sum(tie, axis=0)


def indexer_scores_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    dot_scale: float = 1.0,
    slots: Optional[torch.Tensor] = None,
    key_rows: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``graphs/indexer.py::index_scores`` for q ``[..., T, Hi, di]``, keys ``[..., N, di]``,
    head_w ``[..., T, Hi]``, visible bool ``[..., T, N]``: fp32 ``[..., T, N]``, -inf where not
    visible, written into ``out`` (contiguous fp32) if given. With ``slots`` ``[C]`` (q
    ``[C, T, Hi, di]``) keys is a pool ``[S, N, di]``, chunk c reading slot ``slots[c]``. With
    ``key_rows`` (a ``RowCodec.spec``) keys are uint8 rows ``[..., N, nbytes]`` of that layout,
    decoded as they are loaded: the scores of their unpacked values in q's dtype, bit for bit."""
    *lead, t, h, d = q.shape
    n = keys.shape[-2]
    codec = None if key_rows is None else RowCodec.from_spec(key_rows, d)
    width = d if codec is None else codec.nbytes(q.dtype)
    if codec is not None and (keys.dtype != torch.uint8 or keys.shape[-1] != width):
        raise ValueError(
            f"indexer: keys held as {key_rows!r} rows of {d} values are uint8 [..., N, {width}] "
            f"(at q's {q.dtype}), got {keys.dtype} {tuple(keys.shape)}"
        )
    if codec is not None and codec.tail and q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"indexer: rows {key_rows!r} keep a tail, which the kernel reads in bf16 or fp32, not {q.dtype}"
        )
    key_lead = lead if slots is None else [keys.shape[0]]
    bad_slots = slots is not None and (len(lead) != 1 or list(slots.shape) != lead or slots.dtype.is_floating_point)
    if (
        list(keys.shape) != [*key_lead, n, width]
        or list(head_w.shape) != [*lead, t, h]
        or list(visible.shape) != [*lead, t, n]
        or bad_slots
    ):
        shapes = f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, head_w {tuple(head_w.shape)}, visible {tuple(visible.shape)}"
        if slots is not None:
            shapes += f", slots {tuple(slots.shape)} {slots.dtype}"
        raise ValueError(f"indexer: mismatched shapes {shapes}")
    out = out_buffer(out, visible.shape, torch.float32, q.device, "indexer")
    if out.numel() == 0:
        return out
    rows = out.numel() // n
    chunks = rows // t
    slots = None if slots is None else slots.contiguous()
    q2 = _last_dim_contiguous(q.reshape(rows, h, d))
    k2 = _last_dim_contiguous(keys.reshape(-1, n, width))
    w2 = head_w.reshape(rows, h)
    v2 = visible.reshape(rows, n).view(torch.uint8)
    o2 = out.view(rows, n)
    block_h = triton.next_power_of_2(h)
    block_q = max(1, _BLOCK_M // block_h)
    n_tiles = triton.cdiv(n, _BLOCK_N)
    q_blocks = triton.cdiv(t, block_q)
    # fp32 operands take the exact (non-tf32) dot; the interpreter has no bf16 dot at all. Packed
    # keys are decoded into q's dtype: the dot of their unpacked values.
    dot_fp32 = _INTERPRET or q.dtype == torch.float32 or (codec is None and q.dtype != keys.dtype)
    key_fmt, key_block, key_tail = format_args(codec)
    _scores_kernel[(chunks * q_blocks * n_tiles,)](
        q2,
        k2,
        slots,
        w2,
        v2,
        o2,
        t,
        h,
        n,
        n_tiles,
        q_blocks,
        float(dot_scale),
        q2.stride(0),
        q2.stride(1),
        k2.stride(0),
        k2.stride(1),
        w2.stride(0),
        w2.stride(1),
        v2.stride(0),
        v2.stride(1),
        o2.stride(0),
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        D=d,
        DOT_FP32=dot_fp32,
        HAS_SLOTS=slots is not None,
        KEY_FMT=key_fmt,
        KEY_BLOCK=key_block,
        KEY_TAIL=key_tail,
        VALUE_BYTES=q.dtype.itemsize,
        KEY_WORDS=words_fit(codec, k2),
        num_warps=_NUM_WARPS,
        **pdl_args(q.device),
    )
    return out


def topk_mask_triton(
    scores: torch.Tensor, k: int, out: Optional[torch.Tensor] = None, *, block: Optional[int] = None
) -> torch.Tensor:
    """Bool like ``scores`` (fp32 ``[..., N]``): per row the ``k`` largest entries above -inf,
    ties at the k-th value taken lowest index first; all of them where at most k are.
    ``out`` (contiguous bool) receives it if given; ``block`` (entries per block, a power of
    two) defaults to the row, up to 4096; tests set it small to reach the block loops."""
    n = scores.shape[-1]
    out = out_buffer(out, scores.shape, torch.bool, scores.device, "topk_mask")
    if scores.dtype != torch.float32:
        raise ValueError(f"topk_mask: scores must be fp32, got {scores.dtype}")
    if out.numel() == 0:
        return out
    if k <= 0:
        return out.zero_()
    rows = scores.numel() // n
    s2 = _last_dim_contiguous(scores.reshape(rows, n))
    o2 = out.view(rows, n).view(torch.uint8)
    block = min(triton.next_power_of_2(n), _SELECT_BLOCK) if block is None else block
    _topk_mask_kernel[(rows,)](
        s2,
        o2,
        n,
        min(k, n),
        s2.stride(0),
        o2.stride(0),
        KEY_NEG_INF=_KEY_NEG_INF,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        **pdl_args(scores.device),
    )
    return out


def indexer_topk_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    slots: Optional[torch.Tensor] = None,
    key_rows: Optional[str] = None,
) -> torch.Tensor:
    """``graphs/indexer.py::score_topk``: the scoring kernel, then the top-k kernel on its scores."""
    if k <= 0 or visible.shape[-1] == 0:
        return torch.zeros_like(visible)
    return topk_mask_triton(indexer_scores_triton(q, keys, head_w, visible, 1.0, slots, key_rows), k)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


torch.library.register_kernel("deepinfer::indexer_scores", "cuda", indexer_scores_triton)
# Batch-invariant inference scores with the same kernel: its tiling never follows the batch.
torch.library.register_kernel("deepinfer::bi_index_scores", "cuda", indexer_scores_triton)
torch.library.register_kernel("deepinfer::topk_mask", "cuda", topk_mask_triton)
torch.library.register_kernel("deepinfer::indexer_topk", "cuda", indexer_topk_triton)
