"""The kernel swaps: one ``SwapRow`` a fast path, in pipeline order (``kernel_swap.py`` says what a
swap is). Adding one is its op (``kernels/``, ``declare_op``) and a row here; a row whose op
takes the place's arguments as they are needs nothing else, the others name their ``*_call`` and
``*_unserved`` in ``swap_calls.py``.
"""

from __future__ import annotations

from ..kernels.ops import route_unserved, topk_mask_unserved
from ..kernels.ops_compressor import compressor_unserved
from ..kernels.ops_fp8 import fp8_block_unserved
from ..kernels.ops_linear import decode_sized, fp8_decode_sized
from ..kernels.ops_mhc import streams_unserved
from ..kernels.ops_rope import norm_rope_unserved
from . import swap_calls as c
from .kernel_swap import SwapRow, register_swaps

SWAPS: tuple[SwapRow, ...] = (
    # => moe_experts, or moe_experts_fp8 / moe_experts_fp4 for experts held as stored (Triton
    # grouped GEMMs with fused SwiGLU-with-clamp on NVIDIA). Reached where
    # moe_shared_fused_kernel is off or falls back (held experts, expert parallelism).
    SwapRow(
        "moe_experts_kernel",
        "moe.routed_experts",
        "moe_experts",
        c.routed_experts_call,
        c.routed_experts_unserved,
        more_ops=("moe_experts_fp8", "moe_experts_fp4"),  # by the experts' storage
        sources=(fp8_block_unserved,),
    ),
    # The shared expert runs as one more routed expert that every token takes with weight 1, inside
    # the routed experts' launches (at decode its own two skinny GEMVs and SwiGLU were three launches
    # a layer, the GEMVs slower than the grouped GEMMs' weight streaming). With it in force
    # moe.routed_experts is inside the op, so moe_experts_kernel counts rewrites only where this swap
    # falls back to the reference: experts held as stored, expert parallelism in force, a shared
    # expert of another width than a routed one, or more than FOLD_MAX_TOKENS tokens (prefill).
    SwapRow("moe_shared_fused_kernel", "moe.experts_with_shared", "moe_experts_shared", c.experts_with_shared_call),
    # All Sinkhorn iterations in one kernel instead of two launches per iteration.
    SwapRow(
        "mhc_sinkhorn_kernel", "mhc.sinkhorn", "mhc_sinkhorn", unserved=c.sinkhorn_unserved, sources=(streams_unserved,)
    ),
    # Every linear / linear_fp32, for decode-sized calls (ops_linear.decode_sized: <= 16 rows, bf16,
    # aligned weight): a GEMM that streams the weight at close to HBM bandwidth; the rest trace the
    # reference. The choice reads static shapes only, so it is made once per traced bucket.
    SwapRow("skinny_linear_kernel", "norm.project", "skinny_linear", c.project_call, sources=(decode_sized,)),
    # The same for block-FP8 weights held as stored (dense_format="fp8"): the weight streams at a
    # byte an element, each tile dequantised in registers; elsewhere (prefill) the reference
    # dequantises the whole weight and the GEMM (or skinny_linear_kernel) runs on that.
    SwapRow(
        "skinny_linear_fp8_kernel",
        "norm.project_fp8",
        "skinny_linear_fp8",
        c.project_fp8_call,
        sources=(fp8_decode_sized,),
    ),
    # The grouped wo_a, decode-sized: the skinny GEMV over the stacked blocks, where the reference's
    # batched matmul was a cuBLAS launch that ends the PDL chain before and after it (twice a layer).
    SwapRow(
        "skinny_linear_blocks_kernel",
        "norm.project_blocks",
        "skinny_linear_blocks",
        c.project_blocks_call,
        sources=(decode_sized,),
    ),
    # At every size: an mHC site's fp32 mixing GEMV, its coefficients, Sinkhorn and the collapse of
    # the streams in two launches instead of ~6; on the H200 1.1x to 5x faster than the cuBLAS +
    # Inductor reference from 1 to 16384 tokens (bench/results/mhc_kernel_p8.json). With it in force
    # mhc.sinkhorn is inside the op, so mhc_sinkhorn_kernel counts rewrites only where this is off.
    SwapRow(
        "mhc_site_kernel", "mhc.mhc_site", "mhc_site", unserved=c.streams_of_x_unserved, sources=(streams_unserved,)
    ),
    # At every size: the final learned collapse (the fp32 mixing GEMV against the N rows of fn,
    # pre, the collapse of the streams) in the site's two launches (the finish kernel's HEAD
    # variant), where compiled it was five at a decode step, two of them cuBLAS's dot and
    # reduction, which PDL does not chain.
    SwapRow(
        "mhc_head_kernel", "mhc.hc_head", "mhc_head", unserved=c.streams_of_x_unserved, sources=(streams_unserved,)
    ),
    # A layer's expert choice and routing weights in one launch after the gate GEMV, where the
    # traced code was up to four (scores, torch.topk's radix select, gather and sum,
    # normalisation; kernels/triton/router.py).
    SwapRow(
        "route_topk_kernel",
        "moe.route_weights",
        "route_topk",
        c.route_weights_call,
        c.route_weights_unserved,
        sources=(route_unserved,),
    ),
    # Online-softmax attention over the selected window and compressed entries.
    SwapRow("sparse_mqa_kernel", "attention.mqa_with_sink", "sparse_mqa"),
    # Decode attention reading the window ring and the chosen compressed entries from their pools,
    # with the window mask made in the kernel: no gathered keys, no bias tensor for the window.
    SwapRow("ring_mqa_kernel", "attention.mqa_ring", "ring_mqa"),
    # Ring update, window gather, gate softmax and RMSNorm of the KV compressor in two launches
    # instead of ~15.
    SwapRow(
        "compressor_kernel",
        "compressor.pool_windows",
        "compressor_pool",
        unserved=c.pool_windows_unserved,
        sources=(compressor_unserved,),
    ),
    # V4's indexer scores without the [T, Hi, N] intermediate, then a per-query top-k by threshold
    # search instead of a sort.
    SwapRow("indexer_topk_kernel", "indexer.score_topk", "indexer_topk"),
    # The same scoring kernel, for V4.1's two-level selection, which goes on from the scores.
    SwapRow("indexer_scores_kernel", "indexer.index_scores", "indexer_scores"),
    # V4.1's selections from those scores by the same threshold search, where torch.topk's radix
    # select took 26 us a call for one query's row on an H200 (130 us of a V4.1-width b1 step).
    SwapRow("topk_mask_kernel", "indexer.top_k_mask", "topk_mask", unserved=topk_mask_unserved),
    # For prefill-sized position sets, so the tables are computed once per call instead of once per
    # element of every tensor they rotate (kernels/ops_rope.py says why Inductor would recompute
    # them), and for the tables a whole forward shares at any size (shared): Inductor copies an
    # unrealised input for each custom op that reads it, so at decode every rms_norm_rope and
    # sparse_mqa call had its own table kernels; one op call a forward builds them once.
    SwapRow("rope_table_op", "rope.cos_sin", "rope_table", c.cos_sin_call),
    # For rotations of at least _ROPE_MIN_ELEMENTS (the query heads and the attention output,
    # [T, 64, 512], at prefill and large decode batches): one kernel rotating the tail of each row
    # in place, where Inductor's code for the interleaved pairs rewrote whole rows at about a
    # third of HBM bandwidth. The choice reads static shapes only: once per traced bucket.
    SwapRow("rope_kernel", "rope.apply_rope", "rope_", c.apply_rope_call),
    # The V4 query heads' norm and the K = V latent's norm, each then rotated, at every size: one
    # pass over each row, where the compiled step ran the norm kernel, a rotation of the tail and
    # a concatenation (three launches a call at decode; at prefill the norm and the in-place
    # rotation read the rows twice). Declines tables that broadcast otherwise and rows the kernel
    # does not hold (norm_rope_unserved).
    SwapRow(
        "norm_rope_kernel",
        "rope.norm_rope",
        "rms_norm_rope",
        unserved=c.norm_rope_unserved,
        sources=(norm_rope_unserved,),
    ),
)

register_swaps(SWAPS, __name__)
