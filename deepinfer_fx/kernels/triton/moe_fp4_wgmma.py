"""MXFP4 routed experts on Hopper: Gluon GEMMs whose weights are wgmma's register operand.

``moe.run_experts``'s gate/up and down launches for MXFP4 weights on an
sm_90 GPU, at every row count (the op's default there: about 2x Triton's fp4 tiles at decode,
``docs/decisions.md``); the pair sort and the combine stay Triton's. Each program computes 64
output columns (weight rows) of one row block of ``TP`` sorted rows (8 to 64: the MMA's N,
``wgmma_rows``) over the whole k range, so a row's sum never meets another program's (no
split-K, no atomics) and the grids are static as in ``moe_kernels.py``.

Operand roles are swapped against ``x @ W^T``: the 64 weight rows are the A operand of
``wgmma`` in registers (M = 64, one warpgroup), the block's rows the B operand from shared
memory, so the accumulator is ``out^T [64, TP]``. The packed codes are loaded as 16-byte vectors
straight into the registers of the A fragment and decoded there (``moe_fp4_decode.py``: the
bit placement, and the kappa k order of a 128-k tile that the rows staged in shared memory
follow too).

The design and its measurements: ``docs/decisions.md`` (a Gluon MXFP4 decode GEMM).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .moe_fp4_decode import ROWS, _big_scales, _block_rows, _code_layout, _decode_values, _swiglu

_CHUNK = 256  # k a program streams a loop step: two 128-k tiles
CHUNK = gl.constexpr(_CHUNK)
# the block's rows as loaded (16-byte vectors along k), and the results as stored (lanes along n)
ROW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
OUT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1]))


@gluon.jit
def _weight_offsets(stride_c, stride_s):
    """Offsets of a 64 x 128 tile's code words (int32 units) and scale bytes, in ``_code_layout``."""
    cl: gl.constexpr = _code_layout()
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, cl)))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, cl)))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, cl)))
    r3 = gl.expand_dims(gl.expand_dims(r, 1), 2)
    c_offs = (
        r3 * (stride_c // 4) + gl.expand_dims(gl.expand_dims(g, 0), 2) * 4 + gl.expand_dims(gl.expand_dims(w, 0), 1)
    )
    s_offs = gl.expand_dims(r, 1) * stride_s + gl.expand_dims(g, 0)
    return c_offs, s_offs


@gluon.jit
def _load_tile(c_ptr, c_offs, s_ptr, s_offs, k0):
    """Code words and scale bytes (int32) of the 64 x 128 tile at k ``k0``."""
    codes = gl.load(c_ptr + (k0 // 8 + c_offs))
    s = gl.load(s_ptr + (k0 // 32 + s_offs)).to(gl.int32)
    return codes, s


@gluon.jit
def _decode_tile(codes, s, BIG: gl.constexpr, a_layout: gl.constexpr):
    """A loaded tile (code words ``[64, 4, 4]``, scale bytes ``[64, 4]``) -> wgmma's A operand
    (bf16 ``[64, 128]`` in kappa order), in the registers it was loaded into."""
    return gl.convert_layout(_decode_values(codes, s, BIG), a_layout, assert_trivial=True)


@gluon.jit
def _x_rows(x_ptr, row_offs, rmask, k0, xl: gl.constexpr):
    """The block's ``[TP, 128]`` activations at k ``k0``, masked rows zero."""
    xk = gl.arange(0, 128, layout=gl.SliceLayout(0, xl))
    offs = gl.expand_dims(row_offs, 1) + gl.expand_dims(xk, 0) + k0
    return gl.load(x_ptr + offs, mask=gl.expand_dims(rmask, 1) & gl.expand_dims(xk < 128, 0), other=0.0)


@gluon.jit
def _stage(x_smem, slot, xv, TP: gl.constexpr):
    """Store a ``[TP, 128]`` activation tile in kappa order (memory k = 32 g + 8 w + 4 h + n)."""
    xv = gl.permute(gl.reshape(xv, (TP, 4, 4, 2, 4)), (0, 2, 4, 1, 3))
    x_smem.index(slot).store(gl.reshape(xv, (TP, 128)))


@gluon.jit
def _load_step(c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs, k0, GATED: gl.constexpr):
    """Code words and scale bytes of a loop step's two 128-k tiles of both weights at k ``k0``
    (without ``GATED`` the second weight's are the first's)."""
    p1a, t1a = _load_tile(c1_ptr, c_offs, s1_ptr, s_offs, k0)
    p1b, t1b = _load_tile(c1_ptr, c_offs, s1_ptr, s_offs, k0 + 128)
    p3a, t3a, p3b, t3b = p1a, t1a, p1b, t1b
    if GATED:
        p3a, t3a = _load_tile(c3_ptr, c_offs, s3_ptr, s_offs, k0)
        p3b, t3b = _load_tile(c3_ptr, c_offs, s3_ptr, s_offs, k0 + 128)
    return p1a, t1a, p1b, t1b, p3a, t3a, p3b, t3b


@gluon.jit
def _first_loads(args, K: gl.constexpr, GATED: gl.constexpr, xl: gl.constexpr, AHEAD: gl.constexpr):
    """The loop's first rows and its first ``AHEAD`` steps of weights, before the scale check in
    program order (ptxas may still issue them after its compares)."""
    x_ptr, row_offs, rmask, c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs, x_smem = args
    ptrs = (c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs)
    xa = _x_rows(x_ptr, row_offs, rmask, 0, xl)
    xb = _x_rows(x_ptr, row_offs, rmask, 128, xl)
    cur = _load_step(*ptrs, 0, GATED)
    nxt = cur
    if AHEAD == 2:
        nxt = _load_step(*ptrs, gl.minimum(CHUNK, K - CHUNK), GATED)
    return xa, xb, cur, nxt


@gluon.jit
def _k_loop(
    acc1,
    acc3,
    args,
    first,
    K: gl.constexpr,
    TP: gl.constexpr,
    GATED: gl.constexpr,
    BIG: gl.constexpr,
    a_layout: gl.constexpr,
    xl: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """acc1 (+ acc3 with ``GATED``) += the 64 weight rows times the block's rows over all of K.
    Each step stages its two 128-k tiles of rows in one of two shared buffers (one barrier a
    step), then loads the next step's rows and the weights ``AHEAD`` (1 or 2) steps on while it
    decodes and multiplies its own: two steps keep twice the bytes in flight, for the few
    programs of a decode launch. ``args``: the rows' pointer and offsets, both weights' codes and
    scales, and the ring; ``first``: ``_first_loads``."""
    x_ptr, row_offs, rmask, c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs, x_smem = args
    ptrs = (c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs)
    xa, xb, cur, nxt = first
    for k0 in range(0, K, CHUNK):
        slot = (k0 // CHUNK) % 2 * 2
        _stage(x_smem, slot, xa, TP)
        _stage(x_smem, slot + 1, xb, TP)
        fence_async_shared()  # generic-proxy stores -> visible to wgmma's async proxy
        gl.thread_barrier()  # ... from every warp; the other buffer's last reader finished before
        kn = gl.minimum(k0 + CHUNK, K - CHUNK)  # the last steps reload themselves rather than branch
        xa = _x_rows(x_ptr, row_offs, rmask, kn, xl)
        xb = _x_rows(x_ptr, row_offs, rmask, kn + 128, xl)
        new = _load_step(*ptrs, gl.minimum(k0 + AHEAD * CHUNK, K - CHUNK), GATED)
        p1a, t1a, p1b, t1b, p3a, t3a, p3b, t3b = cur
        lo = x_smem.index(slot).permute((1, 0))
        hi = x_smem.index(slot + 1).permute((1, 0))
        acc1 = warpgroup_mma(_decode_tile(p1a, t1a, BIG, a_layout), lo, acc1)
        if GATED:
            acc3 = warpgroup_mma(_decode_tile(p3a, t3a, BIG, a_layout), lo, acc3)
        acc1 = warpgroup_mma(_decode_tile(p1b, t1b, BIG, a_layout), hi, acc1)
        if GATED:
            acc3 = warpgroup_mma(_decode_tile(p3b, t3b, BIG, a_layout), hi, acc3)
        if AHEAD == 2:
            cur = nxt
        else:
            cur = new
        nxt = new
    return acc1, acc3


@gluon.jit
def _gemm(
    x_ptr,
    row_offs,
    rmask,
    c1_ptr,
    s1_ptr,
    c3_ptr,
    s3_ptr,
    stride_c,
    stride_s,
    K: gl.constexpr,
    TP: gl.constexpr,
    GATED: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """``[64, TP]`` fp32 products of the 64 weight rows at ``c1_ptr`` (and ``c3_ptr`` with
    ``GATED``) with the block's rows, the loop in its one- or two-multiply form by the rows'
    scale bytes, loading weights ``AHEAD`` steps on."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TP, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    xl: gl.constexpr = ROW_LAYOUT
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TP, 128], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [4, TP, 128], x_sl)
    c_offs, s_offs = _weight_offsets(stride_c, stride_s)
    c1 = c1_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    c3 = c3_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    args = (x_ptr, row_offs, rmask, c1, s1_ptr, c3, s3_ptr, c_offs, s_offs, x_smem)
    first = _first_loads(args, K, GATED, xl, AHEAD)
    flags = _big_scales(s1_ptr, stride_s, K)
    if GATED:
        flags = flags | _big_scales(s3_ptr, stride_s, K)
    big = gl.max(gl.max(flags, axis=1), axis=0) > 0  # CTA-uniform
    acc1 = gl.zeros([ROWS, TP], gl.float32, layout=mma)
    acc3 = gl.zeros([ROWS, TP], gl.float32, layout=mma)
    if big:  # the loop in its two-multiply form: one branch a program, not one a tile
        acc1, acc3 = _k_loop(acc1, acc3, args, first, K, TP, GATED, True, a_layout, xl, AHEAD)
    else:
        acc1, acc3 = _k_loop(acc1, acc3, args, first, K, TP, GATED, False, a_layout, xl, AHEAD)
    return acc1, acc3


@gluon.jit
def _program(ends_ptr, E, N, stride_we, stride_wn, stride_se, stride_sn, E_P: gl.constexpr, TP: gl.constexpr):
    """Program id -> its expert (>= E: no block), row block (first, end, the rows in
    ``ROW_LAYOUT`` and their mask), first of its 64 columns, and the offsets of its weight and
    scale rows."""
    pid = gl.program_id(0)
    n_tiles = N // ROWS
    e, row0, row_end = _block_rows(ends_ptr, pid // n_tiles, E, E_P, TP)
    n0 = (pid % n_tiles) * ROWS
    rows = row0 + gl.arange(0, TP, layout=gl.SliceLayout(1, ROW_LAYOUT))
    w_off = e.to(gl.int64) * stride_we + n0 * stride_wn
    s_off = e.to(gl.int64) * stride_se + n0 * stride_sn
    return e, row0, row_end, n0, rows, rows < row_end, w_off, s_off


@gluon.jit
def _out_offsets(row_ids, row0, row_end, n0, N, TP: gl.constexpr):
    """Offsets and mask of a ``[64, TP]`` result in ``OUT_LAYOUT``: column n0 + r of output row
    ``row_ids[t]`` (``row_ids``: a pointer to the block's row ids, or None for the sorted rows)."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
    t = row0 + gl.arange(0, TP, layout=gl.SliceLayout(0, OUT_LAYOUT))
    tmask = t < row_end
    if row_ids is not None:
        t = gl.load(row_ids + t, mask=tmask, other=0)
    offs = gl.expand_dims(t.to(gl.int64), 0) * N + n0 + gl.expand_dims(r, 1)
    return offs, gl.expand_dims(tmask, 0) & gl.expand_dims(r < ROWS, 1)


@gluon.jit
def fp4_gate_up_kernel(
    x_ptr,
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
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: gl.constexpr,
    TOPK: gl.constexpr,
    E_P: gl.constexpr,
    TP: gl.constexpr,
    CLAMP: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """h[row] = silu(min(x w1^T, limit)) * clamp(x w3^T, +-limit) * routing weight for 64 columns
    of I and one block of ``TP`` sorted rows (program = block * column tiles + column tile); the
    GEMM results are rounded to bf16 before the fp32 epilogue, as ``gate_up_kernel`` does."""
    e, row0, row_end, n0, rows, rmask, w_off, s_off = _program(
        ends_ptr, E, N, stride_we, stride_wn, stride_se, stride_sn, E_P, TP
    )
    if e < E:
        tok = gl.load(pairs_ptr + rows, mask=rmask, other=0) // TOPK
        acc1, acc3 = _gemm(
            x_ptr, tok.to(gl.int64) * stride_x, rmask, w1_ptr + w_off, s1_ptr + s_off, w3_ptr + w_off,
            s3_ptr + s_off, stride_wn, stride_sn, K, TP, True, AHEAD,
        )  # fmt: skip
        g = gl.convert_layout(acc1, OUT_LAYOUT).to(gl.bfloat16).to(gl.float32)
        u = gl.convert_layout(acc3, OUT_LAYOUT).to(gl.bfloat16).to(gl.float32)
        t = row0 + gl.arange(0, TP, layout=gl.SliceLayout(0, OUT_LAYOUT))
        h = _swiglu(g, u, rw_ptr, pairs_ptr, t, t < row_end, limit, CLAMP)
        offs, mask = _out_offsets(None, row0, row_end, n0, N, TP)
        gl.store(h_ptr + offs, h.to(gl.bfloat16), mask=mask)


@gluon.jit
def fp4_down_kernel(
    h_ptr,
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
    TP: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """y[pair] = h[row] w2^T, rounded to bf16, for 64 columns of D and one block of ``TP``
    sorted rows, written at the pair's own row (as ``down_kernel``)."""
    e, row0, row_end, n0, rows, rmask, w_off, s_off = _program(
        ends_ptr, E, N, stride_we, stride_wn, stride_se, stride_sn, E_P, TP
    )
    if e < E:
        acc, _ = _gemm(
            h_ptr, rows.to(gl.int64) * K, rmask, w2_ptr + w_off, s2_ptr + s_off, w2_ptr + w_off, s2_ptr + s_off,
            stride_wn, stride_sn, K, TP, False, AHEAD,
        )  # fmt: skip
        offs, mask = _out_offsets(pairs_ptr, row0, row_end, n0, N, TP)
        gl.store(y_ptr + offs, gl.convert_layout(acc, OUT_LAYOUT).to(gl.bfloat16), mask=mask)


TALL_FROM: int | None = None  # rows an expert above which moe_fp4_tall runs; None: never (not yet timed)


def wgmma_rows(pairs: int, experts: int) -> int:
    """The block height (the MMA's N) for ``pairs`` rows over ``experts`` experts, by the rows an
    active expert takes on average: 8 up to 4, 16 up to 16, 32 up to 32, else 64 (64 beat 32 at
    48 rows on an H100, docs/decisions.md), and 128 (``moe_fp4_tall``'s prefill form) above
    ``TALL_FROM``. No row's sum depends on N, so the height moves no bit (``test_triton_moe_fp4.py``
    compares a token alone with its batches on the GPU)."""
    rows = pairs / min(experts, pairs)
    if TALL_FROM is not None and rows > TALL_FROM:
        return 128
    return 8 if rows <= 4 else 16 if rows <= 16 else 32 if rows <= 32 else 64


FEW_AHEAD = 2  # small launches load two steps on: up to 6 % faster at b1, never slower (docs/decisions.md, session 52)


def steps_ahead(programs: int, device: torch.device, per_sm: int) -> int:
    """How many loop steps on a program loads its weights: ``FEW_AHEAD`` for a launch of at most
    ``per_sm`` programs an SM, as many as stay resident with a second step's registers (up to
    187 for gate/up: 2, 117 for down: 4; b1: each program waits on memory with one step's bytes
    in flight), else 1."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return FEW_AHEAD if programs <= per_sm * _sms(index) else 1


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(x: torch.Tensor, inter: int, dim: int, held: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether these kernels take the GEMMs: bf16 rows on an sm_90 GPU, both widths multiples of
    ``_CHUNK`` (every released config's are), and the ``held`` codes and scales 16-byte aligned
    (they are read as 16-byte and 4-byte words)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
        and inter % _CHUNK == 0
        and dim % _CHUNK == 0
        and all(t.data_ptr() % 16 == 0 for t in held)
    )


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
    tp: int,
    n_blocks: int,
) -> None:
    """``moe.run_experts``'s gate/up and down launches for MXFP4 weights (``fits`` holds) in
    ``n_blocks`` row blocks of ``tp`` rows (``wgmma_rows``): ``h`` and ``y`` written as
    ``gate_up_kernel`` and ``down_kernel`` write them."""
    (w1, w3, w2), (s1, s3, s2) = weights, scales
    n_exp, inter, half_dim = w1.shape
    dim = 2 * half_dim
    gate_up_programs, down_programs = n_blocks * (inter // 64), n_blocks * (dim // 64)
    fp4_gate_up_kernel[(gate_up_programs,)](
        x, w1, w3, s1, s3, h, pairs, rw, ends, n_exp, inter, float(limit), x.stride(0),
        w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        K=dim, TOPK=top, E_P=e_p, TP=tp, CLAMP=bool(limit), AHEAD=steps_ahead(gate_up_programs, x.device, 2),
        num_warps=4,
    )  # fmt: skip
    fp4_down_kernel[(down_programs,)](
        h, w2, s2, y, pairs, ends, n_exp, dim, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        K=inter, E_P=e_p, TP=tp, AHEAD=steps_ahead(down_programs, x.device, 4), num_warps=4,
    )  # fmt: skip
