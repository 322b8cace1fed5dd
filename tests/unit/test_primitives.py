"""deepinfer_fx.graphs primitives against explicit references: RoPE (+YaRN table), mHC,
the KV compressor (one shot vs. chunked, explicit pooling formula), the sliding window ring,
the MoE router and sink attention. float32 throughout, fresh seeds (printed in messages)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F

from deepinfer_fx.config import Yarn, config_from_dict
from deepinfer_fx.graphs import attention, rope
from deepinfer_fx.graphs.attention import mqa_with_sink
from deepinfer_fx.graphs.compressor import compress, visible_entries
from deepinfer_fx.graphs.mhc import hc_head, mhc_coeffs, mhc_collapse, mhc_expand
from deepinfer_fx.graphs.moe import route
from deepinfer_fx.graphs.batch import Group
from deepinfer_fx.graphs.state import layer_state
from deepinfer_fx.graphs.window import window_bias, window_keys

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
TINY = {
    "model_type": "deepseek_v4",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 8, 4, 0],
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": YARN,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 1,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
}


def tiny_config(**changes):
    d = copy.deepcopy(TINY)
    d.update(changes)
    return config_from_dict(d)


@pytest.fixture
def seed() -> int:
    s = random.SystemRandom().randrange(2**31)
    print(f"seed={s}")
    return s


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(a: torch.Tensor, b: torch.Tensor, msg: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    a, b = a.double(), b.double()
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{msg}: max abs err {err:.3g}"


def rope_ref(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Complex-number reference: pairs (2i, 2i+1) of the last 2*len(freq) channels as
    x_{2i} + j x_{2i+1}, multiplied by exp(j * pos * f_i). x is [T, ..., d], float64 math."""
    rd = 2 * freq.shape[0]
    xd = x.double()
    tail = xd[..., -rd:]
    z = torch.complex(tail[..., 0::2], tail[..., 1::2])
    ang = pos.double()[:, None] * freq.double()[None, :] * sign
    rot = torch.polar(torch.ones_like(ang), ang).reshape(pos.shape[0], *([1] * (x.dim() - 2)), rd // 2)
    zr = z * rot
    out = xd.clone()
    out[..., -rd:] = torch.stack([zr.real, zr.imag], dim=-1).flatten(-2)
    return out


# --------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("shape", [(7, 32), (5, 3, 32), (4, 2, 3, 32)])
def test_apply_rope_matches_complex_reference(seed, compressed, shape):
    g = gen(seed)
    c = tiny_config()
    freq = rope.inv_freq(c, compressed)
    assert freq.shape == (c.rope_dim // 2,)
    x = torch.randn(*shape, generator=g)
    pos = torch.randint(0, 2048, (shape[0],), generator=g)
    cos, sin = rope.cos_sin(pos, freq)
    y = rope.apply_rope(x, cos, sin)
    assert y.dtype == torch.float32 and y.shape == x.shape
    rd = c.rope_dim
    assert torch.equal(y[..., :-rd], x[..., :-rd]), f"seed={seed}: non-rope channels changed"
    close(y, rope_ref(x, pos, freq), f"seed={seed}: rope vs complex reference", atol=1e-3, rtol=1e-4)
    # rotation keeps the norm of every pair
    close(y[..., -rd:].unflatten(-1, (-1, 2)).norm(dim=-1), x[..., -rd:].unflatten(-1, (-1, 2)).norm(dim=-1),
          f"seed={seed}: pair norms", atol=1e-5)
    # inverse: the conjugate rotation, and it undoes the forward one
    yi = rope.apply_rope(x, cos, sin, inverse=True)
    close(yi, rope_ref(x, pos, freq, sign=-1.0), f"seed={seed}: inverse rope vs reference", atol=1e-3, rtol=1e-4)
    close(rope.apply_rope(y, cos, sin, inverse=True), x, f"seed={seed}: inverse(rope(x)) != x", atol=1e-5)


def test_apply_rope_position_zero_is_identity_and_relative(seed):
    g = gen(seed)
    c = tiny_config()
    freq = rope.inv_freq(c, True)
    x = torch.randn(1, 32, generator=g)
    cos, sin = rope.cos_sin(torch.zeros(1, dtype=torch.long), freq)
    close(rope.apply_rope(x, cos, sin), x, f"seed={seed}: position 0", atol=0)
    # <rope(q, a), rope(k, b)> depends only on a - b (on the rope channels)
    q, k = torch.randn(2, 32, generator=g).double().unbind(0)
    a, b, s = (int(v) for v in torch.randint(0, 500, (3,), generator=g))
    def dot(pa, pb):
        qa = rope_ref(q[None], torch.tensor([pa]), freq)[0]
        kb = rope_ref(k[None], torch.tensor([pb]), freq)[0]
        return (qa * kb).sum()
    assert abs(dot(a, b) - dot(a + s, b + s)) < 1e-9, f"seed={seed}"


def test_yarn_table_flash_values():
    y = Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    f = rope._inv_freq(64, 160000.0, y).double()
    base = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert f.shape == (32,)
    close(f[:16], base[:16], "pairs 0..15 unscaled", atol=0, rtol=1e-6)
    close(f[25:], base[25:] / 16, "pairs 25..31 divided by factor", atol=0, rtol=1e-6)
    mid = slice(16, 25)
    assert (f[mid] < base[mid] * (1 - 1e-6)).all() and (f[mid] > base[mid] / 16 * (1 + 1e-6)).all(), f[mid]
    # the blend itself: low = 15, high = 25 (spec §2.2)
    ramp = (torch.arange(32, dtype=torch.float64) - 15) / 10
    want = base / 16 * ramp.clamp(0, 1) + base * (1 - ramp.clamp(0, 1))
    close(f, want, "yarn blend low=15 high=25", atol=0, rtol=1e-6)
    # the unscaled table
    close(rope._inv_freq(64, 10000.0, None), 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64),
          "base table theta=10000", atol=0, rtol=1e-6)


def test_inv_freq_per_layer_kind():
    c = tiny_config()
    rd = c.rope_dim
    plain = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    close(rope.inv_freq(c, False), plain, "window-only layers: theta 10000, no yarn", atol=0, rtol=1e-6)
    close(rope.inv_freq(c, True), rope._inv_freq(rd, 160000.0, c.yarn), "compressed layers", atol=0)
    assert not torch.allclose(rope.inv_freq(c, True), rope.inv_freq(c.replace(yarn=None), True))


def _hf_rope_config(**kw):
    import transformers

    return transformers.DeepseekV4Config(rope_scaling=dict(YARN), **kw)


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (32, 8), (64, 16)])
def test_inv_freq_matches_transformers(head_dim, rope_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_rope_config(head_dim=head_dim, qk_rope_head_dim=rope_dim, num_attention_heads=4, o_groups=2, hidden_size=64)
    f_hf, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu", layer_type="compress")
    assert attn_factor == 1.0  # no mscale
    c = config_from_dict(hf.to_dict())
    assert c.rope_dim == rope_dim
    close(rope.inv_freq(c, True), f_hf, f"yarn table vs transformers ({head_dim}, {rope_dim})", atol=0, rtol=1e-6)
    main = hf.rope_parameters["main"]
    f_main = 1.0 / main["rope_theta"] ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    close(rope.inv_freq(c, False), f_main, "main table vs transformers' theta", atol=0, rtol=1e-6)


# --------------------------------------------------------------------------- mHC


def _mhc_inputs(g, t=5, n=4, d=16):
    X = torch.randn(t, n, d, generator=g)
    # Mixing logits of order 1 (std <~ 1.5). Much larger ones make the 4x4 Sinkhorn converge
    # slower than 20 iterations allow for 1e-3 (an algorithm property, not an engine bug).
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.5 / math.sqrt(n * d)
    base = torch.randn((2 + n) * n, generator=g) * 0.25
    scale = 0.5 + 1.5 * torch.rand(3, generator=g)
    return X, fn, base, scale


def test_mhc_coeffs(seed):
    g = gen(seed)
    n = 4
    X, fn, base, scale = _mhc_inputs(g, n=n)
    eps, hc_eps = 1e-6, 1e-6
    pre, post, comb = mhc_coeffs(X, fn, base, scale, eps, hc_eps, 20)
    t = X.shape[0]
    assert pre.shape == (t, n) and post.shape == (t, n) and comb.shape == (t, n, n)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert (pre > 0).all(), f"seed={seed}"
    assert ((post > 0) & (post < 2)).all(), f"seed={seed}"
    assert (comb > 0).all(), f"seed={seed}"
    close(comb.sum(-1), torch.ones(t, n), f"seed={seed}: comb row sums", atol=1e-3, rtol=0)
    close(comb.sum(-2), torch.ones(t, n), f"seed={seed}: comb column sums", atol=1e-3, rtol=0)

    # explicit reference (spec §2.4), per token, float64
    Xd, fnd, bd, sd = X.double(), fn.double(), base.double(), scale.double()
    for i in range(t):
        flat = Xd[i].flatten()
        r = 1 / torch.sqrt(flat.square().mean() + eps)
        m = (fnd @ flat) * r
        m_pre, m_post, m_comb = m[:n], m[n : 2 * n], m[2 * n :]
        close(pre[i], torch.sigmoid(m_pre * sd[0] + bd[:n]) + hc_eps, f"seed={seed}: pre[{i}]", atol=1e-5)
        close(post[i], 2 * torch.sigmoid(m_post * sd[1] + bd[n : 2 * n]), f"seed={seed}: post[{i}]", atol=1e-5)
        C = torch.softmax((m_comb * sd[2] + bd[2 * n :]).reshape(n, n), dim=-1) + hc_eps
        C = C / (C.sum(0, keepdim=True) + hc_eps)
        for _ in range(19):
            C = C / (C.sum(1, keepdim=True) + hc_eps)
            C = C / (C.sum(0, keepdim=True) + hc_eps)
        close(comb[i], C, f"seed={seed}: comb[{i}]", atol=1e-5)


def test_mhc_expand_and_collapse(seed):
    g = gen(seed)
    t, n, d = 3, 4, 8
    X = torch.randn(t, n, d, generator=g)
    y = torch.randn(t, d, generator=g)
    post = 2 * torch.rand(t, n, generator=g)
    comb = torch.rand(t, n, n, generator=g)  # deliberately not symmetric
    pre = torch.rand(t, n, generator=g)
    out = mhc_expand(X, y, post, comb)
    ref = torch.zeros(t, n, d, dtype=torch.float64)
    for i in range(t):
        for k in range(n):
            ref[i, k] = post[i, k].double() * y[i].double()
            for j in range(n):
                ref[i, k] += comb[i, j, k].double() * X[i, j].double()
    close(out, ref, f"seed={seed}: mhc_expand", atol=1e-5)
    col = mhc_collapse(X, pre)
    ref_c = torch.stack([sum(pre[i, j].double() * X[i, j].double() for j in range(n)) for i in range(t)])
    close(col, ref_c, f"seed={seed}: mhc_collapse", atol=1e-5)


def test_hc_head(seed):
    g = gen(seed)
    t, n, d = 4, 4, 8
    X = torch.randn(t, n, d, generator=g)
    fn = torch.randn(n, n * d, generator=g) / math.sqrt(n * d)
    base = torch.randn(n, generator=g)
    scale = torch.rand(1, generator=g) + 0.5
    out = hc_head(X, fn, base, scale, 1e-6, 1e-6)
    flat = X.double().flatten(1)
    m = (flat @ fn.double().T) / torch.sqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(m * scale.double() + base.double()) + 1e-6
    close(out, (pre[..., None] * X.double()).sum(1), f"seed={seed}: hc_head", atol=1e-5)


# --------------------------------------------------------------------------- compressor


def _compressor_params(g, hidden, dim, ratio, overlap):
    width = dim * (2 if overlap else 1)
    return {
        "wkv": torch.randn(width, hidden, generator=g) / math.sqrt(hidden),
        "wgate": torch.randn(width, hidden, generator=g) / math.sqrt(hidden),
        "ape": torch.randn(ratio, width, generator=g),
        "norm": 1 + 0.2 * torch.randn(dim, generator=g),
    }


def _compress_ref(p, x, ratio, overlap, freq, eps, dim):
    """Explicit per-entry pooling (spec §3.5), float64."""
    kv = x.double() @ p["wkv"].double().T
    gate = x.double() @ p["wgate"].double().T + p["ape"].double()[torch.arange(x.shape[0]) % ratio]
    out = []
    for w in range(x.shape[0] // ratio):
        cur = slice(w * ratio, (w + 1) * ratio)
        if overlap:
            k_slots, g_slots = [kv[cur, dim:]], [gate[cur, dim:]]
            if w > 0:
                prev = slice((w - 1) * ratio, w * ratio)
                k_slots.insert(0, kv[prev, :dim])
                g_slots.insert(0, gate[prev, :dim])
            k_w, g_w = torch.cat(k_slots), torch.cat(g_slots)
        else:
            k_w, g_w = kv[cur], gate[cur]
        pooled = (torch.softmax(g_w, dim=0) * k_w).sum(0)  # softmax over tokens, per channel
        normed = p["norm"].double() * pooled / torch.sqrt(pooled.square().mean() + eps)
        out.append(rope_ref(normed[None], torch.tensor([w * ratio]), freq)[0])
    return torch.stack(out) if out else torch.zeros(0, dim, dtype=torch.float64)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_compress_chunked_equals_one_shot_and_reference(seed, ratio, overlap):
    g = gen(seed)
    rng = random.Random(seed)
    c = tiny_config()
    assert (ratio == c.csa_ratio) == overlap
    dim, hidden, eps = c.head_dim, c.hidden_size, c.rms_norm_eps
    max_len = 64
    T = rng.randrange(3 * ratio + 1, max_len + 1)
    p = _compressor_params(g, hidden, dim, ratio, overlap)
    x = torch.randn(T, hidden, generator=g)
    freq = rope.inv_freq(c, compressed=True)

    st = layer_state(c, ratio, max_len, torch.float32, slots=2)["comp"]
    one = compress(p, st, x[None], Group.one(0, T), ratio, overlap, freq, eps, finish=None)[0, : T // ratio]
    close(one, _compress_ref(p, x, ratio, overlap, freq, eps, dim), f"seed={seed} T={T}: entries vs explicit formula",
          atol=1e-4, rtol=1e-4)

    st2 = layer_state(c, ratio, max_len, torch.float32, slots=2)["comp"]
    start, sizes = 0, []
    while start < T:
        n = min(rng.randrange(1, 2 * ratio + 3), T - start)
        got = compress(p, st2, x[None, start : start + n], Group.one(start, n), ratio, overlap, freq, eps, finish=None)[0]
        start += n
        sizes.append(n)
        assert got.shape == (max_len // ratio, dim), f"seed={seed} chunks={sizes}"
        close(got[: start // ratio], one[: start // ratio], f"seed={seed} chunks={sizes}: chunked vs one shot", atol=1e-5)


def test_compress_finish_applies_to_new_entries_only(seed):
    g = gen(seed)
    c = tiny_config()
    ratio, dim = 8, c.head_dim
    p = _compressor_params(g, c.hidden_size, dim, ratio, False)
    x = torch.randn(20, c.hidden_size, generator=g)
    freq = rope.inv_freq(c, True)
    st = layer_state(c, ratio, 32, torch.float32, slots=2)["comp"]
    plain = compress(p, st, x[None], Group.one(0, 20), ratio, False, freq, c.rms_norm_eps)[0, :2]
    st = layer_state(c, ratio, 32, torch.float32, slots=2)["comp"]
    compress(p, st, x[None, :9], Group.one(0, 9), ratio, False, freq, c.rms_norm_eps, lambda e: e * 2)
    got = compress(p, st, x[None, 9:], Group.one(9, 11), ratio, False, freq, c.rms_norm_eps, lambda e: e * 2)[0]
    close(got[:2], 2 * plain, f"seed={seed}: finish output stored", atol=1e-5)
    assert not got[2:].any(), f"seed={seed}: windows that did not complete were stored"


def test_visible_entries(seed):
    g = gen(seed)
    rng = random.Random(seed)
    for _ in range(5):
        ratio = rng.choice([2, 4, 8, 128])
        q_pos = torch.randint(0, 6 * ratio, (7,), generator=g)
        n = rng.randrange(1, 8)
        vis = visible_entries(q_pos, n, ratio)
        assert vis.shape == (7, n) and vis.dtype == torch.bool
        for i, t in enumerate(q_pos.tolist()):
            for w in range(n):
                # entry w covers tokens [w*ratio, (w+1)*ratio): usable once its last token is <= t
                assert bool(vis[i, w]) == ((w + 1) * ratio - 1 <= t) == (w < (t + 1) // ratio), (
                    f"seed={seed}: ratio={ratio} t={t} w={w}"
                )


# --------------------------------------------------------------------------- window


def test_window_ring_and_bias(seed):
    g = gen(seed)
    rng = random.Random(seed)
    c = tiny_config()
    W, d = c.sliding_window, c.head_dim
    T = rng.randrange(2 * W, 5 * W)
    pool = layer_state(c, 0, T, torch.float32, slots=2)["window"]
    ring = pool[0]
    assert ring.shape == (W, d)
    kv_all = torch.randn(T, d, generator=g)
    start, sizes = 0, []
    while start < T:
        n = min(rng.randrange(1, 2 * W + 2), T - start)
        sizes.append(n)
        chunk = kv_all[start : start + n]
        keys, k_pos = window_keys(pool, chunk[None], Group.one(start, n))
        keys, k_pos = keys[0], k_pos[0]
        end = start + n
        msg = f"seed={seed} chunks={sizes}"
        assert keys.shape[0] == k_pos.shape[0] == W + n, msg
        real = k_pos >= 0
        # every real key holds that position's kv; positions are distinct
        assert torch.equal(keys[real], kv_all[k_pos[real]]), msg
        assert len(set(k_pos[real].tolist())) == int(real.sum()), msg
        # the ring held exactly the W positions before the chunk (those that exist)
        assert set(k_pos[:W][k_pos[:W] >= 0].tolist()) == set(range(max(0, start - W), start)), msg
        assert k_pos[W:].tolist() == list(range(start, end)), msg
        # after the call the ring holds the last W rows at slot p % W
        for pp in range(max(0, end - W), end):
            assert torch.equal(ring[pp % W], kv_all[pp]), f"{msg}: slot of position {pp}"
        q_pos = torch.arange(start, end)
        bias = window_bias(q_pos, k_pos, W)
        assert bias.shape == (n, W + n), msg
        assert bool(((bias == 0) | (bias == float("-inf"))).all()), msg
        for i, t in enumerate(q_pos.tolist()):
            allowed = set(k_pos[bias[i] == 0].tolist())
            assert allowed == set(range(max(0, t - W + 1), t + 1)), f"{msg}: query {t} sees {sorted(allowed)}"
        start = end


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
    out = mqa_with_sink(q, keys, bias, sink)
    assert out.shape == (T, H, d) and out.dtype == torch.float32
    close(out, _sink_ref(q, keys, bias, sink), f"seed={seed}: sink attention vs explicit softmax", atol=1e-5)

    # an excluded key does not matter, whatever it holds
    j = int(torch.randint(1, N, (1,), generator=g))
    bias2 = bias.clone()
    bias2[:, j] = float("-inf")
    keys2 = keys.clone()
    keys2[j] = torch.randn(d, generator=g) * 100
    close(mqa_with_sink(q, keys2, bias2, sink), mqa_with_sink(q, keys, bias2, sink), f"seed={seed}: masked key", atol=1e-6)

    # the sink only takes mass: a -inf sink is a plain softmax, a bigger sink shrinks the output
    plain = torch.softmax(torch.einsum("thd,nd->thn", q, keys) / math.sqrt(d) + bias[:, None], dim=-1)
    close(mqa_with_sink(q, keys, bias, torch.full((H,), float("-inf"))), torch.einsum("thn,nd->thd", plain, keys),
          f"seed={seed}: -inf sink", atol=1e-5)
    out_big = mqa_with_sink(q, keys, bias, sink + 3.0)
    assert (out_big.norm(dim=-1) < out.norm(dim=-1)).all(), f"seed={seed}: a larger sink must shrink the output"

    # every key masked: all mass on the sink, zero output
    none = mqa_with_sink(q, keys, torch.full((T, N), float("-inf")), sink)
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
    whole = mqa_with_sink(q, keys, bias, sink)
    monkeypatch.setattr(attention, "_LOGITS_BUDGET", C * H * N * 4)  # 4 queries per block
    blocks = mqa_with_sink(q, keys, bias, sink)
    close(blocks, whole, f"seed={seed}: query blocks vs one shot", atol=1e-6)
    # no queries (a context-parallel rank without rows in a group)
    assert mqa_with_sink(q[:, :0], keys, bias[:, :0], sink).shape == (C, 0, H, d)
