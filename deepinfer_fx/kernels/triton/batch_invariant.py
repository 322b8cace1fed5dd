"""``deepinfer::bi_matmul`` on CUDA (``kernels/ops_bi.py``): ``y = x @ w.T`` whose rows do
not depend on M, for batch-invariant inference (``passes/batch_invariant.py``).

What a row's bits depend on is the order of its k-reduction, not the tile: a program walks its
k range in ascending ``BK`` steps into one fp32 accumulator, and a tensor-core MMA (or an IEEE
fp32 FMA chain) adds each k step into an output the same way at any tile size, warp count or
position in the tile. On an H100 every tiling tried gave the same bits (BM 16 to 128, BN 32 to
256, BK 32 to 128, 1 to 8 warps, mma and wgmma; docs/decisions.md), so the tile follows M: small
tiles where a decode batch has a few rows, large ones at prefill.

The k chunks are the one thing fixed by the weight alone. A bf16 weight is cut where the skinny
decode kernel cuts it (``linear.choose_tiles``: K split until N's column tiles and the splits
fill the GPU), and calls of up to ``MAX_ROWS`` rows run that kernel itself (one launch, the
partials summed in split order by the last program to arrive): a decode step pays what it pays
with the flag off. Larger calls run the kernel here over the same chunks, each from a zero
accumulator, added in chunk order, so a row has the same bits at every M. Where M brings enough
tiles to fill the GPU (prefill) each program runs its chunks one after another and adds them
itself; otherwise each chunk has its own program writing fp32 partials and a second launch adds
them. fp32 operands multiply in IEEE fp32 (no TF32), cut by ``splits`` (the skinny kernel's
128-wide k steps would spill in fp32, as 64-wide ones already do). Prefill-sized calls read
their tiles through TMA (``use_tma``); no persistent schedule: what it costs against cuBLAS and
the skinny kernel is what ``bench/batch_invariant.py`` measures. ``bi_matmul_group`` (projections
of one input) and ``bi_matmul_blocks`` (the grouped ``wo_a``) run as one skinny launch at decode
over the same chunks, so each row keeps its bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import ops_bi  # noqa: F401  (declares deepinfer::bi_matmul before we register for it)
from ..ops_linear import MAX_ROWS
from .linear import choose_tiles, skinny_linear_blocks_triton, skinny_linear_group_triton, skinny_linear_triton

_PROGRAMS = 128  # the column tiles x k chunks a decode step aims for (an H100 / H200 has 132 SMs)
_CHUNK_MIN = 256  # the narrowest k chunk: a multiple of every BK below
_DECODE_BN = 32  # column tile of a decode-sized call: N / 32 programs before any split


def splits(n: int, k: int) -> int:
    """The k chunks of an fp32 weight of ``n`` rows and ``k`` columns: a power of two that brings
    the decode-sized launch's programs up to ``_PROGRAMS`` while every chunk stays a multiple of
    ``_CHUNK_MIN`` wide. Reads the weight's shape only."""
    s = 1
    while triton.cdiv(n, _DECODE_BN) * s < _PROGRAMS and k % (2 * s * _CHUNK_MIN) == 0:
        s *= 2
    return s


def chunks(n: int, k: int, fp32: bool) -> tuple[int, int]:
    """(chunk width, chunk count) of a weight ``[n, k]``: the skinny kernel's k splits for bf16
    (``linear.choose_tiles``), ``splits`` for fp32."""
    if fp32:
        s = splits(n, k)
        return (k // s, s)
    t = choose_tiles(n, k)
    width = triton.cdiv(triton.cdiv(k, t.split), t.bk) * t.bk
    return width, triton.cdiv(k, width)


def tiles(m: int, fp32: bool) -> dict[str, int]:
    """The launch tile for ``m`` rows (any tile gives a row the same bits, above)."""
    if fp32:  # FMA dots: 64-wide k steps spilled at sm_90
        return dict(BM=16 if m <= 16 else 64, BN=32, BK=32, num_warps=4, num_stages=3)
    if m <= 16:
        return dict(BM=16, BN=_DECODE_BN, BK=128, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)


def use_tma(x: torch.Tensor, w: torch.Tensor, width: int, bk: int) -> bool:
    """Whether a prefill-sized call reads its tiles through TMA: more than 256 rows, operands of
    one dtype with unit k stride and 16-byte aligned rows, chunks of whole k tiles, sm_90 or the
    interpreter."""
    aligned = all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, w)
    )
    gpu_ok = x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.shape[0] > 256 and x.dtype == w.dtype and aligned and width % bk == 0 and gpu_ok


def inline_chunks(m: int, n: int, fp32: bool) -> bool:
    """Whether ``m`` rows bring enough tiles to fill the GPU, so that each program takes every k
    chunk in turn (the same bits as the partials summed, in one launch)."""
    t = tiles(m, fp32)
    return triton.cdiv(m, t["BM"]) * triton.cdiv(n, t["BN"]) >= _PROGRAMS


@triton.jit(do_not_specialize=["M"])  # one binary for every M of a tile class
def _bi_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    sxm,
    sxk,
    swn,
    swk,
    sym,
    syn,
    sys,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    S: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    x_desc=None,
    w_desc=None,
):
    """One tile over k chunk ``program_id(2)`` (partials, summed by ``_sum_chunks_kernel``), or,
    with ``S`` > 1 and one program per tile, over every chunk in turn, each from zero, added in
    chunk order here: the partials' sum, bit for bit, without them. With tensor descriptors of x
    (blocks ``[BM, BK]``) and w (``[BN, BK]``) the tiles come through TMA, out-of-range rows and k
    as zeros; every chunk is then a whole number of k tiles (``use_tma``)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for c in range(S):
        chunk = tl.program_id(2) + c
        end = tl.minimum(chunk * CHUNK + CHUNK, K)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BK):
            if w_desc is None:
                kk = k0 + rk
                a = tl.load(
                    x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < end),
                    other=0.0,
                )
                b = tl.load(
                    w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                    mask=(rn[None, :] < N) & (kk[:, None] < end),
                    other=0.0,
                )
            else:
                a = x_desc.load([pid_m * BM, k0])
                b = tl.trans(w_desc.load([pid_n * BN, k0]))
            b = b.to(x_ptr.dtype.element_ty)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        total = tl.where(c == 0, acc, total + acc)  # not 0 + acc: a -0.0 partial stays -0.0
    out = total.to(y_ptr.dtype.element_ty)
    dst = y_ptr + tl.program_id(2) * sys + rm[:, None] * sym + rn[None, :] * syn
    tl.store(dst, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_chunks_kernel(part_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    """y = the fp32 partials [S, M*N] added in chunk order 0, 1, ..., S-1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def bi_matmul_triton(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """x ``[M, K]``, w ``[N, K]`` -> ``[M, N]`` in x's dtype or fp32, rows independent of M."""
    m, k = x.shape
    n = w.shape[0]
    if 0 < m <= MAX_ROWS and x.dtype == w.dtype == torch.bfloat16:
        return skinny_linear_triton(x, w, out_fp32)  # the same chunks (``chunks``), one launch
    y = torch.empty(m, n, device=x.device, dtype=torch.float32 if out_fp32 else x.dtype)
    _launch(x, w, y, *chunks(n, k, x.dtype == torch.float32))
    return y


def bi_matmul_group_triton(x: torch.Tensor, ws: list[torch.Tensor], out_fp32: bool) -> list[torch.Tensor]:
    """``[bi_matmul_triton(x, w, out_fp32) for w in ws]``, bit for bit: up to ``MAX_ROWS`` bf16
    rows, the weights cut into the same k chunks run in one skinny group launch over those
    chunks (``skinny_linear_group``: decode's projections of one input, a launch each
    otherwise); larger calls and other dtypes a call a weight."""
    m, k = x.shape
    if not (0 < m <= MAX_ROWS and x.dtype == torch.bfloat16 and all(w.dtype == x.dtype for w in ws)):
        return [bi_matmul_triton(x, w, out_fp32) for w in ws]
    by_chunks: dict[tuple[int, int], list[int]] = {}
    for i, w in enumerate(ws):
        by_chunks.setdefault(chunks(w.shape[0], k, False), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(ws)
    for (width, count), members in by_chunks.items():
        group = [ws[i] for i in members]
        t = choose_tiles(sum(w.shape[0] for w in group), k)._replace(split=count)
        if len(group) == 1 or triton.cdiv(triton.cdiv(k, count), t.bk) * t.bk != width:
            ys = [skinny_linear_triton(x, w, out_fp32) for w in group]  # the group's k tile would cut elsewhere
        else:
            ys = skinny_linear_group_triton(x, group, out_fp32, t)
        for i, y in zip(members, ys):
            out[i] = y
    return out  # type: ignore[return-value]


def bi_matmul_blocks_triton(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    """x ``[M, G*K]`` times the block-diagonal weight of w's ``G`` row blocks (w ``[G*R, K]``) ->
    ``[M, G*R]`` in x's dtype, rows independent of M (``graphs/norm.py::project_blocks``, the
    grouped ``wo_a``). bf16: the blocks are cut in k where the skinny blocks kernel cuts the
    whole stacked weight, and calls of up to ``MAX_ROWS`` rows run that kernel (one launch at
    decode, where a launch per block cost ``G`` launches a layer); larger ones a launch per block
    over the same chunks. Other dtypes, and blocks of rows the kernel cannot tile (R not a
    multiple of 16): ``bi_matmul``'s chunks block by block, at every M."""
    m = x.shape[0]
    r, k = w.shape[0] // blocks, w.shape[1]
    # the skinny blocks kernel's column tiles must not straddle blocks: R a multiple of 16
    skinny = x.dtype == w.dtype == torch.bfloat16 and r % 16 == 0
    if 0 < m <= MAX_ROWS and skinny:
        return skinny_linear_blocks_triton(x, w, blocks)
    y = torch.empty(m, w.shape[0], device=x.device, dtype=x.dtype)
    for b in range(blocks):
        xb, wb = x[:, b * k : (b + 1) * k], w[b * r : (b + 1) * r]
        _launch(xb, wb, y[:, b * r : (b + 1) * r], *chunks(w.shape[0] if skinny else r, k, x.dtype == torch.float32))
    return y


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, width: int, s: int) -> None:
    """y ``[M, N]`` (any strides) = x @ w.T over ``s`` k chunks of ``width``, added in chunk order."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return
    fp32 = x.dtype == torch.float32
    t = tiles(m, fp32)
    grid_mn = (triton.cdiv(m, t["BM"]), triton.cdiv(n, t["BN"]))
    inline = s > 1 and inline_chunks(m, n, fp32)
    part = y if s == 1 or inline else torch.empty(s, m, n, device=x.device, dtype=torch.float32)
    chunk = width if s > 1 else triton.cdiv(k, t["BK"]) * t["BK"]
    descs = (None, None)
    if use_tma(x, w, chunk, t["BK"]):
        descs = (
            TensorDescriptor.from_tensor(x, [t["BM"], t["BK"]]),
            TensorDescriptor.from_tensor(w, [t["BN"], t["BK"]]),
        )
    _bi_matmul_kernel[(*grid_mn, 1 if inline else s)](
        x,
        w,
        part,
        m,
        n,
        *x.stride(),
        *w.stride(),
        part.stride(-2),
        part.stride(-1),
        part.stride(0) if part.dim() == 3 else 0,
        K=k,
        CHUNK=chunk,
        S=s if inline else 1,
        IEEE=fp32,
        **t,
        x_desc=descs[0],
        w_desc=descs[1],
    )
    if part.dim() == 3:
        block = 1024
        summed = y if y.is_contiguous() else torch.empty(m, n, device=x.device, dtype=y.dtype)
        _sum_chunks_kernel[(triton.cdiv(m * n, block),)](part, summed, m * n, S=s, BLOCK=block, num_warps=4)
        if summed is not y:
            y.copy_(summed)


torch.library.register_kernel("deepinfer::bi_matmul", "cuda", bi_matmul_triton)
torch.library.register_kernel("deepinfer::bi_matmul_group", "cuda", bi_matmul_group_triton)
torch.library.register_kernel("deepinfer::bi_matmul_blocks", "cuda", bi_matmul_blocks_triton)
