"""The check that lets batch-invariant steps compile with Inductor: no float reduction is left to it.

Batch-invariant inference (``passes/batch_invariant.py``) puts every float sum the model and the
sampler do into ``deepinfer::bi_*`` ops, whose kernels fix the order of their additions. What is
left in a step's ATen graph is pointwise arithmetic, indexing, integer math and exact reductions
(max, min, argmax, any, integer sums). Inductor may fuse those freely: a pointwise kernel computes
each element from its operands alone, whatever its tile, and with ``INDUCTOR_PATCHES`` it rounds
every intermediate as eager does, so a fused chain has one result wherever a graph cuts it. A
float reduction left in the graph is another matter: Inductor picks its split, its block and its
warps from the number of rows, so a row's bits would follow the batch. ``float_reductions`` finds
such nodes and ``check_invariant_graph`` refuses the graph, naming them and where the model made
them; the compiler runs it on every graph of a batch-invariant step (``compiler.py``), Inductor
or aot_eager (where a torch reduction on CUDA splits rows by their count as well).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

aten = torch.ops.aten

# float-accumulating ATen ops (their default and out overloads alike): each adds many products
# or terms in an order a kernel chooses
_ACCUMULATING = {
    aten.sum,
    aten.mean,
    aten.prod,
    aten.nansum,
    aten.var,
    aten.var_mean,
    aten.std,
    aten.std_mean,
    aten.cumsum,
    aten.cumprod,
    aten.logcumsumexp,
    aten.logsumexp,
    aten._softmax,
    aten._log_softmax,
    aten.norm,
    aten.linalg_vector_norm,
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.baddbmm,
    aten.addbmm,
    aten.mv,
    aten.dot,
    aten.matmul,
    aten.convolution,
    aten.index_add,
    aten.scatter_add,
    aten.scatter_reduce,
    aten.embedding_dense_backward,
    aten.native_layer_norm,
    aten.native_group_norm,
    aten._fused_rms_norm,
}

# Inductor settings under which a fused pointwise chain gives eager's bits: each intermediate
# rounded to its eager dtype, and division and the transcendentals as eager computes them
# (names that the installed torch lacks are left out: ``inductor_patches``). Not its
# ``deterministic`` mode: it only pins reduction configs, and the reductions left to Inductor
# are exact; pinned untuned, one of them (an ``all``) took 190-243 us of a P8 decode step at
# batch 8-64 on an H100, against 34 us tuned (docs/decisions.md).
INDUCTOR_PATCHES: dict[str, Any] = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.use_pytorch_libdevice": True,
}


def inductor_patches() -> dict[str, Any]:
    """``INDUCTOR_PATCHES`` that the installed torch's Inductor knows."""
    import torch._inductor.config as config

    def known(name: str) -> bool:
        obj: Any = config
        for part in name.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    return {k: v for k, v in INDUCTOR_PATCHES.items() if known(k)}


def _is_float(value: Any) -> bool:
    vals = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)


def _accumulates(node: torch.fx.Node) -> bool:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is aten.index_put or packet is aten.index_put_:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return bool(accumulate)
    return packet in _ACCUMULATING


def float_reductions(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that sum floats outside the ``deepinfer::bi_*`` ops, each with the
    model line that made it (from the node's stack trace, when the tracer kept one)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _accumulates(node):
            continue
        value = node.meta.get("val")
        if value is None or not _is_float(value):
            continue
        trace = (node.meta.get("stack_trace") or "").strip().splitlines()
        where = next((line.strip() for line in reversed(trace) if line.strip().startswith("File")), "")
        found.append(f"{node.name} = {node.target}" + (f" ({where})" if where else ""))
    return found


def check_invariant_graph(gm: torch.fx.GraphModule, name: str) -> None:
    """Refuse ``gm`` (graph ``name`` of a batch-invariant step) if a float reduction was left in it."""
    found = float_reductions(gm)
    if found:
        raise RuntimeError(
            f"batch-invariant step {name!r} sums floats outside the deepinfer::bi_* ops, in an order "
            f"that would follow the batch: {'; '.join(found[:6])}"
            + (f" and {len(found) - 6} more" if len(found) > 6 else "")
            + ". Route the sum through a graphs/reduce.py place (or another place in passes/batch_invariant.py's "
            "table), or run without batch_invariant"
        )
