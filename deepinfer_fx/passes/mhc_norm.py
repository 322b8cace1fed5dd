"""The sublayer's input norm into the mHC site: ``deepinfer.rms_norm`` of a site's collapse =>
the same ``deepinfer.mhc_site`` node with the norm's weight.

Each block normalises the sublayer input that an mHC site collapses from the streams,
``rms_norm(u, attn_norm / ffn_norm, eps)`` (``graphs/model.py::block``). The model keeps the
two functions apart, as the spec writes them; on the traced graph, where ``rms_norm_fusion``
has made the norm one ``deepinfer.rms_norm`` node and ``mhc_site_kernel`` the site one
``deepinfer.mhc_site`` node, this pass hands the norm to the site, whose second launch then
normalises the collapsed row while it is in registers (``kernels/triton/mhc.py``, ``NORM``):
one launch fewer per site, 16 a decode step.

A site takes the norm when its collapse feeds that norm only, the norm has a weight and the
site's own ``rms_eps``, and the weight exists where the site stands (a parameter, or computed
before it). The op's reference is the site's reference followed by ``graphs/norm.py::rms_norm``,
the same math as the norm node it replaces, so on CPU the rewrite changes no bits.
"""

from __future__ import annotations

import operator
from typing import ClassVar

import torch
import torch.fx

from .. import kernels  # noqa: F401  (registers torch.ops.deepinfer.*, which this pass rewrites)
from .manager import GraphPass, register_pass

_U = 3  # the site's collapse is its fourth output
_NORM_W = 8  # position of norm_w among mhc_site's arguments


def _site_of(x: object) -> torch.fx.Node | None:
    """The ``mhc_site`` node (not yet normed) whose collapse ``x`` is, and which has no other reader."""
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target is operator.getitem
            and x.args[1] == _U and len(x.users) == 1):
        return None
    site = x.args[0]
    if not (isinstance(site, torch.fx.Node) and site.target is torch.ops.deepinfer.mhc_site.default
            and len(site.args) == _NORM_W + 1 and not site.kwargs):
        return None
    return None if site.args[_NORM_W] is not None else site


@register_pass
class MHCNormFusion(GraphPass):
    """``deepinfer.rms_norm(mhc_site(...)[3], w, eps)`` => ``mhc_site(..., norm_w=w)[3]``."""

    name: ClassVar[str] = "mhc_norm_fusion"
    accelerators: ClassVar[frozenset[str]] = frozenset({"cpu", "nvidia"})

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        order = {node: i for i, node in enumerate(graph.nodes)}
        rewrites = 0
        for norm in list(graph.nodes):
            if not (norm.op == "call_function" and norm.target is torch.ops.deepinfer.rms_norm.default):
                continue
            x, w, eps = norm.args
            site = _site_of(x)
            if site is None or w is None or order.get(w, len(order)) >= order[site] or float(eps) != float(site.args[4]):
                continue
            site.args = (*site.args[:_NORM_W], w)
            norm.replace_all_uses_with(x)
            graph.erase_node(norm)
            rewrites += 1
        return rewrites
