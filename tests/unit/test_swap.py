"""graphs/swap.py: named places, nesting, and unknown names."""

import pytest
import torch

from deepinfer_fx.graphs import moe
from deepinfer_fx.graphs.swap import active, places, swapped


def test_swap_replaces_inside_the_block_only_and_nests() -> None:
    x = torch.randn(3, 4)
    calls = []

    def outer(p, limit, x, idx, w):
        calls.append("outer")
        return torch.zeros(x.shape)

    def inner(p, limit, x, idx, w):
        calls.append("inner")
        return torch.ones(x.shape)

    with swapped({"moe.routed_experts": outer}):
        assert moe.routed_experts({}, 0.0, x, None, None).sum() == 0
        with swapped({"moe.routed_experts": inner}):
            assert moe.routed_experts({}, 0.0, x, None, None).sum() == x.numel()
        assert moe.routed_experts({}, 0.0, x, None, None).sum() == 0
    assert calls == ["outer", "inner", "outer"] and active() == {}
    # outside any block the reference runs: experts as grouped GEMMs
    e, i, d = 3, 5, 4
    p = {"w1": torch.randn(e, i, d), "w3": torch.randn(e, i, d), "w2": torch.randn(e, d, i)}
    idx, w = torch.randint(0, e, (3, 2)), torch.rand(3, 2)
    torch.testing.assert_close(moe.routed_experts(p, 0.0, x, idx, w), moe.routed_experts.reference(p, 0.0, x, idx, w))


def test_unknown_place_is_an_error_naming_the_known_ones() -> None:
    assert "moe.expert_parallel" in places()
    with pytest.raises(ValueError, match="unknown swap place.*moe.routed_expert'.*known"):
        with swapped({"moe.routed_expert": print}):
            pass
    assert active() == {}
