"""Batch-invariant inference (``LLM(batch_invariant=True)``, ``DEEPINFER_BATCH_INVARIANT=1``):
the one table of what stands at each ``graphs/swap.py`` place while it is on.

Every place is in the table: where the reference could depend on the batch, its batch-invariant
form (``graphs/batch_invariant.py``; the dense projections through ``deepinfer::bi_matmul``);
everywhere else the reference itself, so that no kernel swap (whose kernels were built for speed,
not for one reduction order) stands in while the flag is on. The step runner installs the table
innermost, over the pipeline's kernel swaps (``engine/graph_runner.py``): the flag declines them.
On a mesh, the sharding's places keep their replacement: expert parallelism's dispatch runs the
routed experts' form on the received pairs, and the form's routing lists each token's experts in
ascending id, so the combine's k order (``sharding/ep.py``) is the one process's expert order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..graphs import batch_invariant as bi
from ..graphs import model as _model  # noqa: F401  (importing the model registers every place)
from ..graphs.swap import places, reference
from ..kernels import ops_linear  # noqa: F401  (declares deepinfer::bi_matmul)


def _project(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    y = torch.ops.deepinfer.bi_matmul(x.reshape(-1, x.shape[-1]), w, out_fp32)
    return y.view(*x.shape[:-1], w.shape[0])


# The places whose reference could change with the batch, and what replaces each.
FORMS: dict[str, Callable[..., Any]] = {
    "norm.project": _project,
    "norm.project_blocks": bi.project_blocks,
    "pointwise.sigmoid": bi.sigmoid,
    "pointwise.silu": bi.silu,
    "pointwise.softplus": bi.softplus,
    "pointwise.softmax": bi.softmax,
    "pointwise.log_softmax": bi.log_softmax,
    "moe.route_weights": bi.route_weights,
    "moe.routed_experts": bi.routed_experts,
    "attention.attend": bi.attend,
    "attention.mqa_ring": bi.mqa_ring,
    "indexer.index_scores": bi.index_scores,
    "indexer.score_topk": bi.score_topk,
    "indexer.top_k_mask": bi.top_k_mask,
}


assert set(FORMS) <= set(places()), sorted(set(FORMS) - set(places()))


def batch_invariant_swaps(sharded: Iterable[str] = ()) -> dict[str, Callable[..., Any]]:
    """Every place but ``sharded`` (those a mesh's sharding replaces: expert parallelism's
    dispatch, which runs the routed experts' form on each rank): its batch-invariant form, else
    its reference."""
    table = {name: reference(name) for name in places()}
    table.update(FORMS)
    return {name: f for name, f in table.items() if name not in set(sharded)}
