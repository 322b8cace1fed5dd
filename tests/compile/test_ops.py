"""The custom ops: each reference equals the graphs function it stands for, each passes
``torch.library.opcheck``, and each traces under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs import indexer as indexer_mod
from deepinfer_fx.graphs import mhc, moe
from deepinfer_fx.graphs.batch import Group
from deepinfer_fx.graphs.attention import mqa_ring, mqa_with_sink
from deepinfer_fx.graphs.compressor import visible_entries
from deepinfer_fx.graphs.norm import rms_norm
from deepinfer_fx.kernels.ops import OPS
from tiny import tiny_v4

ops = torch.ops.deepinfer


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


# --- example inputs per op (shared by the three kinds of test) --------------------------------


def _rms_args(g: torch.Generator, dtype: torch.dtype = torch.float32, weighted: bool = True) -> tuple:
    x = _randn(g, 5, 3, 32, dtype=dtype)
    w = _randn(g, 32) if weighted else None
    return x, w, 1e-6


def _swiglu_args(g: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple:
    # Scaled up so that the clamps at +-2.5 actually bite.
    return _randn(g, 6, 16, dtype=dtype) * 3, _randn(g, 6, 16, dtype=dtype) * 3, 2.5


def _sinkhorn_args(g: torch.Generator) -> tuple:
    return _randn(g, 7, 4, 4) * 2, 1e-6, 20


def _mqa_args(g: torch.Generator) -> tuple:
    t, h, d, n = 5, 4, 16, 9
    bias = torch.zeros(t, n).masked_fill(torch.rand(t, n, generator=g) < 0.3, float("-inf"))
    bias[:, 0] = 0.0  # every query sees at least one key
    angles = torch.rand(t, 2, generator=g) * 6.3  # rope tables of the queries
    return _randn(g, t, h, d), _randn(g, n, d), bias, _randn(g, h), angles.cos(), angles.sin()


def _ring_args(g: torch.Generator) -> tuple:
    """Two chunks of a 4-slot pool, an 8-row ring (one chunk before it fills) whose queries see
    6 positions (2 spare rows), 10 entries a slot read through 6 rows, a third of them hidden."""
    c, h, d, w, e, k = 2, 4, 16, 8, 10, 6
    bias = torch.zeros(c, 1, k).masked_fill(torch.rand(c, 1, k, generator=g) < 0.3, float("-inf"))
    angles = torch.rand(c, 1, 2, generator=g) * 6.3
    return (
        _randn(g, c, 1, h, d),
        _randn(g, 4, w, d),
        torch.tensor([2, 0]),
        torch.tensor([5, 30]),
        _randn(g, 4, e, d),
        torch.randint(0, e, (c, k), generator=g),
        bias,
        _randn(g, h),
        angles.cos(),
        angles.sin(),
        w - 2,
    )


def _indexer_args(g: torch.Generator) -> tuple:
    t, hi, di, n = 6, 16, 8, 12
    visible = visible_entries(torch.arange(20, 20 + t), n, 2)
    return _randn(g, t, hi, di), _randn(g, n, di), _randn(g, t, hi), visible, 3


def _indexer_scores_args(g: torch.Generator) -> tuple:
    return (*_indexer_args(g)[:4], 8**-0.5)  # V4.1's dot scale, index_head_dim ** -0.5


def _topk_mask_args(g: torch.Generator) -> tuple:
    scores = _randn(g, 2, 3, 12).float()
    return scores.masked_fill(torch.rand(2, 3, 12, generator=g) < 0.4, float("-inf")), 5


def _moe_args(g: torch.Generator) -> tuple:
    t, d, i, e, k = 7, 16, 8, 5, 2
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return (
        _randn(g, t, d),
        _randn(g, e, i, d),
        _randn(g, e, i, d),
        _randn(g, e, d, i),
        idx,
        torch.rand(t, k, generator=g),
        3.0,
    )


def _route_args(g: torch.Generator, hashed: bool = False) -> tuple:
    t, e, k = 7, 12, 3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if hashed else None
    return _randn(g, t, e), None if hashed else _randn(g, e) * 0.1, ids, k, "sqrtsoftplus", 1.5, True, 2.5


def _moe_shared_args(g: torch.Generator) -> tuple:
    x, w1, w3, w2, idx, w, limit = _moe_args(g)
    i, d = w1.shape[1:]
    return (x, w1, w3, w2, _randn(g, i, d), _randn(g, i, d), _randn(g, d, i), idx, w, limit)


ARGS = {
    "rms_norm": _rms_args,
    "swiglu_clamp": _swiglu_args,
    "mhc_sinkhorn": _sinkhorn_args,
    "sparse_mqa": _mqa_args,
    "ring_mqa": _ring_args,
    "indexer_topk": _indexer_args,
    "indexer_scores": _indexer_scores_args,
    "topk_mask": _topk_mask_args,
    "moe_experts": _moe_args,
    "route_topk": _route_args,
    "moe_experts_shared": _moe_shared_args,
}


# --- reference == graphs function ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_graphs(seed: int, dtype: torch.dtype, weighted: bool) -> None:
    x, w, eps = _rms_args(_gen(seed), dtype, weighted)
    out = ops.rms_norm(x, w, eps)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm(x, w, eps), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [21, 22])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_clamp_matches_graphs(seed: int, dtype: torch.dtype) -> None:
    """graphs' swiglu projects first; feed it identity weights so its gate/up are our inputs."""
    g = _gen(seed)
    x = _randn(g, 6, 16, dtype=dtype) * 3
    w1, w3 = _randn(g, 16, 16), _randn(g, 16, 16)
    gate, up = (x @ w1.to(dtype).T), (x @ w3.to(dtype).T)
    torch.testing.assert_close(ops.swiglu_clamp(gate, up, 2.5), moe.swiglu(x, w1, w3, 2.5), rtol=0, atol=0)
    torch.testing.assert_close(ops.swiglu_clamp(gate, up, 0.0), moe.swiglu(x, w1, w3, 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [31, 32])
def test_mhc_sinkhorn_matches_graphs(seed: int) -> None:
    g = _gen(seed)
    t, n, d, iters, hc_eps, rms_eps = 5, 4, 8, 20, 1e-6, 1e-6
    X, fn = _randn(g, t, n, d), _randn(g, 2 * n + n * n, n * d)
    base, scale = _randn(g, 2 * n + n * n), _randn(g, 3)
    # The comb logits exactly as mhc_coeffs forms them.
    m_comb = mhc._mixes(X, fn, rms_eps)[:, 2 * n :]
    logits = (m_comb * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    _, _, comb = mhc.mhc_coeffs(X, fn, base, scale, rms_eps, hc_eps, iters)
    torch.testing.assert_close(ops.mhc_sinkhorn(logits, hc_eps, iters), comb, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [41, 42])
def test_sparse_mqa_matches_graphs(seed: int) -> None:
    args = _mqa_args(_gen(seed))
    torch.testing.assert_close(ops.sparse_mqa(*args), mqa_with_sink(*args), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [43, 44])
def test_ring_mqa_matches_graphs(seed: int) -> None:
    args = _ring_args(_gen(seed))
    torch.testing.assert_close(ops.ring_mqa(*args), mqa_ring(*args), rtol=0, atol=0)
    q, ring, slots, pos, *_, sink, cos, sin, window = args  # the window alone
    window_only = (q, ring, slots, pos, None, None, None, sink, cos, sin, window)
    torch.testing.assert_close(ops.ring_mqa(*window_only), mqa_ring(*window_only), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [51, 52])
@pytest.mark.parametrize("k", [3, 40])  # 40 > visible entries: masked picks must be dropped
def test_indexer_topk_matches_graphs(seed: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run graphs' select_entries with its projections, rope, fake quant and compressor
    replaced by identities, so that its scoring and top-k see exactly our op's inputs."""
    c = config_from_dict(tiny_v4(index_topk=k)).replace(fake_quant=False)
    hi, di, t, n, start = c.index_n_heads, c.index_head_dim, 6, 9, 30
    g = _gen(seed)
    q, keys, head_w_raw = _randn(g, t, hi, di), _randn(g, n, di), _randn(g, t, hi)
    monkeypatch.setattr(indexer_mod, "compress", lambda *a, **kw: keys[None])
    monkeypatch.setattr(indexer_mod, "apply_rope", lambda x, cos, sin: x)
    monkeypatch.setattr(indexer_mod, "linear_fp32", lambda x, w: x)  # head_w = x * scale
    p = {"compressor": None, "wq_b": torch.eye(hi * di), "weights_proj": None}
    g1 = Group.one(start, t)
    chosen = indexer_mod.select_entries(
        p, {}, c, None, g1, head_w_raw[None], q.flatten(1)[None], g1.positions, torch.ones(1)
    )[0]
    head_w = head_w_raw * (di**-0.5 * hi**-0.5)
    visible = visible_entries(torch.arange(start, start + t), n, c.csa_ratio)
    assert torch.equal(ops.indexer_topk(q, keys, head_w, visible, k), chosen)


@pytest.mark.parametrize("seed", [53, 54])
def test_indexer_scores_matches_graphs(seed: int) -> None:
    q, keys, head_w, visible, scale = _indexer_scores_args(_gen(seed))
    scores = ops.indexer_scores(q, keys, head_w, visible, scale)
    assert torch.equal(scores, indexer_mod.index_scores(q, keys, head_w, visible, scale))
    assert torch.equal(scores == float("-inf"), ~visible)


@pytest.mark.parametrize("seed", [61, 62])
def test_moe_experts_matches_graphs(seed: int) -> None:
    x, w1, w3, w2, idx, w, limit = _moe_args(_gen(seed))
    c = config_from_dict(tiny_v4(swiglu_limit=limit))
    expect = moe.routed_experts({"w1": w1, "w3": w3, "w2": w2}, c.swiglu_limit, x, idx, w)
    torch.testing.assert_close(ops.moe_experts(x, w1, w3, w2, idx, w, limit), expect, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [63, 64])
def test_moe_experts_shared_matches_graphs(seed: int) -> None:
    x, w1, w3, w2, sw1, sw3, sw2, idx, w, limit = _moe_shared_args(_gen(seed))
    real = torch.ones(len(x), dtype=torch.bool)
    expect = moe.experts_with_shared(
        {"w1": w1, "w3": w3, "w2": w2}, {"w1": sw1, "w3": sw3, "w2": sw2}, limit, x, idx, w, real
    )
    torch.testing.assert_close(
        ops.moe_experts_shared(x, w1, w3, w2, sw1, sw3, sw2, idx, w, limit), expect, rtol=0, atol=0
    )


# --- opcheck ----------------------------------------------------------------------------------

# All four default checks apply to every op: test_schema (no op mutates or aliases an input),
# test_autograd_registration (inputs do not require grad, and custom_op registers an autograd
# kernel that errors on backward), test_faketensor (fake metadata == real) and
# test_aot_dispatch_dynamic (traced under dynamic shapes). Nothing is skipped.


@pytest.mark.parametrize("name", sorted(ARGS))
def test_opcheck(name: str) -> None:
    args = ARGS[name](_gen(70 + sorted(ARGS).index(name)))
    torch.library.opcheck(OPS[name], args)


def test_opcheck_rms_norm_variants() -> None:
    """The optional weight and low-precision input paths of rms_norm, and a bf16 swiglu."""
    torch.library.opcheck(OPS["rms_norm"], _rms_args(_gen(81), torch.bfloat16, weighted=False))
    torch.library.opcheck(OPS["rms_norm"], _rms_args(_gen(82), torch.bfloat16, weighted=True))
    torch.library.opcheck(OPS["swiglu_clamp"], _swiglu_args(_gen(83), torch.bfloat16))
    torch.library.opcheck(OPS["route_topk"], _route_args(_gen(84), hashed=True))


# --- torch.compile traces through each op -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARGS))
def test_compiles_fullgraph(name: str) -> None:
    torch._dynamo.reset()
    args = ARGS[name](_gen(90 + sorted(ARGS).index(name)))
    op = getattr(ops, name)

    def f(*a):  # a wrapper with a little math around the op, so the graph is not just the op
        return op(*a) * 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args), rtol=0, atol=0)
