"""Decode projections of one input in one launch: ``deepinfer.skinny_linear`` nodes that read
the same rows => one ``deepinfer.skinny_linear_group`` node and a ``getitem`` per projection.

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
split of K), as any change of tiling does.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import ClassVar

import torch
import torch.fx

from .. import kernels  # noqa: F401  (registers torch.ops.deepinfer.*, which this pass inserts)
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


@register_pass
class SkinnyLinearGroup(GraphPass):
    """``deepinfer.skinny_linear`` x N on one input => ``deepinfer.skinny_linear_group``."""

    name: ClassVar[str] = "skinny_linear_group"
    accelerators: ClassVar[frozenset[str]] = frozenset({"cpu", "nvidia"})

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.deepinfer.skinny_linear.default:
                x, w, out_fp32 = node.args
                wv = w.meta["val"]
                groups[(*_rows_key(x), bool(out_fp32), wv.shape[1], wv.stride(), wv.dtype)].append(node)
        rewrites = 0
        for members in groups.values():
            first = members[0]
            members = [first] + [n for n in members[1:] if order.get(n.args[1], len(order)) < order[first]]
            for start in range(0, len(members), MAX_GROUP):
                chunk = members[start : start + MAX_GROUP]
                if len(chunk) > 1:
                    self._replace(graph, chunk)
                    rewrites += 1
        return rewrites

    @staticmethod
    def _replace(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
        x, _, out_fp32 = members[0].args
        with graph.inserting_before(members[0]):
            group = graph.call_function(
                torch.ops.deepinfer.skinny_linear_group.default, (x, [n.args[1] for n in members], out_fp32)
            )
            group.meta["val"] = [n.meta["val"] for n in members]
            for i, node in enumerate(members):
                with graph.inserting_after(group):
                    item = graph.call_function(operator.getitem, (group, i))
                item.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(item)
        for node in members:
            graph.erase_node(node)
