"""Decode projections of one input in one launch: ``deepinfer.skinny_linear`` nodes that read
the same rows => one ``deepinfer.skinny_linear_group`` node and a ``getitem`` per projection;
``deepinfer.skinny_linear_fp8`` nodes (block-FP8 weights held as stored) of one scale block =>
one ``deepinfer.skinny_linear_fp8_group``; under batch invariance, ``deepinfer.bi_matmul`` nodes
=> one ``deepinfer.bi_matmul_group``, whose kernel keeps each projection's bits (it launches
together only the weights its decode kernel cuts into the same k chunks).

At decode a layer projects its normed input through ``wq_a`` and ``wkv`` (bf16 results) and, in
compressed layers, through the compressors' and the indexer's weights (fp32 results); its query
latent through ``wq_b`` and the indexer's ``wq_b``. Each of the small ones is latency-bound on
its own (4-8 MiB at 0.7-1.3 TB/s on an H200, one launch each); the group kernel streams them as
one weight (``kernels/triton/linear.py``). The model code keeps one ``linear`` per weight, and
the parameter tree keeps one tensor per weight: the grouping is decided here, on the traced
graph, from what the projections read.

Two projections group when their rows are the same values: the same node, or views of one node
with the same shape (each ``linear`` flattens its input itself), and when they agree on the
result dtype and on the weights' K and strides. The group node goes where the first member was;
a member whose weight is computed after that point (not a parameter) stays alone. Groups hold
at most ``MAX_GROUP`` weights. A group's tiling depends on its weights' shapes only, so results
stay batch-invariant; they can differ from the ungrouped call's in the last bits (another
split of K), as any change of tiling does (not ``bi_matmul_group``'s: eager == compiled holds).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import ClassVar

import torch
import torch.fx

from .. import kernels  # noqa: F401  (registers torch.ops.deepinfer.*, which this pass inserts)
from ..io.quant import fp8_block_of
from ..kernels import ops_bi  # noqa: F401  (declares deepinfer::bi_matmul_group)
from ..kernels.ops_linear import MAX_GROUP
from .manager import GraphPass, register_pass

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _rows_key(x: torch.fx.Node) -> tuple[torch.fx.Node, tuple[int, ...]]:
    """The node whose values x views, and x's shape: equal keys, equal rows."""
    shape = tuple(x.meta["val"].shape)
    root = x
    while isinstance(root, torch.fx.Node) and root.op == "call_function" and root.target in _VIEWS:
        root = root.args[0]
    return root, shape


# each projection op (args x, w[, scale], out_fp32) and its group op
_GROUPED = {
    torch.ops.deepinfer.skinny_linear.default: torch.ops.deepinfer.skinny_linear_group.default,
    torch.ops.deepinfer.skinny_linear_fp8.default: torch.ops.deepinfer.skinny_linear_fp8_group.default,
    torch.ops.deepinfer.bi_matmul.default: torch.ops.deepinfer.bi_matmul_group.default,
}


@register_pass
class SkinnyLinearGroup(GraphPass):
    """``deepinfer.skinny_linear`` x N on one input => ``deepinfer.skinny_linear_group`` (and the
    same for ``skinny_linear_fp8`` of one scale block, and ``bi_matmul``)."""

    name: ClassVar[str] = "skinny_linear_group"
    accelerators: ClassVar[frozenset[str]] = frozenset({"cpu", "nvidia"})

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in _GROUPED:
                continue
            x, w, *scale, out_fp32 = node.args
            wv = w.meta["val"]
            held = (
                () if not scale else (fp8_block_of(wv.shape, scale[0].meta["val"].shape), scale[0].meta["val"].stride())
            )
            groups[(*_rows_key(x), bool(out_fp32), wv.shape[1], wv.stride(), wv.dtype, held)].append(node)
        rewrites = 0
        for members in groups.values():
            first = members[0]
            members = [first] + [
                n for n in members[1:] if all(order.get(a, len(order)) < order[first] for a in n.args[1:-1])
            ]
            for start in range(0, len(members), MAX_GROUP):
                chunk = members[start : start + MAX_GROUP]
                if len(chunk) > 1:
                    self._replace(graph, chunk)
                    rewrites += 1
        return rewrites

    @staticmethod
    def _replace(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
        first = members[0]
        x, out_fp32 = first.args[0], first.args[-1]
        weights = [[n.args[1] for n in members]]
        if len(first.args) == 4:  # fp8: the scales beside the weights
            weights.append([n.args[2] for n in members])
        with graph.inserting_before(first):
            group = graph.call_function(_GROUPED[first.target], (x, *weights, out_fp32))
            group.meta["val"] = [n.meta["val"] for n in members]
            for i, node in enumerate(members):
                with graph.inserting_after(group):
                    item = graph.call_function(operator.getitem, (group, i))
                item.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(item)
        for node in members:
            graph.erase_node(node)
