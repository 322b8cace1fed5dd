"""The ``rope_table_op`` swap: ``deepinfer::rope_table`` equals ``graphs/rope.py::cos_sin``, and
a compiled rotation of a prefill-sized chunk reads the op's tables (one op call, results equal
to eager), while a decode-sized one keeps the inline tables (no op)."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.config import Yarn
from deepinfer_fx.graphs.rope import _inv_freq, apply_rope, cos_sin
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend

pytestmark = pytest.mark.usefixtures("fresh_compile")

SWAP = "rope_table_op"
YARN = Yarn(factor=16.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _rotate(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    return apply_rope(x, *cos_sin(positions, freq))


def test_op_is_the_graphs_function() -> None:
    g = torch.Generator().manual_seed(_seed())
    positions = torch.randint(0, 100_000, (3, 37), generator=g)
    freq = _inv_freq(64, 10000.0, YARN)
    got, want = torch.ops.deepinfer.rope_table(positions, freq), cos_sin.reference(positions, freq)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.library.opcheck(torch.ops.deepinfer.rope_table.default, (positions, freq))


@pytest.mark.parametrize("tokens, ops", [(1024, 1), (8, 0)], ids=["prefill", "decode"])
def test_compiled_rotation_equals_eager(tokens: int, ops: int) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 4, 96, generator=g)
    positions = torch.randint(0, 50_000, (tokens,), generator=g)
    freq = _inv_freq(32, 10000.0, YARN)
    be = make_backend("cpu", environ={})
    compiled = compile_graph(_rotate, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(x, positions, freq)
    torch.testing.assert_close(
        got, _rotate(x, positions, freq), rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}"
    )
    assert be.rewrites().get(SWAP, 0) == ops, f"seed={seed}"
