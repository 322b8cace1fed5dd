"""Image-span rows in the text model: bias_vl routing and DEAD positions for Engram."""

from __future__ import annotations

import torch
from tiny_vision import fresh_seed, tiny_vision_config

from deepinfer_fx.api import random_model
from deepinfer_fx.graphs.engram_hash import DEAD, engram_hash, engram_layout
from deepinfer_fx.graphs.moe import route


def test_span_rows_route_with_bias_vl() -> None:
    seed = fresh_seed()
    c, params = random_model(tiny_vision_config(), seed=seed)
    ffn = params["layers"][0]["ffn"]
    e = c.n_routed_experts
    # bias_vl pushes experts 0 and 1 to the top for span rows; bias pushes e-2 and e-1 for text
    p = {
        "gate": {
            **ffn["gate"],
            "bias": torch.zeros(e).index_fill(0, torch.tensor([e - 2, e - 1]), 50.0),
            "bias_vl": torch.zeros(e).index_fill(0, torch.tensor([0, 1]), 50.0),
        }
    }
    x = torch.randn(6, c.hidden_size, generator=torch.Generator().manual_seed(seed))
    image_rows = torch.tensor([False, True, True, False, True, False])
    idx, w = route(p, c, x, torch.zeros(6, dtype=torch.long), image_rows)
    for row, is_image in enumerate(image_rows.tolist()):
        assert set(idx[row].tolist()) == ({0, 1} if is_image else {e - 2, e - 1})
    plain_idx, plain_w = route(p, c, x, torch.zeros(6, dtype=torch.long))
    text = ~image_rows
    assert torch.equal(idx[text], plain_idx[text]) and torch.equal(w[text], plain_w[text])


def test_dead_positions_cut_every_ngram() -> None:
    c, _ = random_model(tiny_vision_config(), seed=fresh_seed())
    layout = engram_layout(c)  # 3-grams: each position hashes (c_t), (c_t, c_t-1), (c_t, c_t-1, c_t-2)
    pad = 7
    comp = torch.tensor([10, 11, DEAD, DEAD, 12, 13, 14])
    hist = torch.tensor([20, 21])
    got = engram_hash(comp, hist, layout, 0, pad)
    # by hand: the window of each position, newest first, with DEAD and all older ids read as pad
    windows = [
        [10, 21, 20],
        [11, 10, 21],
        [pad, pad, pad],
        [pad, pad, pad],
        [12, pad, pad],
        [13, 12, pad],
        [14, 13, 12],
    ]
    for t, window in enumerate(windows):
        newest_first = torch.tensor(window)
        # the same hash of an explicit window: a chunk of one token whose history is the window's older ids
        want = engram_hash(newest_first[:1], newest_first[1:].flip(0), layout, 0)
        assert torch.equal(got[t], want[0]), t
    # a history that ends in DEAD (a prompt that ended inside a span) cuts the next chunk's n-grams too
    after = engram_hash(torch.tensor([15, 16]), torch.tensor([12, DEAD]), layout, 0, pad)
    assert torch.equal(after[0], engram_hash(torch.tensor([15]), torch.tensor([pad, pad]), layout, 0)[0])
