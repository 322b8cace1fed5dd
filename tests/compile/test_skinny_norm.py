"""The ``skinny_linear_norm`` pass: an RMSNorm whose only reader is a decode-sized projection (or
a group of them) becomes one ``deepinfer::skinny_linear_norm`` node over the norm's input; a
norm with other readers stays; compiled equals eager (on CPU the ops run their references),
with Inductor too."""

from __future__ import annotations

import operator

import pytest
import torch

from deepinfer_fx.graphs.norm import linear, linear_fp32, rms_norm
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.grouping import SkinnyLinearNorm

pytestmark = pytest.mark.usefixtures("fresh_compile")

PASS = SkinnyLinearNorm.name
FUSED = torch.ops.deepinfer.skinny_linear_norm.default
NORM = torch.ops.deepinfer.rms_norm.default
EPS = 1e-6


def block(x: torch.Tensor, wa: torch.Tensor, nq: torch.Tensor, wb: torch.Tensor, wi: torch.Tensor, nh: torch.Tensor,
          wh: torch.Tensor, nv: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Like a layer's decode and the head: a query latent normed and read by two projections
    (one group), a normed row read by an fp32 projection alone (through a view), and a normed
    row read by a projection and by something else."""
    q_r = rms_norm(linear(x, wa), nq, EPS)
    q, qi = linear(q_r, wb), linear(q_r, wi)
    h = linear_fp32(rms_norm(x, nh, EPS).view(2, 2, -1), wh)
    v = rms_norm(x * 2, nv, EPS)
    return q, qi, h, linear(v, wv), v * 3


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * (shape[-1] ** -0.5 if scale is None else scale)).to(torch.bfloat16)

    def norm_weight(n: int) -> torch.Tensor:
        return (1 + 0.3 * torch.randn(n, generator=g)).to(torch.bfloat16)

    return (r(4, 64, scale=3.0), r(32, 64), norm_weight(32), r(48, 32), r(16, 32), norm_weight(64), r(32, 64),
            norm_weight(64), r(16, 64))


@pytest.mark.parametrize("inductor", [False, True], ids=["aot-eager", "inductor"])
@pytest.mark.parametrize("enabled", [True, False])
def test_norms_read_by_one_projection_fuse(enabled: bool, inductor: bool) -> None:
    seed = torch.seed() % 2**31
    args = _inputs(seed)
    be = make_backend("cpu", disabled=() if enabled else (PASS,), environ={}, inductor=inductor)
    compiled = compile_graph(block, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    want = block(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"seed={seed} output {i}"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed} output {i}: {m}")
    nodes = [n for n in be.graphs[-1].graph.nodes if n.op == "call_function"]
    fused = [n for n in nodes if n.target is FUSED]
    norms = [n for n in nodes if n.target is NORM]
    if not enabled:
        assert not fused and len(norms) == 3
        return
    assert be.rewrites()[PASS] == 2, f"seed={seed}"
    # q_norm with its group of two (bf16), the head-like norm with its fp32 projection; v stays
    assert sorted((len(n.args[3]), n.args[4]) for n in fused) == [(1, True), (2, False)], f"seed={seed}"
    assert len(norms) == 1 and norms[0].args[1].name == "arg7_1", f"seed={seed}: {[n.args for n in norms]}"
    for n in fused:
        assert all(u.target is operator.getitem for u in n.users)
