"""The Triton ``ring_mqa`` kernel (decode attention reading the window ring and the entry pool in
place) against ``graphs/attention.py::mqa_ring``, and bit for bit against ``sparse_mqa`` over the
keys gathered the way the reference gathers them.

Every case draws a fresh seed (printed in the failure message). On CPU the kernels run under
Triton's interpreter in fp32 at small sizes (small ``block_n`` / ``split`` reach tiles that straddle
the ring and the entries, several splits, and the parallel path); with CUDA, bf16 at the model's
sizes runs too.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_triton_attention import PATHS, _fresh_seed, needs_cuda

from deepinfer_fx.graphs.attention import mqa_ring
from deepinfer_fx.graphs.window import ring_positions, window_bias
from deepinfer_fx.kernels.triton.attention import sparse_mqa_triton
from deepinfer_fx.kernels.triton.ring_attention import ring_mqa_triton


def _case(seed: int, c: int, h: int, d: int, w: int, e: int, k: int | None, dtype: torch.dtype, device: str):
    """``c`` chunks in a pool of ``c + 2`` slots (taken in shuffled order), positions from before
    the ring fills (empty slots) to far past it; entries ``e`` a slot (``None``: no entries), read
    through ``k`` rows (``None``: all of them) with a 0 / -inf bias that hides about a third."""
    g = torch.Generator().manual_seed(seed)
    s = c + 2
    q = torch.randn(c, 1, h, d, generator=g)
    ring = torch.randn(s, w, d, generator=g)
    slots = torch.randperm(s, generator=g)[:c]
    pos = torch.randint(0, 4 * w, (c,), generator=g)
    pos[0] = w // 3  # part of the ring never written
    entries = rows = bias = None
    if e:
        entries = torch.randn(s, e, d, generator=g)
        n = e if k is None else k
        if k is not None:
            rows = torch.randint(0, e, (c, k), generator=g)
        hidden = torch.rand(c, 1, n, generator=g) < 0.3
        bias = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    sink = torch.randn(h, generator=g)
    angles = torch.rand(c, 1, d // 16, generator=g) * 2 * math.pi
    to = lambda x, dt=None: None if x is None else x.to(device, dt) if dt else x.to(device)  # noqa: E731
    return (to(q, dtype), to(ring, dtype), to(slots), to(pos), to(entries, dtype), to(rows), to(bias), to(sink),
            to(angles.cos()), to(angles.sin()))


CASES = [(3, 4, 32, 24, 0, None), (3, 4, 32, 24, 40, None), (4, 8, 64, 32, 50, 20), (2, 4, 48, 16, 30, 37)]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("c, h, d, w, e, k", CASES, ids=["window", "entries", "rows", "d48-rows"])
def test_matches_reference(device: str, path: str, c: int, h: int, d: int, w: int, e: int, k: int | None) -> None:
    seed = _fresh_seed()
    args = _case(seed, c, h, d, w, e, k, torch.float32, device)
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    assert ring_mqa_triton(*args, out=out, **PATHS[path]) is out
    want = mqa_ring(*args)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


# (ring rows, tiling): tiles wholly in the ring or among the entries (two loops), one split
# holding both kinds; and tiles that straddle the ring's end (each row picks its source)
BITWISE = {"whole": (32, dict(block_n=16, split=32)), "whole-split-across": (32, dict(block_n=16, split=48)),
           "straddling": (24, dict(block_n=16, split=32))}


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("layout", list(BITWISE))
def test_bitwise_equals_gathered(device: str, layout: str, parallel: bool) -> None:
    """The same keys gathered for ``sparse_mqa`` give the same bits: one arithmetic, two ways in."""
    seed = _fresh_seed()
    w, tiling = BITWISE[layout]
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(seed, 4, 8, 64, w, 50, 20, torch.float32, device)
    chosen = entries[slots].gather(1, rows[..., None].expand(-1, -1, entries.shape[-1]))
    keys = torch.cat([ring[slots], chosen], 1)
    full_bias = torch.cat([window_bias(pos[:, None], ring_positions(pos, w), w), bias], -1)
    a = ring_mqa_triton(q, ring, slots, pos, entries, rows, bias, sink, cos, sin, parallel=parallel, **tiling)
    b = sparse_mqa_triton(q, keys, full_bias, sink, cos, sin, parallel=parallel, **tiling)
    assert torch.equal(a, b), f"seed {seed}"


def test_batch_invariance(device: str) -> None:
    """A chunk alone (parallel: few programs) == the same chunk among 70 (sequential)."""
    seed = _fresh_seed()
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(seed, 70, 4, 32, 24, 40, 30, torch.float32, device)
    batched = ring_mqa_triton(q, ring, slots, pos, entries, rows, bias, sink, cos, sin, block_n=16, split=32)
    for ci in (0, 69, 35):
        one = slice(ci, ci + 1)
        alone = ring_mqa_triton(q[one], ring, slots[one], pos[one], entries, rows[one], bias[one], sink, cos[one], sin[one],
                                block_n=16, split=32)
        assert torch.equal(alone[0], batched[ci]), f"seed {seed}: chunk {ci} differs alone"


def test_bad_inputs_are_named(device: str) -> None:
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(_fresh_seed(), 2, 4, 32, 16, 20, 8, torch.float32, device)
    with pytest.raises(ValueError, match="ring_mqa: mismatched inputs.*entry_bias"):
        ring_mqa_triton(q, ring, slots, pos, entries, rows, bias[..., :-1], sink, cos, sin)
    with pytest.raises(ValueError, match="one query a chunk"):
        ring_mqa_triton(q.expand(2, 3, 4, 32), ring, slots, pos, entries, rows, bias, sink, cos, sin)


@needs_cuda
@pytest.mark.parametrize("c", [1, 8, 64])
@pytest.mark.parametrize("e, k", [(0, None), (32, None), (1040, 512)], ids=["SWA", "HCA", "CSA"])
def test_bf16_model_sizes(c: int, e: int, k: int | None) -> None:
    """P8 decode shapes: 64 heads x 512, a 128-row ring; bf16 against the reference and bit for
    bit against ``sparse_mqa`` over the gathered keys."""
    seed = _fresh_seed()
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(seed, c, 64, 512, 128, e, k, torch.bfloat16, "cuda")
    out = ring_mqa_triton(q, ring, slots, pos, entries, rows, bias, sink, cos, sin)
    want = mqa_ring(q, ring, slots, pos, entries, rows, bias, sink, cos, sin)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}")
    keys, full_bias = ring[slots], window_bias(pos[:, None], ring_positions(pos, 128), 128)
    if e:
        chosen = entries[slots] if rows is None else entries[slots].gather(1, rows[..., None].expand(-1, -1, 512))
        keys, full_bias = torch.cat([keys, chosen], 1), torch.cat([full_bias, bias], -1)
    assert torch.equal(out, sparse_mqa_triton(q, keys, full_bias, sink, cos, sin)), f"seed {seed}"
