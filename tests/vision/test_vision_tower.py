"""The ViT, the aligner and the span merge against plain torch written from the formulas."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_vision import IMAGE_TOKEN, fresh_seed, random_image, tiny_vision_config

import deepinfer_fx
from deepinfer_fx.api import random_model
from deepinfer_fx.graphs.random_init import random_flat
from deepinfer_fx.vision import (
    encode,
    expand_placeholders,
    input_embeddings,
    preprocess,
)
from deepinfer_fx.vision.merge import token_grids
from deepinfer_fx.vision.spans import END, IMAGE, NEWLINE, START, span_kinds

pytest.importorskip("PIL")


def plain_vit(p: dict, v, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """One image, every formula spelled out: no packing, no chunked RoPE helpers."""

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + v.rms_norm_eps) * w

    hd, heads, quarter = v.head_dim, v.num_attention_heads, v.head_dim // 4
    x = patches @ p["patch_embed"]["proj"].T + p["patch_embed"]["proj_bias"]
    angle = torch.empty(rows * cols, hd // 2, dtype=torch.float64)
    for n in range(rows * cols):
        r, c = divmod(n, cols)
        for i in range(hd // 2):
            pos = r if i < quarter else c
            angle[n, i] = pos * v.rope_theta ** (-(i % quarter) / quarter)
    cos, sin = angle.cos().float(), angle.sin().float()

    def rope(t):  # t [n, heads, hd]: channel i turns with channel i + hd / 2
        out = t.clone()
        for i in range(hd // 2):
            a, b = t[:, :, i], t[:, :, i + hd // 2]
            out[:, :, i] = a * cos[:, i, None] - b * sin[:, i, None]
            out[:, :, i + hd // 2] = b * cos[:, i, None] + a * sin[:, i, None]
        return out

    for b in p["blocks"]:
        h = norm(x, b["norm1"])
        qkv = h @ b["attn"]["wqkv"].T + b["attn"]["wqkv_bias"]
        q, k, val = (qkv[:, j * v.hidden_size : (j + 1) * v.hidden_size].reshape(-1, heads, hd) for j in range(3))
        q, k = rope(q), rope(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val).reshape(-1, v.hidden_size)
        x = x + o @ b["attn"]["wo"].T + b["attn"]["wo_bias"]
        h = norm(x, b["norm2"]) @ b["mlp"]["w1"].T
        g, u = h[:, : v.intermediate_size], h[:, v.intermediate_size :]
        x = x + (g * torch.sigmoid(g) * u) @ b["mlp"]["w2"].T
    return norm(x, p["norm"])


def plain_aligner(p: dict, v, tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Window (a, b) concatenates, channel-major, token (3a + dy, 3b + dx) (zero past the grid)."""
    r, d = v.downsample_ratio, v.hidden_size
    grid = tokens.reshape(rows, cols, d)
    out = []
    for a in range(-(-rows // r)):
        for bb in range(-(-cols // r)):
            vec = torch.zeros(d * r * r)
            for c in range(d):
                for dy in range(r):
                    for dx in range(r):
                        y, x = a * r + dy, bb * r + dx
                        if y < rows and x < cols:
                            vec[c * r * r + dy * r + dx] = grid[y, x, c]
            out.append(vec)
    h = torch.stack(out) @ p["w1"].T + p["w1_bias"]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h @ p["w2"].T + p["w2_bias"]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_vision_config(), seed=fresh_seed())


def test_vit_and_aligner_match_plain_torch(model) -> None:
    c, params = model
    seed = fresh_seed()
    images = [random_image(100, 60, seed), random_image(45, 120, seed + 1)]
    pixel_values, grids = preprocess(images, c)
    assert [g[0] % 3 or g[1] % 3 for g in grids] != [0, 0]  # a grid that the aligner pads
    feats = encode(model, pixel_values, grids)
    at = 0
    for f, (rows, cols) in zip(feats, grids):
        patches = pixel_values[at : at + rows * cols]
        at += rows * cols
        tokens = plain_vit(params["vision"], c.vision, patches, rows, cols)
        want = plain_aligner(params["aligner"], c.vision, tokens, rows, cols)
        assert f.shape == (-(-rows // 3) * -(-cols // 3), c.hidden_size)
        torch.testing.assert_close(f, want, rtol=1e-5, atol=1e-5)


def test_a_batch_of_images_is_each_alone(model) -> None:
    c, _ = model
    seed = fresh_seed()
    images = [random_image(90, 70, seed), random_image(50, 140, seed + 1), random_image(80, 80, seed + 2)]
    together = encode(model, *preprocess(images, c))
    for im, got in zip(images, together):
        alone = encode(model, *preprocess([im], c))[0]
        # the packed projections' GEMMs block differently by row count: equal to fp32 rounding
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_span_layout_and_input_embeddings(model) -> None:
    c, params = model
    seed = fresh_seed()
    images = [random_image(100, 60, seed), random_image(45, 120, seed + 1)]
    pixel_values, grids = preprocess(images, c)
    tg = token_grids(c, grids)
    ids, starts = expand_placeholders([5, IMAGE_TOKEN, 7, IMAGE_TOKEN, 9], tg, IMAGE_TOKEN)
    feats = encode(model, pixel_values, grids)
    emb = input_embeddings(model, ids, images)
    assert emb.shape == (len(ids), c.hidden_size)
    for (h, w), start, f in zip(tg, starts, feats):
        kinds = span_kinds(h, w).tolist()
        assert kinds[0] == START and kinds[-1] == END and len(kinds) == h * (w + 1) + 2
        k = 0
        for j, kind in enumerate(kinds):
            row = emb[start + j]
            if kind == IMAGE:
                torch.testing.assert_close(row, f[k])
                k += 1
            else:
                name = {START: "image_start", NEWLINE: "image_newline", END: "image_end"}[kind]
                assert torch.equal(row, params[name])
        assert k == h * w
    text = [i for i, t in enumerate(ids) if t != IMAGE_TOKEN]
    assert torch.equal(emb[text], params["embed"][torch.tensor(ids)[text]])


def test_placeholder_count_must_match_images() -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\]: 2 image placeholder\(s\) .* but 1 image\(s\)"):
        expand_placeholders([IMAGE_TOKEN, 3, IMAGE_TOKEN], [(1, 1)], IMAGE_TOKEN, "prompts[1]")


def test_checkpoint_round_trip(tmp_path) -> None:
    seed = fresh_seed()
    cfg = tiny_vision_config(for_writer=True)
    deepinfer_fx.write_random_checkpoint(tmp_path, cfg, seed=seed)
    m = deepinfer_fx.load_model(tmp_path, dtype=torch.float32)
    flat = random_flat(m.config, seed, torch.float32)
    vision = {
        k: v
        for k, v in flat.items()
        if k.split(".")[0] in ("vision", "aligner", "image_start", "image_end", "image_newline")
    }
    assert "vision.blocks.1.attn.wqkv_bias" in vision and "aligner.w2_bias" in vision
    for path, want in vision.items():
        node = m.params
        for part in path.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        assert torch.equal(node, want), path


def test_the_compiled_tower_is_the_eager_one_for_every_image_size(model) -> None:
    """``vision/compiled.py`` on aot_eager (CPU): the eager tower's features, and the second
    batch of other sizes and image count runs the graphs the first compiled (patches dynamic)."""
    from torch._dynamo.utils import counters

    from deepinfer_fx.vision.compiled import compiled_parts

    c, _ = model
    seed = fresh_seed()
    batches = [
        [random_image(100, 60, seed), random_image(45, 120, seed + 1)],
        [random_image(70, 70, seed + 2), random_image(30, 90, seed + 3), random_image(120, 40, seed + 4)],
    ]
    torch._dynamo.reset()  # another test may have compiled these sizes in this process
    parts = compiled_parts("aot_eager")
    graphs = [counters["stats"]["unique_graphs"]]
    for images in batches:
        pixel_values, grids = preprocess(images, c)
        got = encode(model, pixel_values, grids, parts)
        graphs.append(counters["stats"]["unique_graphs"])
        for g, want in zip(got, encode(model, pixel_values, grids), strict=True):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    assert graphs[0] < graphs[1] == graphs[2]  # the first batch compiled, the second's sizes compiled nothing
    with pytest.raises(ValueError, match="compiles with one of"):
        compiled_parts("eager-ish")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor on the GPU")
def test_the_tower_compiled_by_inductor_on_cuda_is_the_eager_one() -> None:
    from deepinfer_fx.vision.compiled import compiled_parts

    c, params = random_model(tiny_vision_config(), seed=fresh_seed())
    model = (c, torch.utils._pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, params))
    seed = fresh_seed()
    pixel_values, grids = preprocess([random_image(100, 60, seed), random_image(45, 120, seed + 1)], c)
    got = encode(model, pixel_values, grids, compiled_parts("inductor"))
    for g, want in zip(got, encode(model, pixel_values, grids), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)


def test_one_image_per_pass_is_bitwise_each_alone(model) -> None:
    """Batch-invariant inference encodes each image in its own pass (``encode_requests(alone=True)``):
    an image's features are the same bits with other requests' images or without."""
    from deepinfer_fx.vision.requests import ImageInputs, encode_requests
    from deepinfer_fx.vision.processor import preprocess_one

    c, _ = model
    seed = fresh_seed()

    def inputs(images) -> ImageInputs:
        done = [preprocess_one(im, c.vision, "test") for im in images]
        return ImageInputs(
            [torch.from_numpy(p) for p, _ in done], [g for _, g in done], [0] * len(done), [0] * len(done)
        )

    images = [random_image(90, 70, seed), random_image(50, 140, seed + 1), random_image(80, 80, seed + 2)]
    alone = inputs(images[:1])
    encode_requests(model, [alone], alone=True)
    together = [inputs(images[:1]), inputs(images[1:])]
    encode_requests(model, together, alone=True)
    assert torch.equal(together[0].spans[0], alone.spans[0])
