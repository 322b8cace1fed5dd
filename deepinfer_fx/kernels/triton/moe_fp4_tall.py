"""MXFP4 routed experts on Hopper at prefill: 128-row blocks, each weight tile decoded once into
shared memory for two warpgroups' wgmma.

``moe_fp4_wgmma``'s GEMMs decode a weight tile into wgmma's register operand for every block of
at most 64 sorted rows, so at prefill (hundreds of rows an expert) a tile is decoded once per 64
rows and the decode, not the MMA, bounds them (0.5x bf16 at 4,096 tokens, ``docs/decisions.md``).
Here a program (8 warps) takes 128 weight rows and a block of 128 sorted rows: each 128-k step's
codes are decoded once (``_decode_values``, the same PTX) into a two-slot shared-memory ring, the
block's rows arrive by TMA from a copy laid out in the kappa k order (``kappa_rows``), and the
step's two 64-k halves run as asynchronous wgmma from shared memory while the next step decodes.
A row's products are summed in the same kappa order, 16 k an MMA step, as in the register-operand
kernels, so a token's bits do not depend on which form its batch took (``test_triton_moe_fp4.py``).

Gate/up programs interleave the two weights by 8 rows (A row 16 j + t is gate column 8 j + t,
A row 16 j + 8 + t its up column): a thread's accumulator holds rows r and r + 8, so each thread
has both halves of its columns and the SwiGLU needs no exchange. They write h with each 128-k
tile in kappa order, which the down programs' TMA reads as it is.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .moe_fp4_decode import _big_scales, _block_rows, _code_layout, _decode_values, _swiglu

TALL = 128  # sorted rows a block (wgmma's N) and weight rows a program (two warpgroups' M)
STAGES = 4  # k steps of rows in the TMA ring (each two [TALL, 64] boxes): two steps ahead
M = gl.constexpr(TALL)
# the SwiGLU's [64 columns, 128 rows] and the down results' [128 columns, 128 rows]: lanes along columns
H_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [2, 4], [0, 1]))
Y_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [4, 2], [0, 1]))


@gluon.jit
def _weight_pointers(c_lo, s_lo, c_hi, s_hi, stride_c, stride_s, GATED: gl.constexpr):
    """Pointers of the [128, 128] step tile's code words (int32) and scale bytes at k 0, in
    ``_code_layout(128)``. A row a reads weight row ``col`` of the low or high pointers: gate/up,
    up where a's bit 3 is set and col = 8 (a // 16) + a % 8; down, high from a = 64 and col = a % 64."""
    cl: gl.constexpr = _code_layout(128)
    a = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, cl)))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, cl)))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, cl)))
    if GATED:
        hi = (a // 8) % 2 == 1
        col = (a // 16) * 8 + a % 8
    else:
        hi = a >= 64
        col = a % 64
    col3 = gl.expand_dims(gl.expand_dims(col, 1), 2)
    c_off = (
        col3 * (stride_c // 4) + gl.expand_dims(gl.expand_dims(g, 0), 2) * 4 + gl.expand_dims(gl.expand_dims(w, 0), 1)
    )
    c_ptrs = gl.where(gl.expand_dims(gl.expand_dims(hi, 1), 2), c_hi + c_off, c_lo + c_off)
    s_off = gl.expand_dims(col, 1) * stride_s + gl.expand_dims(g, 0)
    s_ptrs = gl.where(gl.expand_dims(hi, 1), s_hi + s_off, s_lo + s_off)
    return c_ptrs, s_ptrs


@gluon.jit
def _load_step(c_ptrs, s_ptrs, k0):
    """Code words and scale bytes (int32) of the step tile at k ``k0``."""
    return gl.load(c_ptrs + k0 // 8), gl.load(s_ptrs + k0 // 32).to(gl.int32)


@gluon.jit
def _rows_to_ring(x_desc, bars, x_smem, row0, step, N_STEPS: gl.constexpr, STAGES: gl.constexpr):
    """TMA the block's rows of k step ``step`` (two 64-k boxes) into its ring stage, if it exists."""
    st = step % STAGES
    bar = bars.index(st)
    ok = step < N_STEPS
    mbarrier.expect(bar, 2 * x_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(x_desc, [row0, step * 128], bar, x_smem.index(2 * st), pred=ok)
    tma.async_copy_global_to_shared(x_desc, [row0, step * 128 + 64], bar, x_smem.index(2 * st + 1), pred=ok)


@gluon.jit
def _k_loop(
    acc, x_desc, bars, x_smem, a_smem, row0, c_ptrs, s_ptrs, K: gl.constexpr, STAGES: gl.constexpr, BIG: gl.constexpr
):
    """acc += the 128 weight rows times the block's rows over all of K. Each step loads the codes
    two steps on, decodes its own tile into one of two shared slots while the previous step's MMAs
    run, then (one barrier) refills the ring stage read two steps ago and issues its own two MMAs,
    leaving them in flight."""
    N_STEPS: gl.constexpr = K // 128
    codes, sc = _load_step(c_ptrs, s_ptrs, 0)
    nxt = _load_step(c_ptrs, s_ptrs, gl.minimum(1, N_STEPS - 1) * 128)
    for step in range(N_STEPS):
        slot = step % 2
        after = _load_step(c_ptrs, s_ptrs, gl.minimum(step + 2, N_STEPS - 1) * 128)  # two steps on
        a = gl.permute(gl.reshape(_decode_values(codes, sc, BIG), (M, 2, 64)), (0, 2, 1))
        a0, a1 = gl.split(a)  # kappa 0..63 and 64..127
        a_smem.index(2 * slot).store(a0)  # its last reader, the MMA two steps back, is done
        a_smem.index(2 * slot + 1).store(a1)
        fence_async_shared()  # generic-proxy stores -> visible to wgmma's async proxy
        gl.thread_barrier()  # every warp stored, and both warpgroups waited out step - 2's MMAs
        _rows_to_ring(x_desc, bars, x_smem, row0, step + STAGES - 2, N_STEPS, STAGES)
        st = step % STAGES
        mbarrier.wait(bars.index(st), (step // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(2 * slot), x_smem.index(2 * st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a_smem.index(2 * slot + 1), x_smem.index(2 * st + 1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))  # this step's two stay in flight
        codes, sc = nxt
        nxt = after
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _gemm(
    x_desc, row0, c_lo, s_lo, c_hi, s_hi, stride_c, stride_s, K: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr
):
    """``[128, 128]`` fp32 products of the program's 128 weight rows (``_weight_pointers``) with
    the block's rows from ``x_desc``, the loop in its one- or two-multiply form by the scale bytes."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, M, 16])
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [4, M, 64], x_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, M, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    for i in gl.static_range(STAGES - 2):
        _rows_to_ring(x_desc, bars, x_smem, row0, i, K // 128, STAGES)
    c_ptrs, s_ptrs = _weight_pointers(
        c_lo.to(gl.pointer_type(gl.int32), bitcast=True), s_lo, c_hi.to(gl.pointer_type(gl.int32), bitcast=True),
        s_hi, stride_c, stride_s, GATED,
    )  # fmt: skip
    flags = _big_scales(s_lo, stride_s, K) | _big_scales(s_hi, stride_s, K)
    big = gl.max(gl.max(flags, axis=1), axis=0) > 0  # CTA-uniform
    acc = gl.zeros([M, M], gl.float32, layout=mma)
    if big:
        acc = _k_loop(acc, x_desc, bars, x_smem, a_smem, row0, c_ptrs, s_ptrs, K, STAGES, True)
    else:
        acc = _k_loop(acc, x_desc, bars, x_smem, a_smem, row0, c_ptrs, s_ptrs, K, STAGES, False)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    return acc


@gluon.jit
def _program(ends_ptr, E, N, COLS: gl.constexpr, stride_we, stride_wn, stride_se, stride_sn, E_P: gl.constexpr):
    """Program id -> its expert (>= E: no block), row block (first and end row), first of its
    ``COLS`` output columns, and the offsets of its weight and scale rows."""
    pid = gl.program_id(0)
    n_tiles = N // COLS
    e, row0, row_end = _block_rows(ends_ptr, pid // n_tiles, E, E_P, M)
    n0 = (pid % n_tiles) * COLS
    return (
        e,
        row0,
        row_end,
        n0,
        e.to(gl.int64) * stride_we + n0 * stride_wn,
        e.to(gl.int64) * stride_se + n0 * stride_sn,
    )


@gluon.jit
def _kappa_column(c):
    """Where column ``c`` of h sits with each 128-k tile in kappa order."""
    k = c % 128
    return c - k + 8 * (4 * ((k // 8) % 4) + k % 4) + 2 * (k // 32) + (k // 4) % 2


@gluon.jit
def fp4_tall_gate_up_kernel(
    x_desc,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    pairs_ptr,
    rw_ptr,
    ends_ptr,
    E,
    N,
    limit,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: gl.constexpr,
    E_P: gl.constexpr,
    CLAMP: gl.constexpr,
    STAGES: gl.constexpr,
):
    """h[row] = silu(min(x w1^T, limit)) * clamp(x w3^T, +-limit) * routing weight for 64
    columns of I and one block of 128 sorted rows (program = block * column tiles + column
    tile), h's columns in kappa order; the GEMM results rounded to bf16 before the fp32 epilogue,
    as ``moe_fp4_wgmma.fp4_gate_up_kernel`` does."""
    e, row0, row_end, n0, w_off, s_off = _program(ends_ptr, E, N, 64, stride_we, stride_wn, stride_se, stride_sn, E_P)
    if e < E:
        acc = _gemm(
            x_desc, row0, w1_ptr + w_off, s1_ptr + s_off, w3_ptr + w_off, s3_ptr + s_off, stride_wn, stride_sn,
            K, True, STAGES,
        )  # fmt: skip
        gu = gl.reshape(acc.to(gl.bfloat16).to(gl.float32), (8, 2, 8, M))  # [j, gate | up, t, rows]
        g, u = gl.split(gl.reshape(gl.permute(gu, (0, 2, 3, 1)), (64, M, 2)))
        t = row0 + gl.arange(0, M, layout=gl.SliceLayout(0, H_LAYOUT))
        tmask = t < row_end
        h = _swiglu(
            gl.convert_layout(g, H_LAYOUT), gl.convert_layout(u, H_LAYOUT), rw_ptr, pairs_ptr, t, tmask, limit, CLAMP
        )
        c = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, H_LAYOUT))
        offs = gl.expand_dims(t.to(gl.int64), 0) * N + gl.expand_dims(_kappa_column(c), 1)
        gl.store(h_ptr + offs, h.to(gl.bfloat16), mask=gl.expand_dims(tmask, 0) & gl.expand_dims(c < N, 1))


@gluon.jit
def fp4_tall_down_kernel(
    h_desc,
    w2_ptr,
    s2_ptr,
    y_ptr,
    pairs_ptr,
    ends_ptr,
    E,
    N,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: gl.constexpr,
    E_P: gl.constexpr,
    STAGES: gl.constexpr,
):
    """y[pair] = h[row] w2^T, rounded to bf16, for 128 columns of D and one block of 128 sorted
    rows (h in kappa order), written at the pair's own row."""
    e, row0, row_end, n0, w_off, s_off = _program(ends_ptr, E, N, 128, stride_we, stride_wn, stride_se, stride_sn, E_P)
    if e < E:
        acc = _gemm(
            h_desc, row0, w2_ptr + w_off, s2_ptr + s_off, w2_ptr + w_off + 64 * stride_wn,
            s2_ptr + s_off + 64 * stride_sn, stride_wn, stride_sn, K, False, STAGES,
        )  # fmt: skip
        r = gl.arange(0, M, layout=gl.SliceLayout(1, Y_LAYOUT))
        t = row0 + gl.arange(0, M, layout=gl.SliceLayout(0, Y_LAYOUT))
        tmask = t < row_end
        pair = gl.load(pairs_ptr + t, mask=tmask, other=0)
        offs = gl.expand_dims(pair.to(gl.int64), 0) * N + n0 + gl.expand_dims(r, 1)
        y = gl.convert_layout(acc, Y_LAYOUT).to(gl.bfloat16)
        gl.store(y_ptr + offs, y, mask=gl.expand_dims(tmask, 0) & gl.expand_dims(r < M, 1))


def kappa_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each 128-k tile of a row in kappa order: memory k = 32 g + 8 w + 4 h + n moves to
    8 (4 w + n) + 2 g + h (``moe_fp4_wgmma``'s reduction order)."""
    rows, k = x.shape
    return x.view(rows, k // 128, 4, 4, 2, 4).permute(0, 1, 3, 5, 2, 4).reshape(rows, k)


def _rows_desc(rows: torch.Tensor) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([TALL, 64], gl.bfloat16)
    return TensorDescriptor.from_tensor(rows, [TALL, 64], layout)


def gate_up_down(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs: torch.Tensor,
    ends: torch.Tensor,
    rw: torch.Tensor,
    limit: float,
    h: torch.Tensor,
    y: torch.Tensor,
    top: int,
    e_p: int,
    n_blocks: int,
) -> None:
    """``moe.run_experts``'s gate/up and down launches for MXFP4 weights in ``n_blocks`` row
    blocks of 128 (``moe_fp4_wgmma.fits`` holds): ``y`` written as ``moe_fp4_wgmma.gate_up_down``
    writes it (``h`` holds the SwiGLU rows in kappa order)."""
    (w1, w3, w2), (s1, s3, s2) = weights, scales
    n_exp, inter, half_dim = w1.shape
    dim = 2 * half_dim
    rows = kappa_rows(x).index_select(0, (pairs // top).long())  # each pair's token, in sorted order
    fp4_tall_gate_up_kernel[(n_blocks * (inter // 64),)](
        _rows_desc(rows), w1, w3, s1, s3, h, pairs, rw, ends, n_exp, inter, float(limit),
        w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        K=dim, E_P=e_p, CLAMP=bool(limit), STAGES=STAGES, num_warps=8,
    )  # fmt: skip
    fp4_tall_down_kernel[(n_blocks * (dim // 128),)](
        _rows_desc(h), w2, s2, y, pairs, ends, n_exp, dim, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        K=inter, E_P=e_p, STAGES=STAGES, num_warps=8,
    )  # fmt: skip
