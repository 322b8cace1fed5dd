"""The KV compressor's pooling as one Triton kernel: the CUDA implementation of
``deepinfer::compressor_pool`` (``graphs/compressor.py::pool_windows``).

Run as written the region is about fifteen small launches (ring gathers and scatters, index
arithmetic, softmax, sum, norm), which at decode cost mostly launch overhead, nine times per
step of the benchmark model. Here one launch does it all, in fp32. The softmax runs online
(running max and sum, one division at the end), so latents agree with the reference to fp32
rounding, not bit for bit; window ids, completion flags and the ring are exact. The tiling
(``_TILE``, warps) is a first guess that compiles without spills for sm_90, not a measured one.

A program pools one window of one chunk: it gathers the window's rows (from the ring before
the chunk start, from the chunk's own rows after it; the A halves of the previous window and
the B halves of this one where windows overlap), runs the channelwise softmax over the gate
rows online in tiles of ``ROWS`` rows (HCA windows are 128 rows long), normalises and stores
the latent, its window id and whether it completed. Axis 0 of the grid walks the windows
(a ratio-1 prefill has as many as tokens), axis 1 the chunks.

Read before write: only a chunk's first ``ring // ratio`` windows pool rows from the ring
(later windows lie wholly inside the chunk), so program 0 of each chunk pools exactly those,
then a block barrier, then writes the chunk's last ``ring`` rows into the ring. No other
program touches the ring rows of that slot, so no launch-wide ordering is needed. Rows that
the reference redirects to the scratch slot are not written at all (nothing reads them).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import ops_compressor  # noqa: F401  (declares deepinfer::compressor_pool before we register for it)

# Elements of one [ROWS, BLOCK_D] tile a program aims for; a latent row stays whole in registers
# up to _MAX_DIM (V4's head_dim is 512, its index_head_dim 128).
_TILE = 4096
_MAX_DIM = 8192


@triton.jit
def _pool_window(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, norm_ptr, w_ptr, done_ptr, out_ptr,
                 c, j, start, length, slot, n_windows, eps,
                 s_kc, s_kl, s_kd, s_gc, s_gl, s_gd, s_rs, s_rr, s_rd, s_qs, s_qr, s_qd,
                 DIM: tl.constexpr, BLOCK_D: tl.constexpr, RATIO: tl.constexpr, HALVES: tl.constexpr,
                 RING: tl.constexpr, HAS_GATE: tl.constexpr, ROWS: tl.constexpr):
    """Window ``j`` of chunk ``c`` -> its id, completion flag and normed latent."""
    exists = j < n_windows
    close = (RATIO - 1 - start % RATIO) + RATIO * j  # the chunk row that closes the window
    w = (start + close) // RATIO
    done = (close < length) & exists
    out_row = c * n_windows + j
    tl.store(w_ptr + out_row, w, mask=exists)
    tl.store(done_ptr + out_row, done.to(tl.uint8), mask=exists)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    first = w * RATIO - (RING - RATIO)  # the window's first pooled position (overlap: the previous window's)
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i0 in range(0, RING, ROWS):
        i = i0 + tl.arange(0, ROWS)
        r = first + i
        # Nothing before position 0; an incomplete window pools nothing (its latent is 0).
        ok = (i < RING) & (r >= 0) & done
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
        k += tl.load(rkv_ptr + slot * s_rs + ring_row[:, None] * s_rr + col * s_rd, mask=from_ring, other=0.0).to(tl.float32)
        use = from_chunk | from_ring
        if HAS_GATE:
            g = tl.load(gate_ptr + c * s_gc + chunk_row * s_gl + col * s_gd, mask=from_chunk, other=0.0).to(tl.float32)
            g += tl.load(rgate_ptr + slot * s_qs + ring_row[:, None] * s_qr + col * s_qd, mask=from_ring, other=0.0).to(tl.float32)
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
    # padding channels and incomplete windows summed nothing (s = 0): their latent is 0
    pooled = tl.where(d_ok & done, acc / tl.where(s > 0.0, s, 1.0), 0.0)
    inv = tl.math.rsqrt(tl.sum(pooled * pooled, axis=0) / DIM + eps)
    y = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32) * (pooled * inv)
    tl.store(out_ptr + out_row * DIM + d, y, mask=d_ok & exists)


@triton.jit
def _write_ring(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, c, start, length, slot,
                s_kc, s_kl, s_kd, s_gc, s_gl, s_gd, s_rs, s_rr, s_rd, s_qs, s_qr, s_qd,
                DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALVES: tl.constexpr, RING: tl.constexpr,
                HAS_GATE: tl.constexpr, ROWS: tl.constexpr):
    """The chunk's last ``ring`` rows (fewer if it is shorter) into the ring of its slot."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    for j0 in range(tl.maximum(length - RING, 0), length, ROWS):
        jj = j0 + tl.arange(0, ROWS)
        mask = (jj < length)[:, None] & d_ok[None, :]
        ring_row = ((start + jj) % RING)[:, None]
        for h in tl.static_range(HALVES):
            col = (h * DIM + d)[None, :]
            k = tl.load(kv_ptr + c * s_kc + jj[:, None] * s_kl + col * s_kd, mask=mask, other=0.0)
            tl.store(rkv_ptr + slot * s_rs + ring_row * s_rr + col * s_rd, k.to(rkv_ptr.dtype.element_ty), mask=mask)
            if HAS_GATE:
                g = tl.load(gate_ptr + c * s_gc + jj[:, None] * s_gl + col * s_gd, mask=mask, other=0.0)
            else:
                g = tl.zeros([ROWS, BLOCK_D], tl.float32)
            tl.store(rgate_ptr + slot * s_qs + ring_row * s_qr + col * s_qd, g.to(rgate_ptr.dtype.element_ty), mask=mask)


# n_windows stays a runtime value even when it is 1 (decode at ratio > 1), so `j < n_windows`
# is a tensor everywhere.
@triton.jit(do_not_specialize=["n_windows"])
def _compressor_pool_kernel(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, slots_ptr, starts_ptr, lens_ptr, norm_ptr,
                            w_ptr, done_ptr, out_ptr, n_windows, eps,
                            s_kc, s_kl, s_kd, s_gc, s_gl, s_gd, s_rs, s_rr, s_rd, s_qs, s_qr, s_qd,
                            DIM: tl.constexpr, BLOCK_D: tl.constexpr, RATIO: tl.constexpr, HALVES: tl.constexpr,
                            RING: tl.constexpr, HAS_GATE: tl.constexpr, ROWS: tl.constexpr):
    # A chunk's first HALVES windows (ring // ratio) are the ones that may pool rows from the ring.
    b = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    start = tl.load(starts_ptr + c).to(tl.int64)
    length = tl.load(lens_ptr + c).to(tl.int64)
    slot = tl.load(slots_ptr + c).to(tl.int64)
    if b == 0:
        for j in tl.static_range(HALVES):
            _pool_window(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, norm_ptr, w_ptr, done_ptr, out_ptr,
                         c, j, start, length, slot, n_windows, eps,
                         s_kc, s_kl, s_kd, s_gc, s_gl, s_gd, s_rs, s_rr, s_rd, s_qs, s_qr, s_qd,
                         DIM, BLOCK_D, RATIO, HALVES, RING, HAS_GATE, ROWS)
        tl.debug_barrier()  # every ring read of this slot is done before any ring write
        _write_ring(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, c, start, length, slot,
                    s_kc, s_kl, s_kd, s_gc, s_gl, s_gd, s_rs, s_rr, s_rd, s_qs, s_qr, s_qd,
                    DIM, BLOCK_D, HALVES, RING, HAS_GATE, ROWS)
    else:
        _pool_window(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, norm_ptr, w_ptr, done_ptr, out_ptr,
                     c, HALVES + b - 1, start, length, slot, n_windows, eps,
                     s_kc, s_kl, s_kd, s_gc, s_gl, s_gd, s_rs, s_rr, s_rd, s_qs, s_qr, s_qd,
                     DIM, BLOCK_D, RATIO, HALVES, RING, HAS_GATE, ROWS)


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
    """``pool_windows`` in one launch: updates the rings in place and returns ``(w, complete,
    latents)``. ``out`` (contiguous long ``[C, n]``, bool ``[C, n]``, fp32 ``[C, n, dim]``)
    receives the results when given."""
    c, length, width = kv.shape
    dim = norm.shape[0]
    halves = 2 if overlap else 1
    if rows_kv.shape[1] != ratio * halves or width != dim * halves or rows_gate.shape != rows_kv.shape:
        raise ValueError(
            f"compressor_pool: ring {tuple(rows_kv.shape)} / {tuple(rows_gate.shape)} and rows of width {width} "
            f"do not fit ratio {ratio}, overlap {overlap}, dim {dim}"
        )
    if dim > _MAX_DIM:
        raise ValueError(f"compressor_pool_triton holds a latent of at most {_MAX_DIM} channels, not {dim}")
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
    block_d = triton.next_power_of_2(dim)
    rows = max(1, min(_TILE // block_d, triton.next_power_of_2(ratio * halves)))
    num_warps = max(1, min(8, rows * block_d // 512))
    grid = (max(1, n - halves + 1), c)  # program 0 of a chunk pools its first `halves` windows
    _compressor_pool_kernel[grid](
        kv, g, rows_kv, rows_gate, slots, starts, lens, norm.contiguous(),
        w, complete.view(torch.uint8), latents, n, float(eps),
        *kv.stride(), *g.stride(), *rows_kv.stride(), *rows_gate.stride(),
        DIM=dim, BLOCK_D=block_d, RATIO=int(ratio), HALVES=halves, RING=ratio * halves, HAS_GATE=gate is not None, ROWS=rows,
        num_warps=num_warps,
    )
    return out


torch.library.register_kernel("deepinfer::compressor_pool", "cuda", compressor_pool_triton)
