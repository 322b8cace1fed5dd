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

Then ``skinny_linear_norm``: an RMSNorm whose only reader (through views) is one such
projection or group, as ``q_norm`` before ``wq_b`` (and the indexer's ``wq_b``) and the final
norm before the head, becomes one ``deepinfer::skinny_linear_norm`` node over the norm's input,
which the CUDA kernel takes in one launch (``kernels/triton/linear.py``). A norm with other
readers (a layer's ``attn_norm`` in compressed layers, read by two groups) stays.
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
            group = graph.call_function(torch.ops.deepinfer.skinny_linear_group.default,
                                        (x, [n.args[1] for n in members], out_fp32))
            group.meta["val"] = [n.meta["val"] for n in members]
            for i, node in enumerate(members):
                with graph.inserting_after(group):
                    item = graph.call_function(operator.getitem, (group, i))
                item.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(item)
        for node in members:
            graph.erase_node(node)


_NORM = torch.ops.deepinfer.rms_norm.default
_SINGLE = torch.ops.deepinfer.skinny_linear.default
_GROUP = torch.ops.deepinfer.skinny_linear_group.default


def _readers(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes that read ``node``'s values, looking through views."""
    found: set[torch.fx.Node] = set()
    for user in node.users:
        found |= _readers(user) if user.op == "call_function" and user.target in _VIEWS else {user}
    return found


@register_pass
class SkinnyLinearNorm(GraphPass):
    """``deepinfer.rms_norm`` read only by a ``skinny_linear`` (group) => ``deepinfer.skinny_linear_norm``."""

    name: ClassVar[str] = "skinny_linear_norm"
    accelerators: ClassVar[frozenset[str]] = frozenset({"cpu", "nvidia"})

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        rewrites = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (_SINGLE, _GROUP):
                continue
            norm, shape = _rows_key(node.args[0])
            if not (isinstance(norm, torch.fx.Node) and norm.target is _NORM and not norm.kwargs
                    and len(norm.args) == 3 and norm.args[1] is not None and _readers(norm) == {node}):
                continue
            x, weight, eps = norm.args
            ws = node.args[1] if node.target is _GROUP else [node.args[1]]
            with graph.inserting_before(node):
                rows = graph.call_function(torch.ops.aten.reshape.default, (x, list(shape)))
                rows.meta["val"] = x.meta["val"].reshape(shape)
                fused = graph.call_function(torch.ops.deepinfer.skinny_linear_norm.default, (rows, weight, eps, ws, node.args[2]))
                fused.meta["val"] = node.meta["val"] if node.target is _GROUP else [node.meta["val"]]
            if node.target is _GROUP:
                node.replace_all_uses_with(fused)
            else:
                with graph.inserting_after(fused):
                    item = graph.call_function(operator.getitem, (fused, 0))
                item.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(item)
            _erase_unread(graph, node)
            rewrites += 1
        return rewrites


def _erase_unread(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and then whatever only it read, up through views to the norm (whose other
    views, left unread when their projections were grouped, go too)."""
    erased: set[torch.fx.Node] = set()

    def erase(n: torch.fx.Node) -> None:
        inputs = [a for a in n.all_input_nodes if a.op == "call_function" and (a.target in _VIEWS or a.target is _NORM)]
        graph.erase_node(n)
        erased.add(n)
        for a in inputs:
            for view in [u for u in a.users if u.target in _VIEWS and not u.users]:
                erase(view)
            if a not in erased and not a.users:
                erase(a)

    erase(node)
