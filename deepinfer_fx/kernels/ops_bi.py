"""The ops of batch-invariant inference (``passes/batch_invariant.py``): each one's CPU kernel is
its fixed-order math in ``graphs/`` (a reduction order that depends on nothing but the element's
own operands), and its CUDA kernel a Triton kernel with the same property by construction (tiles
fixed by the shapes of one row, never by the row count; no split that follows the batch).

- ``bi_matmul``: x ``[M, K]`` @ w ``[N, K]``.T in x's dtype or fp32 (``kernels/triton/batch_invariant.py``);
- ``bi_matmul_group``: ``bi_matmul`` of one x by several weights, bit for bit, fewer launches at decode;
- ``bi_matmul_blocks``: x ``[M, G*K]`` times a block-diagonal weight (``norm.project_blocks``), one launch at decode;
- ``bi_sum`` / ``bi_mean`` / ``bi_cumsum``: a float sum / mean / scan over one dim (``kernels/triton/bi_reduce.py``);
- ``bi_attend``: attention over each query's keys in the canonical order (``kernels/triton/bi_attention.py``);
- ``bi_moe_experts``: the routed experts, each token's k rows summed in k order (``kernels/triton/moe.py``);
- ``bi_index_scores``: the indexer's scores (``kernels/triton/indexer.py``, invariant as it stands).
"""

from __future__ import annotations

import torch

from ..graphs import batch_invariant as bi
from ..graphs.reduce import cumsum_over, mean_over, sum_over
from .declare import declare_op
from .ops_linear import _rows_fake

bi_matmul = declare_op("bi_matmul", bi.fixed_order_matmul, _rows_fake)
bi_matmul_group = declare_op(
    "bi_matmul_group",
    bi.fixed_order_matmul_group,
    lambda x, ws, out_fp32: [_rows_fake(x, w, out_fp32) for w in ws],
)
bi_matmul_blocks = declare_op(
    "bi_matmul_blocks", bi.fixed_order_matmul_blocks, lambda x, w, **_: x.new_empty(x.shape[0], w.shape[0])
)
bi_sum = declare_op("bi_sum", sum_over, lambda x, dim, keepdim: x.sum(dim, keepdim=keepdim))
bi_mean = declare_op("bi_mean", mean_over, lambda x, dim, keepdim: x.mean(dim, keepdim=keepdim))
bi_cumsum = declare_op("bi_cumsum", cumsum_over, lambda x, **_: torch.empty_like(x))
bi_attend = declare_op("bi_attend", bi.attend_sorted, lambda q, **_: torch.empty_like(q))
bi_moe_experts = declare_op(
    "bi_moe_experts",
    bi.fixed_order_experts,
    lambda x, w2, **_: x.new_empty(x.shape[0], w2.shape[1], dtype=torch.float32),
)
bi_index_scores = declare_op(
    "bi_index_scores", bi.index_scores, lambda q, visible, **_: q.new_empty(visible.shape, dtype=torch.float32)
)
