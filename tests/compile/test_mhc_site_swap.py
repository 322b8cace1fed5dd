"""The ``mhc_site_kernel`` swap: ``deepinfer::mhc_site`` equals ``graphs/mhc.py::mhc_site`` (with
and without ``pre_in``), passes ``opcheck``, and two sites wired as ``model.block`` wires them
(V4: each site collapses with its own ``pre``; V4.1: with the previous one) compile to one op
node per site that equals eager. With the swap off the reference is traced and the Sinkhorn
swap fills its place instead. ``deepinfer::mhc_head`` equals ``graphs/mhc.py::hc_head`` (fp32
and bf16 streams), passes ``opcheck``, and put at the ``mhc.hc_head`` place traces as one op node.
The full model's steps are ``test_steps.py``; the kernels are ``tests/kernels/test_triton_mhc.py``."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.graphs.mhc import hc_head, mhc_expand, mhc_site
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.manager import registered_passes

pytestmark = pytest.mark.usefixtures("fresh_compile")

SITE, SINKHORN = registered_passes()["mhc_site_kernel"], registered_passes()["mhc_sinkhorn_kernel"]
SWAP = SITE.name
N, D, RMS_EPS, HC_EPS, ITERS = 4, 24, 1e-6, 1e-6, 20


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _site_params(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = 2 * N + N * N
    return (
        torch.randn(m, N * D, generator=g) * (N * D) ** -0.5,
        torch.randn(m, generator=g),
        0.5 + torch.rand(3, generator=g),
    )


def _two_sites(
    X: torch.Tensor, a: tuple, f: tuple, w: torch.Tensor, pre_prev: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """``model.block`` with a tanh layer for each sublayer."""
    pre_a, post, comb, u = mhc_site(X, *a, RMS_EPS, HC_EPS, ITERS, pre_prev)
    X = mhc_expand(X, torch.tanh(u @ w), post, comb)
    pre_f, post, comb, u = mhc_site(X, *f, RMS_EPS, HC_EPS, ITERS, None if pre_prev is None else pre_a)
    return mhc_expand(X, torch.tanh(u @ w.T), post, comb), pre_f


@pytest.mark.parametrize("lead", [(7,), (2, 3), (0,)], ids=["tokens", "chunks", "empty"])
@pytest.mark.parametrize("with_pre", [False, True], ids=["own-pre", "pre-in"])
def test_op_is_the_graphs_function(lead: tuple[int, ...], with_pre: bool) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(*lead, N, D, generator=g)
    pre_in = torch.rand(*lead, N, generator=g) if with_pre else None
    args = (X, *_site_params(g), RMS_EPS, HC_EPS, ITERS, pre_in)
    got, want = torch.ops.deepinfer.mhc_site(*args), mhc_site.reference(*args)  # type: ignore[attr-defined]
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.mhc_site.default, args)


@pytest.mark.parametrize("which", ["v4", "v41"])
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("tokens", [9, 17], ids=["decode-sized", "larger"])
def test_compiled_sites_equal_eager(which: str, enabled: bool, tokens: int) -> None:
    """Enabled, every site is the op; disabled, the reference with its Sinkhorn swap."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, N, D, generator=g)
    w = torch.randn(D, D, generator=g) * D**-0.5
    pre_prev = torch.softmax(torch.randn(tokens, N, generator=g), -1) if which == "v41" else None
    args = (X, _site_params(g), _site_params(g), w, pre_prev)
    be = make_backend("cpu", disabled=() if enabled else (SWAP,), environ={})
    compiled = compile_graph(_two_sites, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    for a, b in zip(got, _two_sites(*args)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    rewrites = be.rewrites()
    fused = enabled
    assert len(be.graphs) == 1 and rewrites.get(SWAP, 0) == 2 * int(fused), f"seed={seed}"
    assert rewrites.get(SINKHORN.name, 0) == 2 * int(not fused), f"seed={seed}"
    assert mhc_site.place == SITE.place  # type: ignore[attr-defined]


def _head_params(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(N, N * D, generator=g) * (N * D) ** -0.5,
        torch.randn(N, generator=g),
        0.5 + torch.rand(1, generator=g),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead", [(7,), (2, 3), (0,)], ids=["tokens", "chunks", "empty"])
def test_head_op_is_the_graphs_function(lead: tuple[int, ...], dtype: torch.dtype) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    args = (torch.randn(*lead, N, D, generator=g).to(dtype), *_head_params(g), RMS_EPS, HC_EPS)
    got, want = torch.ops.deepinfer.mhc_head(*args), hc_head.reference(*args)  # type: ignore[attr-defined]
    assert got.is_contiguous() and got.shape == (*lead, D) and got.dtype == dtype and torch.equal(got, want), (
        f"seed={seed}"
    )
    torch.library.opcheck(torch.ops.deepinfer.mhc_head.default, args)


def test_head_place_traces_to_the_op() -> None:
    """With the op at ``mhc.hc_head`` a compiled head is one op node (and the ``* 2``), equal to eager."""
    assert hc_head.place == "mhc.hc_head"  # type: ignore[attr-defined]
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    X, params = torch.randn(9, N, D, generator=g), _head_params(g)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    compiled = torch.compile(lambda x: hc_head(x, *params, RMS_EPS, HC_EPS) * 2, backend=backend, fullgraph=True)
    with torch.no_grad(), swapped({"mhc.hc_head": torch.ops.deepinfer.mhc_head}):
        got = compiled(X)
    assert torch.equal(got, hc_head.reference(X, *params, RMS_EPS, HC_EPS) * 2), f"seed={seed}"  # type: ignore[attr-defined]
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    op = torch.ops.deepinfer.mhc_head
    assert len(graphs) == 1 and len(targets) == 2 and sum(t in (op, op.default) for t in targets) == 1, (
        targets
    )  # op, * 2
