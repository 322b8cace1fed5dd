"""The KV compressor's pooling in two Triton launches: the CUDA implementation of
``deepinfer::compressor_pool`` (``graphs/compressor.py::pool_windows``).

Run as written the region is about fifteen small launches (ring gathers and scatters, index
arithmetic, softmax, sum, norm), which at decode cost mostly launch overhead, nine times per
step of the benchmark model. Here two launches do it, in fp32. The softmax runs online
(running max and sum, one division at the end), so latents agree with the reference to fp32
rounding, not bit for bit; window ids, completion flags and the ring are exact.

Pooling (``_compressor_pool_kernel``): a program pools one window of one chunk over one block
of ``BLOCK_D`` channels. A decode call has one window per chunk, so without the channel split
a chunk's whole window (CSA: 8 rows of 512 channels, of kv and of gate; HCA: 128 rows) was
one serial program; split, its channel blocks load in parallel. The program gathers the window's rows
of its channels (from the ring before the chunk start, from the chunk's own rows after it;
the A halves of the previous window and the B halves of this one where windows overlap), runs
the channelwise softmax over the gate rows online in tiles of ``ROWS`` rows and stores the
pooled, not yet normed values into the latents. Axis 0 of the grid walks the windows (a
ratio-1 prefill has as many as tokens), axis 1 the chunks, axis 2 the channel blocks.

Norm (``_compressor_norm_kernel``): the RMSNorm needs every channel of a window, which one
launch cannot gather across programs (without atomics, whose order would make latents differ
from run to run), so a second launch on the same stream (ordered after the first) takes one
window per program: its id, whether it completed, and its pooled row normed in place.

Read before write: a window pools ``span`` rows (``ratio``, or ``2 * ratio`` where windows
overlap) and only a chunk's first ``span // ratio`` windows pool rows from the ring (later
windows lie wholly inside the chunk), so program 0 of each chunk and channel block pools
exactly those, then a block barrier, then writes the chunk's last ``ring`` rows into the ring
(``ring >= span``: a speculating engine's rings hold the longest draft more), in the same channels (both halves where windows overlap: the channels its windows
read). No other program reads or writes those ring elements of that slot, so no launch-wide
ordering is needed. Rows that the reference redirects to the scratch slot are not written at
all (nothing reads them).

Batch invariance: the tiling (``pool_config``, the norm's block) depends on the widths and the
ratio only, never on the number of chunks or their length, so a window's latent is the same
whichever batch it comes in. Tile sizes compile without spills for sm_90 (the test checks
offline); they are not measured ones.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..ops_compressor import (
    compressor_unserved,
)  # (importing it declares deepinfer::compressor_pool before we register for it)
from .pdl import pdl_args, wait_previous

# Most elements of one [ROWS, BLOCK_D] tile of a pooling program (HCA: a whole 128-row window
# of 32 channels in one tile).
_TILE = 4096
# The smallest share of a window (rows x channels) worth a program of its own: CSA at dim 512
# (ring 8) gets 64-channel blocks, eight programs a window; a ratio-1 window (one row) stays
# whole up to 512 channels, as splitting one row buys little against more programs.
_SLICE = 512
# Fewest channels of a block: 128 bytes of fp32, a whole cache line of each row.
_MIN_BLOCK_D = 32


def pool_config(dim: int, ring: int) -> dict[str, int]:
    """The pooling launch's channels per program ``BLOCK_D``, rows per tile ``ROWS`` and warps for
    latents of ``dim`` channels and windows of ``ring`` rows (a window's span, not its ring's)."""
    block_d = min(triton.next_power_of_2(dim), max(_MIN_BLOCK_D, triton.next_power_of_2(triton.cdiv(_SLICE, ring))))
    rows = min(_TILE // block_d, triton.next_power_of_2(ring))
    return {"BLOCK_D": block_d, "ROWS": rows, "num_warps": max(1, min(8, rows * block_d // 512))}


def norm_config(dim: int) -> dict[str, int]:
    """The norm launch's block (a whole latent row) and warps."""
    block = triton.next_power_of_2(dim)
    return {"BLOCK": block, "num_warps": max(1, min(8, block // 128))}


# n_windows stays a runtime value even when it is 1 (decode at ratio > 1), so `j < n_windows`
# is a tensor everywhere.
@triton.jit(do_not_specialize=["n_windows"])
def _compressor_pool_kernel(
    kv_ptr,
    gate_ptr,
    rkv_ptr,
    rgate_ptr,
    slots_ptr,
    starts_ptr,
    lens_ptr,
    pooled_ptr,
    n_windows,
    s_kc,
    s_kl,
    s_kd,
    s_gc,
    s_gl,
    s_gd,
    s_rs,
    s_rr,
    s_rd,
    s_qs,
    s_qr,
    s_qd,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RATIO: tl.constexpr,
    HALVES: tl.constexpr,
    SPAN: tl.constexpr,
    RING: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Channels ``d`` of a chunk's window(s) -> their pooled values in ``pooled_ptr``; program 0 of
    the chunk and channel block also writes those channels of the chunk's last rows into the ring."""
    wait_previous(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    start = tl.load(starts_ptr + c).to(tl.int64)
    length = tl.load(lens_ptr + c).to(tl.int64)
    slot = tl.load(slots_ptr + c).to(tl.int64)
    # Program 0 pools the chunk's first HALVES windows (SPAN // RATIO), the ones that may pool
    # rows from the ring; program b > 0 pools window HALVES + b - 1. A window pools SPAN rows;
    # the ring holds RING >= SPAN (a speculating engine's spare rows), position p at p % RING.
    j0 = tl.where(b == 0, 0, HALVES + b - 1)
    for j in range(j0, j0 + tl.where(b == 0, HALVES, 1)):
        exists = j < n_windows
        close = (RATIO - 1 - start % RATIO) + RATIO * j  # the chunk row that closes the window
        done = (close < length) & exists
        # the window's first pooled position (overlap: the previous window's)
        first = (start + close) // RATIO * RATIO - (SPAN - RATIO)
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for i0 in range(0, SPAN, ROWS):
            i = i0 + tl.arange(0, ROWS)
            r = first + i
            # Nothing before position 0; an incomplete window pools nothing (its latent is 0).
            ok = (i < SPAN) & (r >= 0) & done
            in_chunk = r >= start
            col = d[None, :]
            if HALVES == 2:  # overlap: slots 0..ratio-1 take the A halves, the rest the B halves
                col = col + tl.where(i >= RATIO, DIM, 0)[:, None]
            ring_row = tl.where(r >= 0, r, 0) % RING
            from_chunk = (ok & in_chunk)[:, None] & d_ok[None, :]
            from_ring = (ok & ~in_chunk)[:, None] & d_ok[None, :]
            chunk_row = (r - start)[:, None]
            # each pooled row comes from exactly one of the two loads
            k = tl.load(kv_ptr + c * s_kc + chunk_row * s_kl + col * s_kd, mask=from_chunk, other=0.0).to(tl.float32)
            k += tl.load(rkv_ptr + slot * s_rs + ring_row[:, None] * s_rr + col * s_rd, mask=from_ring, other=0.0).to(
                tl.float32
            )
            use = from_chunk | from_ring
            if HAS_GATE:
                g = tl.load(gate_ptr + c * s_gc + chunk_row * s_gl + col * s_gd, mask=from_chunk, other=0.0).to(
                    tl.float32
                )
                g += tl.load(
                    rgate_ptr + slot * s_qs + ring_row[:, None] * s_qr + col * s_qd, mask=from_ring, other=0.0
                ).to(tl.float32)
                g = tl.where(use, g, float("-inf"))
            else:  # flat gates: a plain mean over the window
                g = tl.where(use, 0.0, float("-inf"))
            # Online softmax per channel; a channel with every row so far hidden shifts by 0, so
            # exp gives 0 rather than NaN.
            m_new = tl.maximum(m, tl.max(g, axis=0))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_shift)
            p = tl.exp(g - m_shift[None, :])
            s = s * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(k * p, axis=0)
            m = m_new
        # an incomplete window summed nothing (s = 0): its pooled values, and so its latent, are 0
        tl.store(pooled_ptr + (c * n_windows + j) * DIM + d, acc / tl.where(s > 0.0, s, 1.0), mask=d_ok & exists)
    if b == 0:
        tl.debug_barrier()  # every ring read of these channels of this slot is done before any ring write
        # The chunk's last `ring` rows (fewer if it is shorter), channels d of each half.
        for r0 in range(tl.maximum(length - RING, 0), length, ROWS):
            jj = r0 + tl.arange(0, ROWS)
            mask = (jj < length)[:, None] & d_ok[None, :]
            ring_row = ((start + jj) % RING)[:, None]
            for h in tl.static_range(HALVES):
                col = (h * DIM + d)[None, :]
                k = tl.load(kv_ptr + c * s_kc + jj[:, None] * s_kl + col * s_kd, mask=mask, other=0.0)
                tl.store(
                    rkv_ptr + slot * s_rs + ring_row * s_rr + col * s_rd, k.to(rkv_ptr.dtype.element_ty), mask=mask
                )
                if HAS_GATE:
                    g = tl.load(gate_ptr + c * s_gc + jj[:, None] * s_gl + col * s_gd, mask=mask, other=0.0)
                else:
                    g = tl.zeros([ROWS, BLOCK_D], tl.float32)
                tl.store(
                    rgate_ptr + slot * s_qs + ring_row * s_qr + col * s_qd, g.to(rgate_ptr.dtype.element_ty), mask=mask
                )


@triton.jit(do_not_specialize=["n_windows"])  # one compiled variant for decode (n = 1) and prefill
def _compressor_norm_kernel(
    starts_ptr,
    lens_ptr,
    norm_ptr,
    w_ptr,
    done_ptr,
    latents_ptr,
    n_windows,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    RATIO: tl.constexpr,
    PDL: tl.constexpr,
):
    """Window ``j`` of chunk ``c``: its id, completion flag, and its pooled row RMS-normed in place."""
    wait_previous(PDL)
    j = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    start = tl.load(starts_ptr + c).to(tl.int64)
    length = tl.load(lens_ptr + c).to(tl.int64)
    close = (RATIO - 1 - start % RATIO) + RATIO * j  # the chunk row that closes the window
    row = c * n_windows + j
    tl.store(w_ptr + row, (start + close) // RATIO)
    tl.store(done_ptr + row, (close < length).to(tl.uint8))
    d = tl.arange(0, BLOCK)
    d_ok = d < DIM
    pooled = tl.load(latents_ptr + row * DIM + d, mask=d_ok, other=0.0)
    inv = tl.math.rsqrt(tl.sum(pooled * pooled, axis=0) / DIM + eps)
    y = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32) * (pooled * inv)
    tl.store(latents_ptr + row * DIM + d, y, mask=d_ok)


def compressor_pool_triton(
    kv: torch.Tensor,
    gate: Optional[torch.Tensor],
    rows_kv: torch.Tensor,
    rows_gate: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    norm: torch.Tensor,
    ratio: int,
    overlap: bool,
    eps: float,
    out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pool_windows`` in two launches: updates the rings in place and returns ``(w, complete,
    latents)``. ``out`` (contiguous long ``[C, n]``, bool ``[C, n]``, fp32 ``[C, n, dim]``)
    receives the results when given."""
    c, length, width = kv.shape
    dim = norm.shape[0]
    halves = 2 if overlap else 1
    if rows_kv.shape[1] < ratio * halves or width != dim * halves or rows_gate.shape != rows_kv.shape:
        raise ValueError(
            f"compressor_pool: ring {tuple(rows_kv.shape)} / {tuple(rows_gate.shape)} and rows of width {width} "
            f"do not fit ratio {ratio}, overlap {overlap}, dim {dim}"
        )
    if compressor_unserved(dim):  # the swap declines such calls
        raise ValueError(f"compressor_pool_triton: {compressor_unserved(dim)}")
    n = length // ratio + 1
    if out is None:
        out = (
            torch.empty((c, n), dtype=torch.long, device=kv.device),
            torch.empty((c, n), dtype=torch.bool, device=kv.device),
            torch.empty((c, n, dim), dtype=torch.float32, device=kv.device),
        )
    w, complete, latents = out
    if not all(t.is_contiguous() for t in out) or latents.dtype != torch.float32:
        raise ValueError("compressor_pool_triton writes contiguous outputs, fp32 latents")
    if c == 0:
        return out
    g = kv if gate is None else gate
    span = ratio * halves
    cfg = pool_config(dim, span)
    # program 0 of a chunk and channel block pools the chunk's first `halves` windows
    grid = (max(1, n - halves + 1), c, triton.cdiv(dim, cfg["BLOCK_D"]))
    _compressor_pool_kernel[grid](
        kv,
        g,
        rows_kv,
        rows_gate,
        slots,
        starts,
        lens,
        latents,
        n,
        *kv.stride(),
        *g.stride(),
        *rows_kv.stride(),
        *rows_gate.stride(),
        DIM=dim,
        RATIO=int(ratio),
        HALVES=halves,
        SPAN=span,
        RING=rows_kv.shape[1],
        HAS_GATE=gate is not None,
        **cfg,
        **pdl_args(kv.device),
    )
    _compressor_norm_kernel[(n, c)](
        starts,
        lens,
        norm.contiguous(),
        w,
        complete.view(torch.uint8),
        latents,
        n,
        float(eps),
        DIM=dim,
        RATIO=int(ratio),
        **norm_config(dim),
        **pdl_args(kv.device),
    )
    return out


torch.library.register_kernel("deepinfer::compressor_pool", "cuda", compressor_pool_triton)
