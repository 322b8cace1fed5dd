"""The ``skinny_linear_group`` pass: decode-sized projections of the same rows become one
``deepinfer::skinny_linear_group`` node per result dtype; projections of other rows, and one
whose weight is computed after the group's place, stay alone; compiled equals eager (on CPU the
ops run their references), with Inductor too."""

from __future__ import annotations

import operator

import pytest
import torch

from deepinfer_fx.graphs.norm import linear, linear_fp32
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.kernels.ops_linear import MAX_GROUP
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.grouping import SkinnyLinearGroup

pytestmark = pytest.mark.usefixtures("fresh_compile")

PASS = SkinnyLinearGroup.name
GROUP = torch.ops.deepinfer.skinny_linear_group.default
SINGLE = torch.ops.deepinfer.skinny_linear.default


def layer(
    x: torch.Tensor,
    wa: torch.Tensor,
    wb: torch.Tensor,
    wc: torch.Tensor,
    wd: torch.Tensor,
    we: torch.Tensor,
    wf: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Like an attention block's decode: two bf16 and two fp32 projections of x (one through a
    view of x), a projection of another input, and one of a weight computed in the step."""
    a = linear(x, wa)
    c = linear_fp32(x, wc)
    b = linear(x.view(2, 2, -1), wb)
    d = linear_fp32(x, wd)
    e = linear(a * 2, we)
    f = linear(x, wf * 2)
    return a, b, c, d, e, f


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    return r(4, 64), r(32, 64), r(48, 64), r(16, 64), r(64, 64), r(16, 32), r(32, 64)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("inductor", [False, True], ids=["aot-eager", "inductor"])
@pytest.mark.parametrize("enabled", [True, False])
def test_projections_of_one_input_run_as_one_group(enabled: bool, inductor: bool) -> None:
    seed = torch.seed() % 2**31
    args = _inputs(seed)
    be = make_backend("cpu", disabled=() if enabled else (PASS,), environ={}, inductor=inductor)
    compiled = compile_graph(layer, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    want = layer(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"seed={seed} output {i}"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed} output {i}: {m}")
    targets = _targets(be.graphs[-1])
    if not enabled:
        assert GROUP not in targets and targets.count(SINGLE) == 6
        return
    assert be.rewrites()[PASS] == 2, f"seed={seed}"
    groups = [n for n in be.graphs[-1].graph.nodes if n.target is GROUP]
    # the bf16 pair (x and its view) and the fp32 pair; e (other rows) and f (a computed weight) alone
    assert sorted(len(n.args[1]) for n in groups) == [2, 2] and targets.count(SINGLE) == 2
    assert {n.args[2] for n in groups} == {False, True}
    for n in groups:
        assert all(u.target is operator.getitem for u in n.users)


def test_groups_hold_at_most_max_group_weights() -> None:
    """Eight projections of one input: a group of six and a group of two."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(2, 32, generator=g).to(torch.bfloat16)
    ws = [torch.randn(16, 32, generator=g).to(torch.bfloat16) for _ in range(MAX_GROUP + 2)]

    def many(x: torch.Tensor, *ws: torch.Tensor) -> list[torch.Tensor]:
        return [linear(x, w) for w in ws]

    be = make_backend("cpu", environ={})
    compiled = compile_graph(many, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(x, *ws)
    for a, b in zip(got, many(x, *ws)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    sizes = sorted(len(n.args[1]) for n in be.graphs[-1].graph.nodes if n.target is GROUP)
    assert sizes == [2, MAX_GROUP]


def test_fp8_projections_of_one_input_group_by_block() -> None:
    """Block-FP8 weights held as stored: two 32-block projections of x group into one
    ``skinny_linear_fp8_group``; a 128-block one of the same x stays alone (one scale block a
    group), and the bf16 projection beside them joins the bf16 group only; compiled == eager."""
    from deepinfer_fx.io.quant import quant_fp8_block, ue8m0_to_float

    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 128, generator=g).to(torch.bfloat16)

    def fp8(n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = quant_fp8_block(torch.randn(n, 128, generator=g) * 128**-0.5, block)
        return w, ue8m0_to_float(s)

    (wa, sa), (wb, sb), (wc, sc) = fp8(64, 32), fp8(32, 32), fp8(128, 128)
    wd = (torch.randn(16, 128, generator=g) * 128**-0.5).to(torch.bfloat16)

    def step(x, wa, sa, wb, sb, wc, sc, wd):
        return linear(x, wa, sa), linear(x, wb, sb), linear(x, wc, sc), linear(x, wd)

    args = (x, wa, sa, wb, sb, wc, sc, wd)
    be = make_backend("cpu", environ={})
    compiled = compile_graph(step, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    for i, (a, b) in enumerate(zip(got, step(*args))):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"seed={seed} output {i}: {m}")
    targets = _targets(be.graphs[-1])
    groups = [n for n in be.graphs[-1].graph.nodes if n.target is torch.ops.deepinfer.skinny_linear_fp8_group.default]
    assert len(groups) == 1 and len(groups[0].args[1]) == 2 and len(groups[0].args[2]) == 2, f"seed={seed}"
    assert targets.count(torch.ops.deepinfer.skinny_linear_fp8.default) == 1 and targets.count(SINGLE) == 1


def test_batch_invariant_projections_group_bit_for_bit() -> None:
    """Under batch invariance (the table's ``norm.project`` form: ``deepinfer::bi_matmul``) the
    projections of one input group into one ``bi_matmul_group`` per result dtype, and compiled
    equals eager bit for bit (the group's kernel keeps each projection's bits), fp32 and bf16."""
    from deepinfer_fx.passes.batch_invariant import batch_invariant_swaps

    seed = torch.seed() % 2**31
    for dtype in (torch.float32, torch.bfloat16):
        args = tuple(a.to(dtype) for a in _inputs(seed))
        be = make_backend("cpu", environ={}, invariant=True)
        compiled = compile_graph(layer, be)
        with torch.no_grad(), swapped(batch_invariant_swaps()):
            got = compiled(*args)
            want = layer(*args)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"seed={seed} {dtype} output {i}"
        groups = [n for n in be.graphs[-1].graph.nodes if n.target is torch.ops.deepinfer.bi_matmul_group.default]
        assert sorted(len(n.args[1]) for n in groups) == [2, 2], f"seed={seed} {dtype}"
        assert _targets(be.graphs[-1]).count(torch.ops.deepinfer.bi_matmul.default) == 2
