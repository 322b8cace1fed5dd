"""deepinfer_fx.engine.sampler: the counter-based hash matches its Python reference; greedy and
degenerate filters equal argmax; a row's sample depends only on (logits, seed, position), not on
its batch; the empirical distributions match softmax(logits / T) and its truncations; filtered
tokens are never drawn; ``sample`` traces without host synchronisation; logprobs match log_softmax.

Every test draws a fresh seed from ``random.SystemRandom`` and prints it when it fails."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer_fx.engine.sampler import (
    SamplingTensors,
    derive_seed,
    exponentials,
    hash_bits,
    hash_py,
    logprobs,
    row_key,
    sample,
)
from deepinfer_fx.engine.sampling import SamplingParams

SYS = random.SystemRandom()
CHI2_1E6 = {0: math.inf, 1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89}  # chi-square critical values, p = 1e-6


def fresh() -> tuple[int, torch.Generator]:
    seed = SYS.randrange(2**31)
    return seed, torch.Generator().manual_seed(seed)


def tensors(B: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0) -> SamplingTensors:
    """Per-row tensors from scalars or [B] tensors (broadcast)."""

    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(B).clone()

    return SamplingTensors(
        col(temperature, torch.float32),
        col(top_k, torch.int64),
        col(top_p, torch.float32),
        col(min_p, torch.float32),
        col(seed, torch.int64),
        col(position, torch.int64),
    )


def to_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_hash_matches_python_reference() -> None:
    s, _ = fresh()
    rng = random.Random(s)
    seeds = [0, 1, 2**63 - 1, 2**62] + [rng.randrange(2**63) for _ in range(28)]
    positions = [0, 1, 2**40, 2**63 - 1] + [rng.randrange(1 << 20) for _ in range(28)]
    index = [[0, 1, 2, 129279] + [rng.randrange(1 << 18) for _ in range(12)] for _ in seeds]
    got = hash_bits(row_key(torch.tensor(seeds), torch.tensor(positions)).unsqueeze(-1), torch.tensor(index))
    want = [[to_signed(hash_py(a, b, c)) for c in row] for a, b, row in zip(seeds, positions, index)]
    assert got.tolist() == want, f"seed={s}"


def test_exponentials_are_exp1() -> None:
    s, _ = fresh()
    key = row_key(torch.tensor([s]), torch.tensor([s % 1000])).unsqueeze(-1)
    e = exponentials(key, torch.arange(200_000).unsqueeze(0)).double()
    assert torch.isfinite(e).all() and (e > 0).all(), f"seed={s}"
    assert abs(e.mean().item() - 1) < 0.02 and abs(e.var().item() - 1) < 0.05, f"seed={s}"
    # P(E > 1) = 1/e.
    assert abs((e > 1).double().mean().item() - math.exp(-1)) < 0.01, f"seed={s}"


def test_greedy_rows_equal_argmax() -> None:
    s, g = fresh()
    B, V = 64, 500
    logits = torch.randn(B, V, generator=g) * 3
    temp = torch.rand(B, generator=g) + 0.2
    greedy = torch.rand(B, generator=g) < 0.5
    temp[greedy] = 0
    t = tensors(
        B,
        temperature=temp,
        top_k=torch.randint(0, 50, (B,), generator=g),
        top_p=0.9,
        min_p=0.05,
        seed=torch.randint(0, 2**62, (B,), generator=g),
        position=torch.arange(B),
    )
    out = sample(logits, t)
    assert out.dtype == torch.int64 and out.shape == (B,)
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy]), f"seed={s}"


def test_sample_independent_of_batch_row_and_size() -> None:
    s, g = fresh()
    V, N = 300, 24
    logits = torch.randn(N, V, generator=g) * 2
    t = tensors(
        N,
        temperature=torch.rand(N, generator=g) * 1.5 + 0.1,
        top_k=torch.randint(0, 40, (N,), generator=g),
        top_p=torch.rand(N, generator=g) * 0.9 + 0.1,
        min_p=torch.rand(N, generator=g) * 0.2,
        seed=torch.randint(0, 2**62, (N,), generator=g),
        position=torch.randint(0, 10_000, (N,), generator=g),
    )
    fields = ("temperature", "top_k", "top_p", "min_p", "seed", "position")
    alone = torch.stack(
        [sample(logits[i : i + 1], SamplingTensors(*(getattr(t, f)[i : i + 1] for f in fields)))[0] for i in range(N)]
    )
    for B in (N, N + 7, 3 * N):
        # Put the N requests at random rows of a bigger batch of random neighbours.
        rows = torch.randperm(B, generator=g)[:N]
        big_logits = torch.randn(B, V, generator=g) * 2
        big_logits[rows] = logits
        big = tensors(
            B,
            temperature=0.8,
            top_k=5,
            top_p=0.5,
            seed=torch.randint(0, 2**62, (B,), generator=g),
            position=torch.randint(0, 10_000, (B,), generator=g),
        )
        for f in fields:
            getattr(big, f)[rows] = getattr(t, f)
        assert torch.equal(sample(big_logits, big)[rows], alone), f"seed={s} B={B}"


def test_different_seeds_and_positions_give_different_samples() -> None:
    s, g = fresh()
    V, n = 1000, 256
    logits = torch.randn(1, V, generator=g).expand(n, V)
    by_seed = sample(logits, tensors(n, seed=torch.randperm(2**20, generator=g)[:n] + s, position=7))
    by_pos = sample(logits, tensors(n, seed=s, position=torch.arange(n) * 3))
    # 256 draws over a 1000-token vocabulary: about 226 distinct expected if independent.
    assert by_seed.unique().numel() > 150, f"seed={s} distinct={by_seed.unique().numel()}"
    assert by_pos.unique().numel() > 150, f"seed={s} distinct={by_pos.unique().numel()}"
    assert (by_seed[1:] != by_seed[:-1]).float().mean() > 0.9, f"seed={s}"
    assert (by_pos[1:] != by_pos[:-1]).float().mean() > 0.9, f"seed={s}"


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6), dict(top_p=0.01, top_k=4)])
def test_degenerate_filters_equal_argmax(kw: dict) -> None:
    s, g = fresh()
    B, V = 256, 2000
    logits = torch.randn(B, V, generator=g) * 0.5  # flat: a top token with < 1% mass
    t = tensors(
        B,
        temperature=torch.rand(B, generator=g) * 3 + 0.5,
        seed=torch.randint(0, 2**62, (B,), generator=g),
        position=torch.arange(B),
        **kw,
    )
    assert torch.equal(sample(logits, t), logits.argmax(-1)), f"seed={s} {kw}"


def reference_probs(
    logits: torch.Tensor, T: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 truncated distribution of one row, and the tokens that are out beyond ``margin``
    (a token nearly on a float32 boundary may go either way on the device)."""
    p = torch.softmax(logits.double() / T, -1)
    sp, order = torch.sort(p, descending=True, stable=True)
    rank = torch.arange(len(p))
    keep = rank < (top_k if top_k > 0 else len(p))
    r = sp * keep / (sp * keep).sum()
    before = torch.cumsum(r, -1) - r
    keep_p = keep & ((before < top_p) | (top_p >= 1))
    keep_m = keep_p & (sp >= min_p * sp[0])
    surely_out = ~keep | ((before > top_p + margin) & (top_p < 1)) | (sp < min_p * sp[0] * (1 - margin))
    q = torch.zeros_like(p)
    q[order] = torch.where(keep_m, sp, 0.0)
    out = torch.zeros(len(p), dtype=torch.bool)
    out[order] = surely_out
    return q / q.sum(), out


@pytest.mark.parametrize("kw", [dict(), dict(top_k=3), dict(top_p=0.7)], ids=["plain", "top_k3", "top_p0.7"])
def test_empirical_distribution(kw: dict) -> None:
    s, g = fresh()
    V, n = 6, 20_000
    while True:  # logits whose top-p cut is not within float error of a boundary
        logits = torch.rand(V, generator=g) * 3 - 1.5
        T = float(torch.rand((), generator=g)) * 0.8 + 0.7
        q, _ = reference_probs(logits, T, **kw)
        sp = torch.softmax(logits.double() / T, -1).sort(descending=True).values
        if ((sp.cumsum(-1) - 0.7).abs() > 0.02).all():
            break
    t = tensors(n, temperature=T, seed=s, position=torch.arange(n) + SYS.randrange(2**40), **kw)
    counts = torch.bincount(sample(logits.expand(n, V), t), minlength=V).double()
    assert (counts[q == 0] == 0).all(), f"seed={s} counts={counts.tolist()} q={q.tolist()}"
    live = q > 0
    expected = q[live] * n
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    df = int(live.sum()) - 1
    msg = f"seed={s} T={T:.3f} {kw} counts={counts.tolist()} q={q.tolist()} chi2={chi2:.1f}"
    assert chi2 < CHI2_1E6[df], msg
    assert (counts / n - q).abs().max() < 0.015, msg


def test_filtered_tokens_never_drawn() -> None:
    s, g = fresh()
    V, n, margin = 40, 4000, 1e-3
    logits = torch.randn(V, generator=g) * 2
    for kw in (dict(top_k=5), dict(top_p=0.6), dict(min_p=0.1), dict(top_k=8, top_p=0.8, min_p=0.05)):
        T = float(torch.rand((), generator=g)) + 0.5
        q, out = reference_probs(logits, T, margin=margin, **kw)
        drawn = sample(logits.expand(n, V), tensors(n, temperature=T, seed=s, position=torch.arange(n), **kw))
        assert not out[drawn].any(), f"seed={s} T={T} {kw} drew {sorted(set(drawn[out[drawn]].tolist()))}"
        if q.sort(descending=True).values[1] > 0.01:  # it did sample, not just argmax
            assert drawn.unique().numel() > 1, f"seed={s} T={T} {kw}"


def _flat_sample(logits, temperature, top_k, top_p, min_p, seed, position):
    return sample(logits, SamplingTensors(temperature, top_k, top_p, min_p, seed, position))


def test_sample_traces_without_host_sync() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    s, g = fresh()
    B, V = 8, 64
    logits = torch.randn(B, V, generator=g)
    t = tensors(
        B,
        temperature=torch.tensor([0.0, 1, 0.5, 2, 0, 1, 1, 0.7]),
        top_k=torch.tensor([0, 1, 5, 0, 3, 0, 60, 2]),
        top_p=torch.rand(B, generator=g) * 0.9 + 0.1,
        min_p=0.02,
        seed=torch.randint(0, 2**62, (B,), generator=g),
        position=torch.arange(B),
    )
    args = (logits, t.temperature, t.top_k, t.top_p, t.min_p, t.seed, t.position)
    # Fake tensors have no values: any .item(), nonzero, data-dependent shape or Python branch on a
    # tensor raises here instead of being silently baked into the graph.
    gm = make_fx(_flat_sample, tracing_mode="fake")(*args)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    sync_ops = ("_local_scalar_dense", "nonzero", "item", "masked_select", "equal", "is_nonzero")
    banned = [o for o in ops if o.split(".")[:2] in [["aten", b] for b in sync_ops]]
    assert not banned, banned
    # Static input shapes must give static shapes everywhere; a data-dependent one (boolean
    # indexing, nonzero) shows up as an unbacked SymInt in the node's fake value.
    for node in gm.graph.nodes:
        for v in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor):
                assert all(type(d) is int for d in v.shape), (node.format_node(), v.shape)
            assert not isinstance(v, torch.SymInt), node.format_node()
    assert torch.equal(gm(*args), _flat_sample(*args)), f"seed={s}"
    # Dynamo must also see one graph (it breaks graphs on host syncs).
    compiled = torch.compile(_flat_sample, fullgraph=True, backend="eager")
    assert torch.equal(compiled(*args), _flat_sample(*args)), f"seed={s}"


def test_logprobs_match_log_softmax() -> None:
    s, g = fresh()
    B, V, k = 16, 300, 5
    logits = torch.randn(B, V, generator=g) * 4
    tokens = torch.randint(0, V, (B,), generator=g)
    lp, ids, top = logprobs(logits, tokens, k)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(lp.double(), ref.gather(-1, tokens[:, None])[:, 0], atol=1e-5), f"seed={s}"
    ref_top, ref_ids = ref.topk(k, -1)
    assert torch.equal(ids, ref_ids) and torch.allclose(top.double(), ref_top, atol=1e-5), f"seed={s}"
    assert ids.shape == top.shape == (B, k) and ids.dtype == torch.int64
    _, ids0, top0 = logprobs(logits, tokens, 0)
    assert ids0.shape == top0.shape == (B, 0)
    with pytest.raises(ValueError, match="k must be"):
        logprobs(logits, tokens, V + 1)


def test_from_params_and_derive_seed() -> None:
    s, _ = fresh()
    params = [SamplingParams(), SamplingParams(temperature=0, top_k=7, top_p=0.5, min_p=0.1, seq_seed=s)]
    seeds = [derive_seed(s, 0), params[1].seq_seed]
    t = SamplingTensors.from_params(params, seeds, [3, 9], "cpu")
    assert t.temperature.tolist() == [1.0, 0.0] and t.temperature.dtype == torch.float32
    assert t.top_k.tolist() == [0, 7] and t.top_k.dtype == torch.int64
    assert t.top_p.tolist() == [1.0, 0.5] and t.min_p.dtype == torch.float32
    assert t.seed.tolist() == seeds and t.position.tolist() == [3, 9]
    with pytest.raises(ValueError, match="2 params but 1 seeds"):
        SamplingTensors.from_params(params, seeds[:1], [3, 9])
    derived = [derive_seed(s, i) for i in range(1000)]
    assert all(0 <= d < 2**63 for d in derived) and len(set(derived)) == 1000, f"seed={s}"
    assert derive_seed(s, 5) == derived[5] and derive_seed(s + 1, 5) != derived[5], f"seed={s}"
