"""Kernel swaps decline calls their kernel cannot serve (``SwapRow.unserved``): the reference
runs there, the compiled result equals eager, and the pass's record of the graph, the backend's
``declines()``, the dump index and a warning say why. At the released widths nothing declines
(``tests/kernels/test_released_widths_sm90.py`` traces every released config)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from deepinfer_fx.graphs.mhc import mhc_expand, mhc_site
from deepinfer_fx.graphs.moe import route_weights
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.kernels.ops import ROUTE_MAX_EXPERTS
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.manager import registered_passes

pytestmark = pytest.mark.usefixtures("fresh_compile")

D, RMS_EPS, HC_EPS, ITERS = 16, 1e-6, 1e-6, 20
SITE, SINKHORN, ROUTER = (
    registered_passes()[n] for n in ("mhc_site_kernel", "mhc_sinkhorn_kernel", "route_topk_kernel")
)


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _site(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _, post, comb, u = mhc_site(X, fn, base, scale, RMS_EPS, HC_EPS, ITERS, None)
    return mhc_expand(X, torch.tanh(u), post, comb)


@pytest.mark.parametrize("n", [3, 4])
def test_mhc_site_declines_streams_it_does_not_tile(n: int, tmp_path) -> None:
    """3 streams (no power of two): the site and the Sinkhorn swaps both decline, the reference
    is traced, and the reason reaches the record, the dump and a warning; 4 streams: no decline."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    args = (
        torch.randn(5, n, D, generator=g),
        torch.randn(m, n * D, generator=g) * (n * D) ** -0.5,
        torch.randn(m, generator=g),
        0.5 + torch.rand(3, generator=g),
    )
    be = make_backend("cpu", dump_dir=tmp_path, name="site", environ={})
    compiled = compile_graph(_site, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(*args)
    torch.testing.assert_close(got, _site(*args), rtol=1e-6, atol=1e-6, msg=lambda msg: f"seed={seed}: {msg}")
    why = f"{n} mHC streams: the mHC kernels tile a power of two up to 16"
    declined = {SITE.name: [why], SINKHORN.name: [why]} if n == 3 else {}
    assert be.declines() == declined, f"seed={seed}"
    assert be.rewrites().get(SITE.name, 0) == int(n == 4) and be.rewrites().get(SINKHORN.name, 0) == 0
    assert [str(w.message) for w in caught if "declines" in str(w.message)] == [
        f"kernel swap {name!r} declines a call: {why}; the reference runs there" for name in declined
    ]
    stages = {s["label"]: s for s in json.loads((tmp_path / "site" / "index.json").read_text())["stages"]}
    assert stages[SITE.name]["declined"] == declined.get(SITE.name, [])
    assert (why in (tmp_path / "site" / "index.md").read_text()) == (n == 3)
    # a second graph of the same shapes declines again in its own record, not the first one's
    be2 = make_backend("cpu", environ={})
    with torch.no_grad(), swapped(be2.pipeline.swaps()):
        compile_graph(_site, be2)(*args)
    assert be2.declines() == declined and [len(r.declined) for r in be.records[0] if r.name == SITE.name] == [
        int(n == 3)
    ]


def test_router_declines_more_experts_than_its_tile() -> None:
    """A router over more experts than one program holds declines; the routing equals eager."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    e = ROUTE_MAX_EXPERTS + 1
    logits, bias = torch.randn(3, e, generator=g), torch.randn(e, generator=g)

    def route(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_weights(logits, bias, None, 6, "sqrtsoftplus", 1.0, True, 1.5)

    be = make_backend("cpu", environ={})
    with torch.no_grad(), swapped(be.pipeline.swaps()), pytest.warns(UserWarning, match="declines"):
        idx, w = compile_graph(route, be)(logits, bias)
    want_idx, want_w = route(logits, bias)
    assert torch.equal(idx.sort(-1).values, want_idx.sort(-1).values) and torch.allclose(w.sum(-1), want_w.sum(-1)), (
        f"seed={seed}"
    )
    assert be.declines() == {ROUTER.name: [f"{e} experts: the router kernel holds at most {ROUTE_MAX_EXPERTS} a token"]}
    assert be.rewrites().get(ROUTER.name, 0) == 0
