"""The streams' update after a sublayer in one Triton launch: the CUDA implementation of
``deepinfer::mhc_expand`` (``graphs/mhc.py::mhc_expand``).

``X'_k = post_k * y + sum_j comb[j, k] * X_j`` for a token's ``N`` streams. A program takes one
token and ``BLOCK_D`` channels of every stream, so a token's rows are read once and each output
element is computed from its own token alone (batch-invariant by construction). The roundings
are the reference's: ``comb`` and ``post`` rounded to X's dtype, the mix accumulated in fp32 over
``j`` in order and rounded once, ``post_k * y`` rounded, then the sum rounded (on an H100 the
results were still not eager ATen's bits: within a few ulp, ``test_triton_mhc_expand.py``).
Compiled steps under Inductor fuse the reference by themselves; this serves the steps that are
not fused (batch-invariant inference runs aot_eager and eager steps, ``passes/batch_invariant.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...graphs.mhc import mhc_expand
from ..ops_mhc import streams_unserved  # (importing it declares deepinfer::mhc_expand)

_reference = getattr(mhc_expand, "reference", mhc_expand)
_BLOCK_D = 1024


@triton.jit
def _mhc_expand_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    dt = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + t * D + d, mask=ok, other=0.0)
    for k in tl.static_range(N):
        mixed = tl.zeros([BLOCK_D], tl.float32)
        for j in tl.static_range(N):
            c = tl.load(comb_ptr + t * N * N + j * N + k).to(dt).to(tl.float32)
            xj = tl.load(x_ptr + (t * N + j) * D + d, mask=ok, other=0.0).to(tl.float32)
            mixed += c * xj
        p = tl.load(post_ptr + t * N + k).to(dt).to(tl.float32)
        py = (p * y.to(tl.float32)).to(dt)
        out = (py.to(tl.float32) + mixed.to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + (t * N + k) * D + d, out, mask=ok)


def mhc_expand_triton(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X ``[..., N, D]``, y ``[..., D]``, post ``[..., N]``, comb ``[..., N, N]`` -> ``[..., N, D]``."""
    n, d = X.shape[-2], X.shape[-1]
    if streams_unserved(n) or y.shape != (*X.shape[:-2], d) or post.shape != X.shape[:-1]:
        return _reference(X, y, post, comb).contiguous()
    out = torch.empty(X.shape, dtype=X.dtype, device=X.device)
    t = X.numel() // (n * d)
    if t == 0:
        return out
    x2, y2 = X.reshape(t, n, d).contiguous(), y.reshape(t, d).contiguous()
    p2, c2 = post.reshape(t, n).float().contiguous(), comb.reshape(t, n, n).float().contiguous()
    block = min(_BLOCK_D, triton.next_power_of_2(d))
    _mhc_expand_kernel[(t, triton.cdiv(d, block))](x2, y2, p2, c2, out, d, N=n, BLOCK_D=block, num_warps=4)
    return out


torch.library.register_kernel("deepinfer::mhc_expand", "cuda", mhc_expand_triton)
