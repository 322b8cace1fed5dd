"""``entries.selected_entries``: a decode query's chosen compressed entries, compacted. Attending
the compacted keys equals attending the whole entry buffer under the choice mask, for choices of
0 to k entries; the kept entries come in ascending order (the same for a row in any batch)."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.graphs.attention import mqa_with_sink
from deepinfer_fx.graphs.entries import selected_entries


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


@pytest.mark.parametrize("k", [1, 5, 16])
def test_compacted_entries_attend_like_the_masked_buffer(k: int) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    c, n, d, h = 6, 40, 16, 4
    entries = torch.randn(c, n, d, generator=g)
    counts = torch.randint(0, k + 1, (c,), generator=g)
    counts[0], counts[1] = 0, k  # none chosen, and exactly k
    chosen = torch.zeros(c, 1, n, dtype=torch.bool)
    for i, m in enumerate(counts.tolist()):
        chosen[i, 0, torch.randperm(n, generator=g)[:m]] = True
    keys, real = selected_entries(entries, chosen, k)
    assert keys.shape == (c, k, d) and real.shape == (c, 1, k), f"seed={seed}"
    assert torch.equal(real.sum(-1)[:, 0], counts), f"seed={seed}"
    for i in range(c):
        want = entries[i, chosen[i, 0]]  # ascending entry order
        assert torch.equal(keys[i, real[i, 0]], want), f"seed={seed} row {i}"

    # with a window key that every query sees, so that a row with no entry still has a key
    window = torch.randn(c, 1, d, generator=g)
    q, sink = torch.randn(c, 1, h, d, generator=g), torch.randn(h, generator=g)
    angles = torch.rand(c, 1, 4, generator=g) * 6.3
    tables = angles.cos(), angles.sin()
    dense_bias = torch.cat([torch.zeros(c, 1, 1), torch.zeros(c, 1, n).masked_fill(~chosen, float("-inf"))], -1)
    sel_bias = torch.cat([torch.zeros(c, 1, 1), torch.zeros(c, 1, k).masked_fill(~real, float("-inf"))], -1)
    dense = mqa_with_sink.reference(q, torch.cat([window, entries], 1), dense_bias, sink, *tables)  # type: ignore[attr-defined]
    compact = mqa_with_sink.reference(q, torch.cat([window, keys], 1), sel_bias, sink, *tables)  # type: ignore[attr-defined]
    torch.testing.assert_close(compact, dense, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
