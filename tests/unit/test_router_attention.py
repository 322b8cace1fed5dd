"""The MoE router and sink attention against explicit references: hash-layer routing,
top-k routing where the bias selects but does not weight (with and without norm_topk_prob),
and mqa_with_sink vs. an explicit softmax with a sink logit (masking, sink limits, query
blocks vs. one shot) and an explicit turn of the values' rotary tails. float32 throughout,
fresh seeds (printed in messages)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepinfer_fx.graphs import attention
from deepinfer_fx.graphs.attention import mqa_with_sink
from deepinfer_fx.graphs.moe import route
from primitives_helpers import close, gen, tiny_config


# --------------------------------------------------------------------------- MoE router


def _scores(x, w):
    return torch.sqrt(F.softplus(x.double() @ w.double().T))


def test_route_hash_layer(seed):
    g = gen(seed)
    c = tiny_config()
    E, k, V, D, T = c.n_routed_experts, c.num_experts_per_tok, c.vocab_size, c.hidden_size, 9
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])
    p = {"gate": {"weight": torch.randn(E, D, generator=g), "tid2eid": tid2eid}}
    x = torch.randn(T, D, generator=g)
    tok = torch.randint(0, V, (T,), generator=g)
    idx, w = route(p, c, x, tok)
    assert torch.equal(idx, tid2eid[tok].long()), f"seed={seed}"
    s = _scores(x, p["gate"]["weight"]).gather(1, idx)
    close(w, s / s.sum(-1, keepdim=True) * c.routed_scaling_factor, f"seed={seed}: hash weights", atol=1e-5)
    close(w.sum(-1), torch.full((T,), c.routed_scaling_factor), f"seed={seed}: weights sum", atol=1e-5)


def test_route_topk_bias_selects_but_does_not_weight(seed):
    g = gen(seed)
    c = tiny_config()
    E, k, D, T = c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, 11
    weight = torch.randn(E, D, generator=g)
    x = torch.randn(T, D, generator=g)
    tok = torch.randint(0, c.vocab_size, (T,), generator=g)
    s = _scores(x, weight)
    rsf = c.routed_scaling_factor

    def check(bias, label):
        idx, w = route({"gate": {"weight": weight, "bias": bias}}, c, x, tok)
        want = torch.topk(s + bias.double(), k, dim=-1).indices
        assert torch.equal(idx.sort(-1).values, want.sort(-1).values), f"seed={seed} {label}: picked {idx} not {want}"
        sw = s.gather(1, idx)
        close(w, sw / sw.sum(-1, keepdim=True) * rsf, f"seed={seed} {label}: weights", atol=1e-5)
        return idx

    no_bias = check(torch.zeros(E), "zero bias")
    check(torch.randn(E, generator=g), "random bias")
    # a large bias on token 0's *least* scored experts forces them for every token
    forced = torch.topk(s[0], k, largest=False).indices
    bias = torch.zeros(E)
    bias[forced] = 100.0
    idx = check(bias, "forcing bias")
    assert (idx.sort(-1).values == forced.sort().values).all(), f"seed={seed}"
    assert set(idx[0].tolist()) != set(no_bias[0].tolist()), f"seed={seed}: bias did not change the selection"

    # without norm_topk_prob the weights are the raw scores times the scale
    c2 = c.replace(norm_topk_prob=False)
    idx, w = route({"gate": {"weight": weight, "bias": torch.zeros(E)}}, c2, x, tok)
    close(w, s.gather(1, idx) * rsf, f"seed={seed}: unnormalised weights", atol=1e-5)


# --------------------------------------------------------------------------- sink attention


def _sink_ref(q, keys, bias, sink):
    T, H, d = q.shape
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            num = torch.zeros(d, dtype=torch.float64)
            den = math.exp(float(sink[h]))
            for j in range(keys.shape[0]):
                if bias[t, j] == float("-inf"):
                    continue
                e = math.exp(float(q[t, h].double() @ keys[j].double()) / math.sqrt(d) + float(bias[t, j]))
                num += e * keys[j].double()
                den += e
            out[t, h] = num / den
    return out


def test_mqa_with_sink(seed):
    g = gen(seed)
    T, H, N, d = 4, 3, 7, 16
    q = torch.randn(T, H, d, generator=g)
    keys = torch.randn(N, d, generator=g)
    sink = torch.randn(H, generator=g) * 2
    mask = torch.rand(T, N, generator=g) < 0.4
    mask[:, 0] = False  # at least one visible key per query
    bias = torch.zeros(T, N).masked_fill(mask, float("-inf"))
    still = _tables(torch.zeros(T, 2))  # no turn: the attention itself
    out = mqa_with_sink(q, keys, bias, sink, *still)
    assert out.shape == (T, H, d) and out.dtype == torch.float32
    close(out, _sink_ref(q, keys, bias, sink), f"seed={seed}: sink attention vs explicit softmax", atol=1e-5)

    # an excluded key does not matter, whatever it holds
    j = int(torch.randint(1, N, (1,), generator=g))
    bias2 = bias.clone()
    bias2[:, j] = float("-inf")
    keys2 = keys.clone()
    keys2[j] = torch.randn(d, generator=g) * 100
    close(
        mqa_with_sink(q, keys2, bias2, sink, *still),
        mqa_with_sink(q, keys, bias2, sink, *still),
        f"seed={seed}: masked key",
        atol=1e-6,
    )

    # the sink only takes mass: a -inf sink is a plain softmax, a bigger sink shrinks the output
    plain = torch.softmax(torch.einsum("thd,nd->thn", q, keys) / math.sqrt(d) + bias[:, None], dim=-1)
    close(
        mqa_with_sink(q, keys, bias, torch.full((H,), float("-inf")), *still),
        torch.einsum("thn,nd->thd", plain, keys),
        f"seed={seed}: -inf sink",
        atol=1e-5,
    )
    out_big = mqa_with_sink(q, keys, bias, sink + 3.0, *still)
    assert (out_big.norm(dim=-1) < out.norm(dim=-1)).all(), f"seed={seed}: a larger sink must shrink the output"

    # every key masked: all mass on the sink, zero output
    none = mqa_with_sink(q, keys, torch.full((T, N), float("-inf")), sink, *still)
    assert torch.equal(none, torch.zeros_like(none)), f"seed={seed}"


def test_mqa_with_sink_in_query_blocks_equals_one_shot(seed, monkeypatch):
    """Past the logits budget the reference runs blocks of queries (rows are independent):
    same result, leading chunk dims included, a last block shorter than the others."""
    g = gen(seed)
    C, T, H, N, d = 2, 11, 3, 9, 16
    q = torch.randn(C, T, H, d, generator=g)
    keys = torch.randn(C, N, d, generator=g)
    sink = torch.randn(H, generator=g)
    mask = torch.rand(C, T, N, generator=g) < 0.5
    mask[..., 0] = False
    bias = torch.zeros(C, T, N).masked_fill(mask, float("-inf"))
    tables = _tables(torch.rand(C, T, 3, generator=g) * 6.3)
    whole = mqa_with_sink(q, keys, bias, sink, *tables)
    monkeypatch.setattr(attention, "_LOGITS_BUDGET", C * H * N * 4)  # 4 queries per block
    blocks = mqa_with_sink(q, keys, bias, sink, *tables)
    close(blocks, whole, f"seed={seed}: query blocks vs one shot", atol=1e-6)
    # no queries (a context-parallel rank without rows in a group)
    assert mqa_with_sink(q[:, :0], keys, bias[:, :0], sink, *(t[:, :0] for t in tables)).shape == (C, 0, H, d)


def _tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return angles.cos(), angles.sin()


def test_mqa_with_sink_turns_the_value_tails_back(seed):
    """The output's last 2 * rd/2 channels of every head, in pairs (2i, 2i+1), come back turned by
    minus the query's angle i; the other channels are the attention itself."""
    g = gen(seed)
    T, H, N, d, half = 3, 2, 5, 16, 3
    q, keys, sink = torch.randn(T, H, d, generator=g), torch.randn(N, d, generator=g), torch.randn(H, generator=g)
    bias = torch.zeros(T, N)
    angles = torch.rand(T, half, generator=g) * 6.3
    out = mqa_with_sink(q, keys, bias, sink, *_tables(angles))
    want = _sink_ref(q, keys, bias, sink)
    for t in range(T):
        for i in range(half):
            a_at, b_at = d - 2 * half + 2 * i, d - 2 * half + 2 * i + 1
            a, b = want[t, :, a_at].clone(), want[t, :, b_at].clone()
            c, s = math.cos(float(angles[t, i])), math.sin(float(angles[t, i]))
            want[t, :, a_at], want[t, :, b_at] = a * c + b * s, b * c - a * s
    close(out, want, f"seed={seed}: turned tails", atol=1e-5)
