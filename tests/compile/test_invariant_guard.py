"""The guard of batch-invariant compiled steps (``passes/invariant_guard.py``): a graph that sums
floats outside the fixed-order ops is refused, naming the node; exact reductions (max, argmax,
integer sums) and the ``deepinfer::bi_*`` ops pass; the Inductor settings it asks for exist."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.kernels import ops_bi  # noqa: F401  (declares deepinfer::bi_*)
from deepinfer_fx.passes.compiler import make_backend
from deepinfer_fx.passes.invariant_guard import INDUCTOR_PATCHES, inductor_patches


def _compile(fn, invariant: bool = True):
    torch._dynamo.reset()
    backend = make_backend("cpu", name="guarded", invariant=invariant, environ={})
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def _float_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(-1)


def _matmul(x: torch.Tensor) -> torch.Tensor:
    return x @ x.T


def _scatter_add(x: torch.Tensor) -> torch.Tensor:
    idx = torch.tensor([0, 1, 0], dtype=torch.long)
    return torch.zeros(2, x.shape[1]).index_put((idx,), x[:3], accumulate=True)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


@pytest.mark.parametrize("fn", [_float_sum, _matmul, _scatter_add, _softmax])
def test_float_sums_are_refused(fn) -> None:
    x = torch.randn(4, 8)
    compiled, _ = _compile(fn)
    with pytest.raises(Exception, match="batch-invariant step 'guarded' sums floats outside the deepinfer::bi_"):
        compiled(x)
    plain, _ = _compile(fn, invariant=False)  # without the flag the same graph compiles
    torch.testing.assert_close(plain(x), fn(x))


def _exact(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.ops.deepinfer.bi_sum(torch.exp(x) * 0.5, -1, False)
    return y, x.amax(-1), x.argmax(-1), (ids * 3).sum(-1), (x > 0).any(-1), torch.cumsum(ids, -1)


def test_exact_reductions_and_fixed_order_ops_pass() -> None:
    x, ids = torch.randn(5, 16), torch.randint(0, 9, (5, 16))
    compiled, backend = _compile(_exact)
    for got, want in zip(compiled(x, ids), _exact(x, ids)):
        assert torch.equal(got, want)
    assert backend.graphs and backend._describe()["batch_invariant"]
    assert backend.cache_key() != make_backend("cpu", name="guarded", environ={}).cache_key()


def test_inductor_settings_exist() -> None:
    """The settings that make Inductor's fused pointwise code round as eager does are known to
    this torch (2.11 on the GPU machine knows the same; ``inductor_patches`` drops unknown ones)."""
    assert inductor_patches()["emulate_precision_casts"] is True
    assert set(inductor_patches()) <= set(INDUCTOR_PATCHES)
