"""deepinfer_fx.graphs.rope against explicit references: apply_rope vs. a complex-number
rotation (forward and inverse, position 0, relative positions), the YaRN inverse-frequency
table (flash values and the blend), the per-layer-kind table choice, and parity with
transformers' YaRN init. float32 throughout, fresh seeds (printed in messages)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.config import Yarn, config_from_dict
from deepinfer_fx.graphs import rope
from primitives_helpers import YARN, close, gen, rope_ref, tiny_config


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
    close(
        y[..., -rd:].unflatten(-1, (-1, 2)).norm(dim=-1),
        x[..., -rd:].unflatten(-1, (-1, 2)).norm(dim=-1),
        f"seed={seed}: pair norms",
        atol=1e-5,
    )
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
    close(
        rope._inv_freq(64, 10000.0, None),
        10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64),
        "base table theta=10000",
        atol=0,
        rtol=1e-6,
    )


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

    hf = _hf_rope_config(
        head_dim=head_dim, qk_rope_head_dim=rope_dim, num_attention_heads=4, o_groups=2, hidden_size=64
    )
    f_hf, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu", layer_type="compress")
    assert attn_factor == 1.0  # no mscale
    c = config_from_dict(hf.to_dict())
    assert c.rope_dim == rope_dim
    close(rope.inv_freq(c, True), f_hf, f"yarn table vs transformers ({head_dim}, {rope_dim})", atol=0, rtol=1e-6)
    main = hf.rope_parameters["main"]
    f_main = 1.0 / main["rope_theta"] ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    close(rope.inv_freq(c, False), f_main, "main table vs transformers' theta", atol=0, rtol=1e-6)
