"""The KV compressor and the sliding window against explicit references: compress one shot
vs. chunked vs. the per-entry pooling formula (spec §3.5), the finish hook on new entries only,
visible_entries, and the window ring (window_keys / window_bias) over random chunkings.
float32 throughout, fresh seeds (printed in messages)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer_fx.graphs import rope
from deepinfer_fx.graphs.batch import Group
from deepinfer_fx.graphs.compressor import compress, visible_entries
from deepinfer_fx.graphs.state import layer_state
from deepinfer_fx.graphs.window import window_bias, window_keys
from primitives_helpers import close, gen, rope_ref, tiny_config


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
    close(
        one,
        _compress_ref(p, x, ratio, overlap, freq, eps, dim),
        f"seed={seed} T={T}: entries vs explicit formula",
        atol=1e-4,
        rtol=1e-4,
    )

    st2 = layer_state(c, ratio, max_len, torch.float32, slots=2)["comp"]
    start, sizes = 0, []
    while start < T:
        n = min(rng.randrange(1, 2 * ratio + 3), T - start)
        got = compress(p, st2, x[None, start : start + n], Group.one(start, n), ratio, overlap, freq, eps, finish=None)[
            0
        ]
        start += n
        sizes.append(n)
        assert got.shape == (max_len // ratio, dim), f"seed={seed} chunks={sizes}"
        close(
            got[: start // ratio], one[: start // ratio], f"seed={seed} chunks={sizes}: chunked vs one shot", atol=1e-5
        )


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
        # one-token chunks (decode: the ring read after its write) a third of the time
        n = min(1 if rng.random() < 1 / 3 else rng.randrange(2, 2 * W + 2), T - start)
        sizes.append(n)
        chunk = kv_all[start : start + n]
        keys, k_pos = window_keys(pool, chunk[None], Group.one(start, n))
        keys, k_pos = keys[0], k_pos[0]
        end = start + n
        msg = f"seed={seed} chunks={sizes}"
        keys_n = W if n == 1 else W + n
        assert keys.shape[0] == k_pos.shape[0] == keys_n, msg
        real = k_pos >= 0
        # every real key holds that position's kv; positions are distinct
        assert torch.equal(keys[real], kv_all[k_pos[real]]), msg
        assert len(set(k_pos[real].tolist())) == int(real.sum()), msg
        if n == 1:  # the ring itself, holding the W positions up to the token's own
            assert set(k_pos[real].tolist()) == set(range(max(0, start - W + 1), start + 1)), msg
        else:  # the ring held exactly the W positions before the chunk (those that exist)
            assert set(k_pos[:W][k_pos[:W] >= 0].tolist()) == set(range(max(0, start - W), start)), msg
            assert k_pos[W:].tolist() == list(range(start, end)), msg
        # after the call the ring holds the last W rows at slot p % W
        for pp in range(max(0, end - W), end):
            assert torch.equal(ring[pp % W], kv_all[pp]), f"{msg}: slot of position {pp}"
        q_pos = torch.arange(start, end)
        bias = window_bias(q_pos, k_pos, W)
        assert bias.shape == (n, keys_n), msg
        assert bool(((bias == 0) | (bias == float("-inf"))).all()), msg
        for i, t in enumerate(q_pos.tolist()):
            allowed = set(k_pos[bias[i] == 0].tolist())
            assert allowed == set(range(max(0, t - W + 1), t + 1)), f"{msg}: query {t} sees {sorted(allowed)}"
        start = end
