"""The ``mhc_site_kernel`` swap: ``deepinfer::mhc_site`` equals ``graphs/mhc.py::mhc_site`` (with
and without ``pre_in``, with and without the sublayer's norm weight), passes ``opcheck``, and
two sites wired as ``model.block`` wires them (V4: each site collapses with its own ``pre``;
V4.1: with the previous one; each returns its sublayer's normed input) compile to one op node
per site that equals eager, the norm inside it. With the swap off the reference is traced and
the Sinkhorn and RMSNorm fusions fill its place instead. The full model's steps are
``test_steps.py``; the kernel is ``tests/kernels/test_triton_mhc.py``."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.graphs.mhc import mhc_expand, mhc_site
from deepinfer_fx.graphs.norm import rms_norm
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.fusion import RMSNormFusion
from deepinfer_fx.passes.mhc_norm import MHCNormFusion
from deepinfer_fx.passes.swaps import MHCSiteSwap, SinkhornSwap

pytestmark = pytest.mark.usefixtures("fresh_compile")

SWAP = MHCSiteSwap.name
N, D, RMS_EPS, HC_EPS, ITERS = 4, 24, 1e-6, 1e-6, 20


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _site_params(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = 2 * N + N * N
    return torch.randn(m, N * D, generator=g) * (N * D) ** -0.5, torch.randn(m, generator=g), 0.5 + torch.rand(3, generator=g)


def _norm_weight(g: torch.Generator) -> torch.Tensor:
    return 1 + 0.5 * torch.randn(D, generator=g)


def _two_sites(X: torch.Tensor, a: tuple, f: tuple, w: torch.Tensor, pre_prev: torch.Tensor | None,
               norms: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """``model.block`` with a tanh layer for each sublayer (``norms``: the sublayers' norm
    weights, each applied to its site's collapse as ``block`` does, or none)."""
    pre_a, post, comb, u = mhc_site(X, *a, RMS_EPS, HC_EPS, ITERS, pre_prev)
    h = u if norms[0] is None else rms_norm(u, norms[0], RMS_EPS)
    X = mhc_expand(X, torch.tanh(h @ w), post, comb)
    pre_f, post, comb, u = mhc_site(X, *f, RMS_EPS, HC_EPS, ITERS, None if pre_prev is None else pre_a)
    h = u if norms[1] is None else rms_norm(u, norms[1], RMS_EPS)
    return mhc_expand(X, torch.tanh(h @ w.T), post, comb), pre_f


@pytest.mark.parametrize("lead", [(7,), (2, 3), (0,)], ids=["tokens", "chunks", "empty"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["u", "normed"])
@pytest.mark.parametrize("with_pre", [False, True], ids=["own-pre", "pre-in"])
def test_op_is_the_graphs_function(lead: tuple[int, ...], with_pre: bool, with_norm: bool) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(*lead, N, D, generator=g)
    pre_in = torch.rand(*lead, N, generator=g) if with_pre else None
    args = (X, *_site_params(g), RMS_EPS, HC_EPS, ITERS, pre_in, _norm_weight(g) if with_norm else None)
    got, want = torch.ops.deepinfer.mhc_site(*args), mhc_site.reference(*args[:8])  # type: ignore[attr-defined]
    if with_norm:  # the sublayer input: the norm of the graphs function's collapse
        want = (*want[:3], rms_norm(want[3], args[8], RMS_EPS))
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.mhc_site.default, args)


@pytest.mark.parametrize("which", ["v4", "v41"])
@pytest.mark.parametrize("passes", ["all", "no-norm-fusion", "no-site"])
@pytest.mark.parametrize("with_norm", [True, False], ids=["normed", "u"])
@pytest.mark.parametrize("tokens", [9, 17], ids=["decode-sized", "larger"])
def test_compiled_sites_equal_eager(which: str, passes: str, with_norm: bool, tokens: int) -> None:
    """With every pass, each site is the op and ``mhc_norm_fusion`` moves its sublayer's norm
    inside it (no RMSNorm node is left); without that pass the norms stay ``deepinfer.rms_norm``
    nodes; without the site swap the reference is traced with its Sinkhorn swap. All == eager."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, N, D, generator=g)
    w = torch.randn(D, D, generator=g) * D**-0.5
    pre_prev = torch.softmax(torch.randn(tokens, N, generator=g), -1) if which == "v41" else None
    norms = (_norm_weight(g), _norm_weight(g)) if with_norm else (None, None)
    args = (X, _site_params(g), _site_params(g), w, pre_prev, norms)
    disabled = {"all": (), "no-norm-fusion": (MHCNormFusion.name,), "no-site": (SWAP,)}[passes]
    be = make_backend("cpu", disabled=disabled, environ={})
    compiled = compile_graph(_two_sites, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    for a, b in zip(got, _two_sites(*args)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    rewrites = be.rewrites()
    site, norm_fused = passes != "no-site", passes == "all" and with_norm
    assert len(be.graphs) == 1 and rewrites.get(SWAP, 0) == 2 * int(site), f"seed={seed}"
    assert rewrites.get(SinkhornSwap.name, 0) == 2 * int(not site), f"seed={seed}"
    assert rewrites.get(RMSNormFusion.name, 0) == 2 * int(with_norm), f"seed={seed}"
    assert rewrites.get(MHCNormFusion.name, 0) == 2 * int(norm_fused), f"seed={seed}"
    graph = be.graphs[0].graph
    norms_left = sum(n.target is torch.ops.deepinfer.rms_norm.default for n in graph.nodes)
    assert norms_left == 2 * int(with_norm and not norm_fused), f"seed={seed}: {norms_left} RMSNorm nodes left"
    assert mhc_site.place == MHCSiteSwap.place  # type: ignore[attr-defined]


def test_inductor_lowers_the_normed_site() -> None:
    """Inductor (as the GPU pipeline runs it) lowers sites with and without a norm weight: it
    fills an op's defaulted arguments in and then asserts that the count did not change, which
    an op with a default for ``norm_w`` failed. Compiled == eager, norms inside the sites."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(3, N, D, generator=g)
    w = torch.randn(D, D, generator=g) * D**-0.5
    args = (X, _site_params(g), _site_params(g), w, None, (_norm_weight(g), None))
    be = make_backend("cpu", environ={}, inductor=True)
    compiled = compile_graph(_two_sites, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    for a, b in zip(got, _two_sites(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    assert be.rewrites().get(MHCNormFusion.name, 0) == 1 and be.rewrites().get(SWAP, 0) == 2, f"seed={seed}"
