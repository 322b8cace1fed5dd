"""Routed experts as Triton grouped GEMMs with the SwiGLU-with-clamp fused in: the CUDA
implementation of ``deepinfer::moe_experts``, over fp8 block-scaled weights of
``deepinfer::moe_experts_fp8``, and with the shared expert folded in of
``deepinfer::moe_experts_shared``.

Five launches, none waiting on the host, so the whole thing can be captured in a CUDA graph:

1. ``sort_pairs``: the T*k (token, k) pairs sorted by expert (per-span histograms, their
   prefix sums, then atomic cursors) into ``pairs`` and per-expert row ends; two launches;
2. ``gate_up``: x rows gathered by token times w1 and w3 of the row block's expert, SwiGLU with
   clamps and the routing weight in the epilogue -> ``h [P, I]`` in the activation dtype;
3. ``down``: ``h`` times w2 -> ``y [P, D]`` at each pair's own row, in the activation dtype as
   the reference's grouped GEMM returns it (fp32 ``y`` moved twice the bytes: ~0.4 GB written
   and read again per layer at a 4096-token prefill);
4. ``combine``: each token sums its k rows of ``y`` in fp32, in k order.

Grids are static: a GEMM grid covers the most row blocks any routing can need (see
``max_blocks``) times the column tiles, and programs without a block exit at once; experts
with no pairs get no block, so their weights are never read. Tile sizes depend on the shapes
only, through the mean rows per active expert (``moe_tiles.py``): small blocks (``BLOCK_M``
16) with long k tiles for decode, where the kernels stream each active expert's weights once,
and 128-row tiles for prefill, where ``tl.dot`` throughput matters. There an expert's last
row block is on average half empty (64 of 128 rows at ~384 rows an expert, ~17 % of the tile
work), so a last block with at most 64 rows runs as a 64-row tile (``Tiles.half``).

The shared expert (``moe_experts_shared``) is expert ``E``, one past the routed ones, which
every token takes with weight 1: T*(k+1) pairs over E+1 experts, the kernels deriving each
token's last pair from its index (``moe_kernels.py``). Run on its own at decode it cost three
launches a layer, two of them skinny GEMVs at ~3.5 TB/s where these GEMMs stream weights at
4.1-4.3 TB/s; folded in, a MoE layer's FFN is these five launches. fp8 experts do not take it
(the shared expert is held in the run dtype, and one kernel reads one weight format).

MXFP4 experts on sm_90 take Gluon GEMMs for gate/up and down instead, at every row count
(``moe_fp4_wgmma.py``: the weights decoded in wgmma's register operand; ``moe_fp4_tall.py``:
128-row blocks with the decoded weights in shared memory, above ``TALL_FROM`` rows an expert),
the sort and the combine staying these.
"""

from __future__ import annotations

import os

import torch
import triton

from .. import ops, ops_bi, ops_fp8  # noqa: F401  (declare the ops before we register for them)
from ...io.quant import MXFP4_BLOCK
from .buffers import out_buffer
from .moe_kernels import (
    combine_kernel,
    count_pairs_kernel,
    down_kernel,
    gate_up_kernel,
    place_pairs_kernel,
    sort_pairs_one_kernel,
)
from .moe_tiles import Tiles, expert_tiles, max_blocks
from .pdl import pdl_args

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# The pair sort: pairs per loop step, at most this many programs, and the histogram elements
# the placing programs sum at a time (32 int32 a thread at 4 warps).
_SORT_CHUNK = 256
_SORT_PROGRAMS = 64
_HIST_TILE = 4096


def sort_pairs(idx: torch.Tensor, n_experts: int, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (pair ids grouped by expert ``[T*k]``, each expert's end row ``[E]``), both int32;
    with ``shared``, ``[T*(k+1)]`` and ``[E+1]``: each token's pair k is the shared expert E.
    Up to ``_SORT_PROGRAMS`` programs each count then place a contiguous span of pairs; one
    span (decode) is one launch."""
    # contiguous: a [T, 1] column sliced from a wider tensor reshapes to a strided view
    flat = idx.reshape(-1).contiguous()
    t, top = idx.shape
    p = t * (top + shared)
    g = min(triton.cdiv(p, _SORT_CHUNK), _SORT_PROGRAMS)
    span = triton.cdiv(triton.cdiv(p, g), _SORT_CHUNK) * _SORT_CHUNK
    e_p = max(16, triton.next_power_of_2(n_experts + shared))
    hist = torch.empty(g, e_p, dtype=torch.int32, device=idx.device)
    cursor = torch.empty(g, e_p, dtype=torch.int32, device=idx.device)
    pairs = torch.empty(p, dtype=torch.int32, device=idx.device)
    ends = torch.empty(n_experts + shared, dtype=torch.int32, device=idx.device)
    pdl = pdl_args(idx.device)
    if g == 1:
        sort_pairs_one_kernel[(1,)](
            flat, pairs, ends, cursor, p, n_experts, TOPK=top, SHARED=shared, E_P=e_p, CHUNK=_SORT_CHUNK, **pdl
        )
        return pairs, ends
    count_pairs_kernel[(g,)](flat, hist, p, n_experts, span, TOPK=top, SHARED=shared, E_P=e_p, CHUNK=_SORT_CHUNK, **pdl)
    g_p = max(2, triton.next_power_of_2(g))
    place_pairs_kernel[(g,)](
        flat,
        hist,
        pairs,
        ends,
        cursor,
        p,
        n_experts,
        g,
        span,
        TOPK=top,
        SHARED=shared,
        E_P=e_p,
        G_P=g_p,
        G_ROWS=min(g_p, max(1, _HIST_TILE // e_p)),
        CHUNK=_SORT_CHUNK,
        **pdl,
    )
    return pairs, ends


def _check_shared(
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """The shared expert's matrices must be laid out as one routed expert's slice: the kernels
    address them with the routed strides, only the base pointer changes."""
    for name, sw, w in zip(("sw1", "sw3", "sw2"), shared, weights):
        if sw.shape != w.shape[1:] or sw.dtype != w.dtype or sw.device != w.device or not sw.is_contiguous():
            raise ValueError(
                f"moe_experts_shared: {name} must be a contiguous {w.dtype} {tuple(w.shape[1:])} on {w.device} (one "
                f"routed expert's layout), got {'' if sw.is_contiguous() else 'non-contiguous '}{sw.dtype} "
                f"{tuple(sw.shape)} on {sw.device}"
            )


def _wgmma_fits(x: torch.Tensor, inter: int, dim: int, held: tuple[torch.Tensor, ...]) -> bool:
    """``moe_fp4_wgmma.fits``, imported only for CUDA rows: Gluon is experimental, and a Triton
    without it must not cost the other paths."""
    if not x.is_cuda:
        return False
    from . import moe_fp4_wgmma

    return moe_fp4_wgmma.fits(x, inter, dim, held)


def run_experts(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    qblock: int,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
    out: torch.Tensor | None,
    tiles: tuple[Tiles, Tiles] | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wgmma: bool | None = None,
) -> torch.Tensor:
    """The five launches for bf16/fp32 weights (``scales`` None), fp8 weights with fp32 block
    ``scales`` of ``qblock``, or MXFP4 weights (uint8, two codes a byte) with ue8m0 byte
    ``scales`` per 32; shared by the ``moe_experts``, ``moe_experts_fp8``, ``moe_experts_fp4``
    and ``moe_experts_shared`` ops. ``shared`` (w1, w3, w2 of the shared expert, bf16/fp32 weights
    only) adds it to every token as expert E with weight 1, after the routed sum.
    ``tiles`` (gate/up, down) overrides ``moe_tiles.choose_tiles``: the tile sweep of ``bench/moe_kernel.py``.
    ``wgmma``: MXFP4 gate/up and down through the Gluon GEMMs (``moe_fp4_wgmma.py``): None takes
    them where they apply (sm_90, no ``tiles``), True insists (refused where they do not apply),
    False keeps Triton's."""
    w1, w3, w2 = weights
    t, top = idx.shape
    n_exp, inter, dim = w1.shape
    fp4 = scales is not None and w1.dtype == torch.uint8
    fp8 = scales is not None and not fp4
    held = scales is not None
    dim *= 1 + fp4  # MXFP4 rows hold two values a byte
    out = out_buffer(out, (t, dim), torch.float32, x.device, "moe_experts")
    if shared is not None:
        if scales is not None:
            raise ValueError("moe_experts: the shared expert folds into bf16/fp32 experts only, not fp8 or fp4 ones")
        _check_shared(shared, weights)
    fold = shared is not None
    slots = top + fold  # pairs per token
    p = t * slots
    if p == 0:
        return out
    if x.stride(-1) != 1 or any(not w.is_contiguous() for w in weights):
        raise ValueError("moe_experts: x rows and the expert weights must be contiguous")
    if tiles and any(t.half and t.bm < 32 for t in tiles):
        raise ValueError(f"moe_experts: half-height tiles need bm >= 32 (tl.dot takes >= 16 rows), got {tiles}")
    if tiles and any(t.fp4_bits for t in tiles) and (not fp4 or _INTERPRET):
        raise ValueError(
            "moe_experts: fp4_bits tiles decode MXFP4 weights in PTX: they need MXFP4 weights and a GPU "
            "(not the Triton interpreter)"
        )
    applies = fp4 and not tiles and not _INTERPRET and _wgmma_fits(x, inter, dim, (*weights, *scales))
    if wgmma and not applies:
        raise ValueError(
            "moe_experts: the Gluon fp4 GEMMs take MXFP4 weights and bf16 rows on an sm_90 GPU (not the Triton "
            "interpreter), widths that are multiples of 256, 16-byte-aligned codes and scales, without tiles; "
            f"got {w1.dtype} weights, "
            f"{x.dtype} rows on {x.device}, widths {inter} x {dim}{', tiles' if tiles else ''}: leave wgmma off"
        )
    s1, s3, s2 = scales if scales is not None else (w1, w3, w2)  # placeholders, never read
    sw1, sw3, sw2 = shared if fold else (w1, w3, w2)  # placeholders, never read
    pairs, ends = sort_pairs(idx, n_exp, fold)
    rw = weight.reshape(-1).contiguous()
    experts = n_exp + fold
    e_p = max(16, triton.next_power_of_2(experts))
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    qb = qblock if fp8 else 1
    pdl = pdl_args(x.device)

    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(p, dim, dtype=x.dtype, device=x.device)
    if applies if wgmma is None else wgmma:
        from . import moe_fp4_wgmma as fp4_wgmma

        tp = fp4_wgmma.wgmma_rows(p, experts)
        if tp == 128:
            from . import moe_fp4_tall

            moe_fp4_tall.gate_up_down(
                x, weights, scales, pairs, ends, rw, limit, h, y, top, e_p, max_blocks(p, experts, tp)
            )
        else:
            fp4_wgmma.gate_up_down(
                x, weights, scales, pairs, ends, rw, limit, h, y, top, e_p, tp, max_blocks(p, experts, tp)
            )
    else:
        sizes = (x.element_size(), w1.element_size())
        g, d = tiles or expert_tiles(p, experts, inter, dim, qblock if fp8 else 0, fp4, *sizes)
        if fp4 and (g.bk % MXFP4_BLOCK or d.bk % MXFP4_BLOCK):
            raise ValueError(f"moe_experts_fp4: the k tiles ({g.bk}, {d.bk}) must be multiples of {MXFP4_BLOCK}")
        n_blocks = max_blocks(p, experts, g.bm)
        gate_up_kernel[(n_blocks * triton.cdiv(inter, g.bn),)](
            x,
            w1,
            w3,
            sw1,
            sw3,
            s1,
            s3,
            h,
            pairs,
            rw,
            ends,
            n_blocks,
            n_exp,
            inter,
            float(limit),
            x.stride(0),
            w1.stride(0),
            w1.stride(1),
            s1.stride(0) if held else 0,
            s1.stride(1) if held else 0,
            K=dim,
            TOPK=top,
            SHARED=fold,
            E_P=e_p,
            BM=g.bm,
            BN=g.bn,
            BK=g.bk,
            GROUP_M=g.group_m,
            FP8=fp8,
            FP4=fp4 * (1 + g.fp4_bits),
            QBLOCK=qb,
            CLAMP=bool(limit),
            EVEN=inter % g.bn == 0 and dim % g.bk == 0,
            PREC=prec,
            HALF=g.half,
            num_warps=g.warps,
            num_stages=g.stages,
            **pdl,
        )

        n_blocks = max_blocks(p, experts, d.bm)
        down_kernel[(n_blocks * triton.cdiv(dim, d.bn),)](
            h,
            w2,
            sw2,
            s2,
            y,
            pairs,
            ends,
            n_blocks,
            n_exp,
            dim,
            w2.stride(0),
            w2.stride(1),
            s2.stride(0) if held else 0,
            s2.stride(1) if held else 0,
            K=inter,
            SHARED=fold,
            E_P=e_p,
            BM=d.bm,
            BN=d.bn,
            BK=d.bk,
            GROUP_M=d.group_m,
            FP8=fp8,
            FP4=fp4 * (1 + d.fp4_bits),
            QBLOCK=qb,
            EVEN=dim % d.bn == 0 and inter % d.bk == 0,
            PREC=prec,
            HALF=d.half,
            num_warps=d.warps,
            num_stages=d.stages,
            **pdl,
        )

    bd = min(1024, triton.next_power_of_2(dim))
    combine_kernel[(t, triton.cdiv(dim, bd))](y, out, dim, TOPK=slots, BD=bd, num_warps=4, **pdl)
    return out


def moe_experts_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
    out: torch.Tensor | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
) -> torch.Tensor:
    """``deepinfer::moe_experts``: x ``[T, D]`` through experts ``idx`` ``[T, k]`` (w1/w3
    ``[E, I, D]``, w2 ``[E, D, I]``, cast to x's dtype as they are loaded) with routing
    ``weight`` ``[T, k]``; -> fp32 ``[T, D]``, written to ``out`` when given."""
    return run_experts(x, (w1, w3, w2), None, 0, idx, weight, limit, out, tiles)


def moe_experts_fp8_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
    block: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``deepinfer::moe_experts_fp8``: float8_e4m3fn weights ``[E, out, in]`` with fp32 scales
    ``[E, cdiv(out, block), cdiv(in, block)]``, each tile dequantised as it is loaded (one scale
    per output column: a k tile never crosses a scale block), so decode streams half the bytes
    of bf16 weights; otherwise as ``moe_experts_triton``."""
    scales = (w1_scale, w3_scale, w2_scale)
    for w, s in zip((w1, w3, w2), scales):
        want = (w.shape[0], -(-w.shape[1] // block), -(-w.shape[2] // block))
        if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"moe_experts_fp8: scales must be contiguous fp32 {want}, got {s.dtype} {tuple(s.shape)}")
    return run_experts(x, (w1, w3, w2), scales, block, idx, weight, limit, out)


def moe_experts_fp4_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
    out: torch.Tensor | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
    wgmma: bool | None = None,
) -> torch.Tensor:
    """``deepinfer::moe_experts_fp4``: MXFP4 weights, uint8 ``[E, out, in / 2]`` with ue8m0 byte
    scales ``[E, out, in / 32]``, each tile decoded as it is loaded, so decode streams about a
    quarter of the bytes of bf16 weights; otherwise as ``moe_experts_triton``. ``wgmma``: the
    Gluon GEMMs on sm_90 (``run_experts``; taken where they apply unless False)."""
    for w, s in zip((w1, w3, w2), (w1_scale, w3_scale, w2_scale)):
        want = (w.shape[0], w.shape[1], 2 * w.shape[2] // MXFP4_BLOCK)
        if w.dtype != torch.uint8 or tuple(s.shape) != want or s.dtype != torch.uint8 or not s.is_contiguous():
            raise ValueError(
                f"moe_experts_fp4: weights must be uint8 with contiguous uint8 scales {want}, "
                f"got {w.dtype} {tuple(w.shape)} and {s.dtype} {tuple(s.shape)}"
            )
    scales = (w1_scale, w3_scale, w2_scale)
    return run_experts(x, (w1, w3, w2), scales, 1, idx, weight, limit, out, tiles, wgmma=wgmma)


def moe_experts_shared_triton(
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
    out: torch.Tensor | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
) -> torch.Tensor:
    """``deepinfer::moe_experts_shared``: ``moe_experts_triton`` plus the shared expert (sw1/sw3
    ``[I, D]``, sw2 ``[D, I]``, contiguous, the routed weights' dtype) added to each token's
    routed sum, run as expert E inside the same five launches."""
    return run_experts(x, (w1, w3, w2), None, 0, idx, weight, limit, out, tiles, shared=(sw1, sw3, sw2))


def bi_moe_experts_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``deepinfer::bi_moe_experts``: ``moe_experts_triton`` itself, its tiles chosen by row count:
    a row's bits follow only its k steps, which ``moe_tiles.choose_tiles`` never cuts by the rows (on an
    H100 a token's result was the same bits alone and among 2 to 4096 tokens, and equal to one
    fixed 64-row tiling's, at P8, V4.1 and V4-Pro widths: docs/decisions.md); each token's k rows
    are summed in k order (the form lists its experts ascending)."""
    return run_experts(x, (w1, w3, w2), None, 0, idx, weight, limit, None)


torch.library.register_kernel("deepinfer::moe_experts", "cuda", moe_experts_triton)
torch.library.register_kernel("deepinfer::moe_experts_shared", "cuda", moe_experts_shared_triton)
torch.library.register_kernel("deepinfer::moe_experts_fp8", "cuda", moe_experts_fp8_triton)
torch.library.register_kernel("deepinfer::moe_experts_fp4", "cuda", moe_experts_fp4_triton)
torch.library.register_kernel("deepinfer::bi_moe_experts", "cuda", bi_moe_experts_triton)
