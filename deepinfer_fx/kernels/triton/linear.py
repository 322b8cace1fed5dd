"""Skinny GEMM ``y = x @ w.T`` for few rows and a large weight: the CUDA implementation of
``deepinfer::skinny_linear`` (``kernels/ops_linear.py``).

With M <= 64 rows the work is streaming ``w`` ``[N, K]`` once from HBM, so the tiling serves
bandwidth rather than FLOPs (the decode tiles of the MoE kernels, ``moe_kernels.py``): 16-row
blocks (the smallest ``tl.dot`` takes), many programs over N, each streaming its weight tiles
through a software pipeline with fp32 accumulation. When N has too few column tiles to fill the
GPU (about two programs per SM), K is split as well: each split writes an fp32 partial, and the
last split of a tile to finish sums them all (a serial reduction by the last arrival, as in
CUTLASS's split-K semaphore), so every call is one launch: at decode these GEMMs are
launch-bound, and a second launch per call cost ~4 % of the step.

Batch invariance: the tiles and the split depend on N and K only, M is not specialised on, and
every row's dot products run the same k order in every 16-row block, whatever M or the other
rows are; partials are summed in split order, read back from memory whichever split arrives
last (the atomics only elect the summing program, they add no data). So row m's result is the
same bits alone or inside a batch, which decode needs (a request must not change with its
company), and the same bits from run to run. Over a block-FP8 weight, calls of more than 16 rows
take 64-row blocks (``FP8_BM``): there rows 1..16 and rows 17..64 are each invariant.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..ops_linear import MAX_GROUP  # (importing it declares deepinfer::skinny_linear before we register for it)
from ...io.quant import fp8_block_of
from .pdl import pdl_args, prefetch_l2, release_next, wait_only

BM = 16  # rows per block: fixed, never chosen from M (batch invariance)
# Rows per block over a block-FP8 weight for more than BM rows: each program dequantises its
# weight tiles, so one 64-row block a tile does that work once where four 16-row blocks did it
# four times (1.4-1.8x faster at 64 rows, 1.3-1.6x slower at 1-8 on the H100: docs/decisions.md,
# "fp8 projections up to 64 rows"). Rows 1..BM and rows BM+1..64 are each batch-invariant.
FP8_BM = 64
# About two programs per SM of an H200 (132 SMs), as the MoE decode tiles aim for.
_MIN_PROGRAMS = 256
_MAX_SPLIT = 16
# Arrival counters per device (see ``_counters``): a few KiB, so that decode never grows them.
_MIN_COUNTERS = 4096
# With PDL, k tiles of weight each program asks L2 for before it waits on the previous kernel.
_PREFETCH_TILES = 2
_LINE_BYTES = 128


class Tiles(NamedTuple):
    """Launch configuration: column tile, k tile, K splits, warps, pipeline stages, the k
    tiles of weight prefetched into L2 before the PDL wait (``kernels/triton/pdl.py``), and
    whether the weight tiles stream through the Hopper tensor-memory accelerator (``tma``: a
    host tensor descriptor, one asynchronous copy per tile instead of per-thread loads) where
    it applies (one weight, rows 16-byte aligned, sm_90+), and the rows a program takes (``bm``:
    a function of the weight's format, never of M)."""

    bn: int
    bk: int
    split: int
    warps: int
    stages: int
    prefetch: int = _PREFETCH_TILES
    tma: bool = False
    bm: int = BM


def choose_tiles(n: int, k: int, max_bk: int = 128, bm: int = BM) -> Tiles:
    """The tiling for a weight ``[n, k]``; never a function of the row count (``bm`` is the caller's).

    Wide weights (the head, ``wq_b``) fill the GPU with column tiles alone: the widest tile
    that still gives ``_MIN_PROGRAMS`` programs. Narrower ones (``wo_b``, ``wq_a``, ``wkv``)
    take 64- or 32-column tiles and split K until they do, each split keeping at least two k
    tiles; fewer splits where possible, since the partials cost traffic that grows with M.
    Weight tiles come through TMA where the weight allows (measured on the H200, s13: 0.3-0.9
    us faster per wo_b / wq_b call at M = 1 and 8, ``skinny_tma_sweep_s13.json``). ``max_bk``
    caps the k tile (a block-FP8 weight's tiles lie in one scale block)."""
    bk = min(max_bk, max(16, triton.next_power_of_2(k)))
    for bn, stages in ((128, 3), (64, 4), (32, 4)):
        if triton.cdiv(n, bn) >= _MIN_PROGRAMS:
            return Tiles(bn, bk, 1, 4, stages, tma=True, bm=bm)
    bn = 64 if triton.cdiv(n, 64) >= 64 else 32
    split = 1
    while triton.cdiv(n, bn) * split < _MIN_PROGRAMS and split < _MAX_SPLIT and k >= 4 * split * bk:
        split *= 2
    return Tiles(bn, bk, split, 4, 4, tma=True, bm=bm)


@triton.jit(do_not_specialize=["M"])  # M-dependent: one binary for every M
def _skinny_kernel(
    x_ptr,
    w_ptrs,
    out_ptrs,
    ws_ptr,
    count_ptr,
    scale_ptrs,
    M,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    SPLITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    NS: tl.constexpr,
    TILE0: tl.constexpr,
    COL0: tl.constexpr,
    N_ALL: tl.constexpr,
    X_BLOCK_N: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    LINE: tl.constexpr,
    PDL: tl.constexpr,
    SB: tl.constexpr = 0,
    w_desc=None,
):
    """out_g[rows, cols] = x[rows, :] @ w_g[cols, :].T with fp32 accumulation, stored in out's
    dtype, for a group of weights ``w_ptrs`` (one or more) that share x. Column tiles of BN run
    over the group's weights in turn: weight g owns tiles ``[TILE0[g], TILE0[g + 1])`` and its
    ``NS[g]`` columns sit at ``COL0[g]`` of the group's ``N_ALL``. With SPLITS > 1, program
    ``split`` covers k range ``ks`` only: it stores x[rows, ks] @ w[cols, ks].T to
    ws[split, rows, cols] (fp32, the group's columns), and the tile's last program to arrive
    sums ws[0] + ws[1] + ... into out and zeroes the tile's counter ``count[tile]`` again (the
    counters are zero between launches, which replays of a CUDA graph rely on). Axis 0 runs over
    row blocks so that the blocks sharing a weight tile run side by side and all but the first
    read it from L2. With PDL, each program first asks L2 for ``PREFETCH_LINES`` cache lines
    (``LINE`` elements each) of every weight row it will read, from the start of its k range:
    nothing it reads before the wait is written by an earlier kernel. With ``X_BLOCK_N`` > 0 the
    (single) weight is the stack of a block-diagonal one's blocks, ``X_BLOCK_N`` rows each, and
    column tiles of block b read x's columns ``[b*K, (b+1)*K)``; BN divides ``X_BLOCK_N``. With
    ``w_desc`` (a tensor descriptor of the single weight, blocks ``[BN, BK]``) the weight tiles
    come through it: out-of-range rows and k read zeros, as the masks give. With ``SB`` > 0 the
    weights are block FP8, weight g with fp32 scales ``[cdiv(N_g, SB), cdiv(K, SB)]`` at
    ``scale_ptrs[g]``: each tile is dequantised as it is loaded, ``(w.float() * scale)`` rounded
    to x's dtype (the reference's value, ``norm.dequant_dense``); BK divides SB, so a tile's k
    lie in one scale block."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    split = tl.program_id(2)
    # The weight this column tile belongs to (a static chain: the group is a few weights).
    if len(NS) == 1:  # N stays a constant: the compiler knows the output rows' alignment
        w_ptr, out_ptr, scale_ptr, n, first, col0 = w_ptrs[0], out_ptrs[0], scale_ptrs[0], NS[0], 0, 0
    else:
        w_ptr, out_ptr, scale_ptr = w_ptrs[0], out_ptrs[0], scale_ptrs[0]
        n = tile_n * 0 + NS[0]
        first = tile_n * 0
        col0 = tile_n * 0
        for g in tl.static_range(1, len(NS)):
            if tile_n >= TILE0[g]:
                w_ptr, out_ptr, scale_ptr = w_ptrs[g], out_ptrs[g], scale_ptrs[g]
                n = tile_n * 0 + NS[g]
                first = tile_n * 0 + TILE0[g]
                col0 = tile_n * 0 + COL0[g]
    if X_BLOCK_N > 0:
        x_ptr += ((tile_n - first) * BN // X_BLOCK_N).to(tl.int64) * K * stride_xk
    rows = tile_m * BM + tl.arange(0, BM)
    cols = (tile_n - first) * BN + tl.arange(0, BN)
    offs_k = split * K_SPLIT + tl.arange(0, BK)
    rmask = rows < M
    nmask = cols < n
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_tile = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if PDL and PREFETCH_LINES > 0:  # clamped into the weight: every address valid
        lk = tl.minimum(split * K_SPLIT + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
        lc = tl.minimum(cols, n - 1).to(tl.int64)
        prefetch_l2(w_ptr + lc[:, None] * stride_wn + lk[None, :])
    wait_only(PDL)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        if w_desc is not None:
            kmask = offs_k < K - k0
            a = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.trans(w_desc.load([(tile_n - first) * BN, split * K_SPLIT + k0]))
        elif EVEN:
            a = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(w_tile)
        else:
            # Splits tile [0, K) exactly, so a split's own k range needs no bound but K.
            kmask = offs_k < K - k0
            a = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_tile, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SB > 0:
            kb = (split * K_SPLIT + k0) // SB
            s = tl.load(scale_ptr + (cols // SB).to(tl.int64) * stride_sn + kb * stride_sk, mask=nmask, other=0.0)
            b = b.to(tl.float32) * s[None, :]
        acc = tl.dot(a, b.to(dtype), acc, input_precision=PREC)
        x_ptrs += BK * stride_xk
        w_tile += BK * stride_wk
    release_next(PDL)
    offs = rows.to(tl.int64)[:, None] * n + cols[None, :]
    mask = rmask[:, None] & nmask[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # The group's columns side by side: N_ALL is a constant (a multiple of 16 at every
        # served width), so the compiler knows the partials' alignment and moves them in
        # 16-byte vectors.
        stride_ws = M.to(tl.int64) * N_ALL
        ws_offs = rows.to(tl.int64)[:, None] * N_ALL + col0 + cols[None, :]
        tl.store(ws_ptr + split * stride_ws + ws_offs, acc, mask=mask)
        # The atomic below is issued by one thread, and its release orders only what that
        # thread's CTA has already made visible to it: the barrier makes every thread's partial
        # stores happen before it (the pattern of CUTLASS's barrier: __syncthreads, then one
        # thread's release), so the program that acquires the last count sees all of them.
        # (Triton may emit a barrier here anyway, for its shared-memory reuse; not to rely on.)
        tl.debug_barrier()
        counter = count_ptr + tile_m * tl.num_programs(1) + tile_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            # Every split's partial, its own included, read back in split order: the sum is the
            # same bits whichever split arrives last. ".cg" reads L2, where the other SMs'
            # stores are, never a stale line of this SM's L1.
            total = tl.load(ws_ptr + ws_offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(ws_ptr + s * stride_ws + ws_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            # Every split has arrived, so no program of this launch touches the counter again;
            # the next launch on the stream reads it only after its wait (this launch has
            # ended by then, PDL or not) and finds it zero.
            tl.store(counter, 0)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``tiles`` arrival counters on ``device``, shared by
    every call there: each launch leaves it zero again, and calls on one stream run one after
    another (two streams running split calls at once would share counters: not supported).
    Grown outside graph capture only: a graph captured earlier keeps the buffer it was captured
    with, so superseded buffers stay allocated rather than return to the allocator under it."""
    held = _COUNTERS.setdefault(device, [])
    if held and held[-1].numel() >= tiles:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"skinny_linear: {tiles} split-K counters needed during CUDA graph capture, "
            f"{held[-1].numel() if held else 0} allocated; run the same shapes once eagerly before capturing"
        )
    held.append(torch.zeros(max(_MIN_COUNTERS, triton.next_power_of_2(tiles)), dtype=torch.int32, device=device))
    return held[-1]


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, out_fp32: bool, tiles: Tiles | None = None) -> torch.Tensor:
    """``deepinfer::skinny_linear``: x ``[M, K]`` times w ``[N, K]`` (both of one dtype, any
    strides) -> ``[M, N]`` in x's dtype or fp32. ``tiles`` overrides ``choose_tiles`` (tests
    and the tile sweep of ``bench/skinny_linear.py``). Any M works; the tiling serves M <= 64."""
    return skinny_linear_group_triton(x, [w], out_fp32, tiles)[0]


def skinny_linear_group_triton(
    x: torch.Tensor,
    ws: Sequence[torch.Tensor],
    out_fp32: bool,
    tiles: Tiles | None = None,
    scales: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``deepinfer::skinny_linear_group``: ``[x @ w.T for w in ws]`` in one launch, the weights
    (``[N_g, K]``, x's dtype, one layout: equal strides) taken one after another by the column
    tiles of one tiling, ``choose_tiles(sum N_g, K)``. At decode the small projections of one
    input (``wq_a`` and ``wkv``; the compressors' and indexer's) are each too small to fill the
    GPU alone and cost a launch each; as a group they stream as one weight. With ``scales``
    (``deepinfer::skinny_linear_fp8_group``) the weights are block FP8 held as stored, all of one
    scale block, as in ``skinny_linear_fp8_triton``."""
    op = "skinny_linear_group" if scales is None else "skinny_linear_fp8" + ("_group" if len(ws) > 1 else "")
    if not ws or len(ws) > MAX_GROUP or (scales is not None and len(scales) != len(ws)):
        raise ValueError(f"{op}: 1 to {MAX_GROUP} weights (and a scale each), got {len(ws)}")
    if x.dim() != 2 or any(w.dim() != 2 or w.shape[1] != x.shape[1] for w in ws):
        shapes = ", ".join(str(tuple(w.shape)) for w in ws)
        raise ValueError(f"{op}: x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {shapes}")
    block = 0
    if scales is not None:
        blocks = {_fp8_block(w, s, op) for w, s in zip(ws, scales)}
        if len(blocks) != 1:
            raise ValueError(f"{op}: the weights' scale blocks differ ({sorted(blocks)}); one block a group")
        block = blocks.pop()
    max_bk = min(128, block & -block) if block else 128
    t = tiles or choose_tiles(sum(w.shape[0] for w in ws), x.shape[1], max_bk=max_bk, bm=_rows_block(x, block))
    return _launch(x, ws, out_fp32, t, scales=scales, block=block)


def skinny_linear_blocks_triton(
    x: torch.Tensor, w: torch.Tensor, blocks: int, scale: torch.Tensor | None = None, tiles: Tiles | None = None
) -> torch.Tensor:
    """``deepinfer::skinny_linear_blocks``: x ``[M, G*K]`` times the block-diagonal weight whose
    G blocks are the row blocks of w ``[G*R, K]`` -> ``[M, G*R]`` in x's dtype
    (``graphs/norm.py::project_blocks``), in one launch: the whole of w streams as one weight,
    each column tile reading its block's slice of x. The column tile is narrowed to divide R.
    With ``scale`` w is block FP8 held as stored, as in ``skinny_linear_fp8_triton``."""
    if x.dim() != 2 or w.dim() != 2 or blocks < 1 or w.shape[0] % blocks or x.shape[1] != blocks * w.shape[1]:
        raise ValueError(
            f"skinny_linear_blocks: x [M, G*K] and w [G*R, K] with G = {blocks} expected, "
            f"got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    r, k = w.shape[0] // blocks, w.shape[1]
    block = 0 if scale is None else _fp8_block(w, scale, "skinny_linear_blocks")
    t = tiles or choose_tiles(
        w.shape[0], k, max_bk=min(128, block & -block) if block else 128, bm=_rows_block(x, block)
    )
    bn = min(t.bn, r & -r)  # the largest power of two dividing R: no tile straddles two blocks
    if bn < 16:
        raise ValueError(
            f"skinny_linear_blocks: {r} rows a block; a multiple of 16 is needed (the smallest column tile)"
        )
    scales = None if scale is None else [scale]
    return _launch(x, [w], False, t._replace(bn=bn), x_block_n=r, scales=scales, block=block)[0]


def _rows_block(x: torch.Tensor, block: int) -> int:
    """Rows a program takes: BM, or FP8_BM over a block-FP8 weight (``block`` > 0) above BM rows."""
    return FP8_BM if block and x.shape[0] > BM else BM


def _fp8_block(w: torch.Tensor, scale: torch.Tensor, op: str) -> int:
    """The block of a float8_e4m3fn weight's fp32 scales; its power-of-two part is the k tile's bound."""
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{op}: a float8_e4m3fn w expected with scales, got {w.dtype}")
    block = fp8_block_of(w.shape, scale.shape)
    if (block & -block) < 16 or scale.dtype != torch.float32:
        raise ValueError(
            f"{op}: fp32 scales of a block with a power-of-two part >= 16, got block {block}, {scale.dtype}"
        )
    return block


def skinny_linear_fp8_triton(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_fp32: bool, tiles: Tiles | None = None
) -> torch.Tensor:
    """``deepinfer::skinny_linear_fp8``: x ``[M, K]`` times a block-FP8 weight held as stored, w
    float8_e4m3fn ``[N, K]`` with fp32 scales ``[cdiv(N, b), cdiv(K, b)]`` (``norm.project_fp8``),
    -> ``[M, N]`` in x's dtype or fp32. The weight streams at a byte an element; each tile is
    dequantised in registers to the value the reference dequantises it to. The k tile is the
    largest power of two dividing the block, at most 128 (16 at least: ``tl.dot``'s)."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"skinny_linear_fp8: x [M, K] and a float8_e4m3fn w [N, K] expected, got {tuple(x.shape)} and "
            f"{tuple(w.shape)} {w.dtype}"
        )
    return skinny_linear_group_triton(x, [w], out_fp32, tiles, [scale])[0]


def _launch(
    x: torch.Tensor,
    ws: Sequence[torch.Tensor],
    out_fp32: bool,
    t: Tiles,
    x_block_n: int = 0,
    scales: Sequence[torch.Tensor] | None = None,
    block: int = 0,
) -> list[torch.Tensor]:
    """One ``_skinny_kernel`` launch over the weights ``ws`` (shapes checked by the caller), each
    reading x's first K columns, or with ``x_block_n`` its block's (``skinny_linear_blocks``);
    with ``scales`` the weights are block FP8 of ``block`` (``skinny_linear_fp8``)."""
    if scales is not None and block % t.bk:
        raise ValueError(f"skinny_linear_fp8: the k tile {t.bk} must divide the scale block {block}")
    if scales is None and any(w.dtype != x.dtype for w in ws):
        raise ValueError(f"skinny_linear: x and w must share a dtype, got {x.dtype} and {[w.dtype for w in ws]}")
    if any(w.stride() != ws[0].stride() for w in ws) or (
        scales is not None and any(s.stride() != scales[0].stride() for s in scales)
    ):
        raise ValueError(
            f"skinny_linear_group: the weights (and scales) must share a layout, got strides {[w.stride() for w in ws]}"
            + ("" if scales is None else f" and {[s.stride() for s in scales]}")
        )
    m, k = x.shape[0], ws[0].shape[1]
    ns = tuple(w.shape[0] for w in ws)
    outs = [torch.empty(m, n, dtype=torch.float32 if out_fp32 else x.dtype, device=x.device) for n in ns]
    if m == 0 or sum(ns) == 0:
        return outs
    if k == 0:
        return [o.zero_() for o in outs]
    k_split = triton.cdiv(triton.cdiv(k, t.split), t.bk) * t.bk
    splits = triton.cdiv(k, k_split)
    tile0 = tuple(itertools.accumulate((triton.cdiv(n, t.bn) for n in ns), initial=0))
    grid = (triton.cdiv(m, t.bm), tile0[-1], splits)
    # One split needs neither workspace nor counters: None makes them constexpr, never read.
    ws_buf = torch.empty(splits, m, sum(ns), dtype=torch.float32, device=x.device) if splits > 1 else None
    counts = _counters(x.device, grid[0] * grid[1]) if splits > 1 else None
    line = _LINE_BYTES // ws[0].element_size()
    # Lines along k: only where a weight row is contiguous in k; at most the program's k range.
    lines = triton.next_power_of_2(triton.cdiv(min(t.prefetch * t.bk, k_split), line)) if t.prefetch else 0
    # The descriptor's rows must start 16-byte aligned; a group's weights keep pointer loads.
    tma = (
        t.tma
        and len(ws) == 1
        and ws[0].stride(1) == 1
        and (ws[0].stride(0) * ws[0].element_size()) % 16 == 0
        and ws[0].data_ptr() % 16 == 0
        and (x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] >= 9)
    )
    w_desc = TensorDescriptor.from_tensor(ws[0], [t.bn, t.bk]) if tma else None
    _skinny_kernel[grid](
        x,
        tuple(ws),
        tuple(outs),
        ws_buf,
        counts,
        tuple(ws) if scales is None else tuple(scales),  # unscaled (SB = 0): never read
        m,
        x.stride(0),
        x.stride(1),
        ws[0].stride(0),
        ws[0].stride(1),
        0 if scales is None else scales[0].stride(0),
        0 if scales is None else scales[0].stride(1),
        K=k,
        K_SPLIT=k_split,
        SPLITS=splits,
        BM=t.bm,
        BN=t.bn,
        BK=t.bk,
        EVEN=all(n % t.bn == 0 for n in ns) and k % k_split == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        NS=ns,
        TILE0=tile0[:-1],
        COL0=tuple(itertools.accumulate(ns[:-1], initial=0)),
        N_ALL=sum(ns),
        X_BLOCK_N=x_block_n,
        PREFETCH_LINES=lines if ws[0].stride(1) == 1 else 0,
        LINE=line,
        num_warps=t.warps,
        num_stages=t.stages,
        **pdl_args(x.device),
        SB=block if scales is not None else 0,
        w_desc=w_desc,
    )
    return outs


def _skinny_linear_cuda(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    return skinny_linear_triton(x, w, out_fp32)


def _skinny_linear_fp8_cuda(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    return skinny_linear_fp8_triton(x, w, scale, out_fp32)


def _skinny_linear_blocks_cuda(
    x: torch.Tensor, w: torch.Tensor, blocks: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    return skinny_linear_blocks_triton(x, w, blocks, scale)


def _skinny_linear_group_cuda(x: torch.Tensor, ws: list[torch.Tensor], out_fp32: bool) -> list[torch.Tensor]:
    return skinny_linear_group_triton(x, ws, out_fp32)


def _skinny_linear_fp8_group_cuda(
    x: torch.Tensor, ws: list[torch.Tensor], scales: list[torch.Tensor], out_fp32: bool
) -> list[torch.Tensor]:
    return skinny_linear_group_triton(x, ws, out_fp32, scales=scales)


torch.library.register_kernel("deepinfer::skinny_linear", "cuda", _skinny_linear_cuda)
torch.library.register_kernel("deepinfer::skinny_linear_fp8", "cuda", _skinny_linear_fp8_cuda)
torch.library.register_kernel("deepinfer::skinny_linear_group", "cuda", _skinny_linear_group_cuda)
torch.library.register_kernel("deepinfer::skinny_linear_fp8_group", "cuda", _skinny_linear_fp8_group_cuda)
torch.library.register_kernel("deepinfer::skinny_linear_blocks", "cuda", _skinny_linear_blocks_cuda)
