"""The ``rope_kernel`` swap: ``deepinfer::rope_`` turns x into ``graphs/rope.py::apply_rope(x)``, a
compiled rotation of at least 2^20 elements (and its inverse) runs as the op, one node each,
while a small one traces the reference; compiled equals eager either way. Under Inductor the
swap's clone of x disappears where nothing else reads x (the op then rotates the producer's
buffer in place) and stays where something does. The kernel itself is tested in
``tests/kernels/test_triton_rope.py``."""

from __future__ import annotations

import os
import re

import pytest
import torch

from deepinfer_fx.config import Yarn
from deepinfer_fx.graphs.rope import _inv_freq, apply_rope, cos_sin, norm_rope
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend

pytestmark = pytest.mark.usefixtures("fresh_compile")

SWAP = "rope_kernel"
YARN = Yarn(factor=16.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _rotate_and_back(
    x: torch.Tensor, o: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention does: rotate the queries, un-rotate the output, with one pair of tables."""
    cos, sin = cos_sin(positions, freq)
    return apply_rope(x, cos, sin), apply_rope(o, cos, sin, inverse=True)


@pytest.mark.parametrize(
    "shape, lead", [((5, 3, 96), 1), ((2, 7, 4, 64), 2), ((6, 40), 1)], ids=["heads", "chunks", "flat"]
)
def test_op_is_the_graphs_function(shape: tuple[int, ...], lead: int) -> None:
    g = torch.Generator().manual_seed(_seed())
    x = torch.randn(*shape, generator=g)
    positions = torch.randint(0, 100_000, shape[:lead], generator=g)
    cos, sin = cos_sin.reference(positions, _inv_freq(32, 10000.0, YARN))  # type: ignore[attr-defined]
    for inverse in (False, True):
        got = x.clone()
        torch.ops.deepinfer.rope_(got, cos, sin, inverse)
        assert torch.equal(got, apply_rope.reference(x, cos, sin, inverse))  # type: ignore[attr-defined]
        torch.library.opcheck(torch.ops.deepinfer.rope_.default, (x.clone(), cos, sin, inverse))


# 2^20 elements is the smallest rotation the op takes: 1024 positions x 16 heads x 64 channels
# (prefill), or 64 positions x 256 heads (a large decode batch, the P8 shape at b64: 64 x 64 x 512)
@pytest.mark.parametrize(
    "tokens, heads, ops", [(1024, 16, 2), (64, 256, 2), (8, 16, 0)], ids=["prefill", "large-decode", "small-decode"]
)
def test_compiled_rotation_equals_eager(tokens: int, heads: int, ops: int) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x, o = torch.randn(tokens, heads, 64, generator=g), torch.randn(tokens, heads, 64, generator=g)
    positions = torch.randint(0, 50_000, (tokens,), generator=g)
    freq = _inv_freq(32, 10000.0, YARN)
    be = make_backend("cpu", environ={})
    compiled = compile_graph(_rotate_and_back, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(x, o, positions, freq)
    for a, b in zip(got, _rotate_and_back(x, o, positions, freq)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    assert be.rewrites().get(SWAP, 0) == ops, f"seed={seed}"


def _query_and_output(
    x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor, reread: bool
) -> torch.Tensor:
    """The attention shape of the rotations: heads from a projection rotated, normed (the stand-in
    for attention), un-rotated and projected back; ``reread`` also reads the query before rotation."""
    cos, sin = cos_sin(positions, freq)
    q = (x @ w).unflatten(-1, (16, 64))
    o = torch.nn.functional.rms_norm(apply_rope(q, cos, sin), (64,))
    out = apply_rope(o, cos, sin, inverse=True).flatten(1) @ w.T
    return out + q.flatten(1)[:, :64] if reread else out


@pytest.mark.parametrize("reread", [False, True], ids=["in-place", "x-read-again"])
def test_inductor_rotates_the_producers_buffer_in_place(reread: bool) -> None:
    """No copy of a [1024, 16, 64] tensor before either rotation, unless x is read afterwards."""
    from torch._inductor.utils import run_and_get_code

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1024, 64, generator=g), torch.randn(64, 1024, generator=g) / 8
    positions, freq = torch.randint(0, 50_000, (1024,), generator=g), _inv_freq(32, 10000.0, YARN)
    be = make_backend("cpu", environ={}, inductor=True)
    compiled = compile_graph(_query_and_output, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got, code = run_and_get_code(compiled, x, w, positions, freq, reread)
    torch.testing.assert_close(
        got, _query_and_output(x, w, positions, freq, reread), rtol=1e-5, atol=1e-4, msg=lambda m: f"seed={seed}: {m}"
    )
    assert be.rewrites().get(SWAP, 0) == 2, f"seed={seed}"
    src = "\n".join(code)
    assert src.count("torch.ops.deepinfer.rope_.default(") == 2
    # Inductor names its kernels after the ATen ops they came from: a surviving clone is a copy kernel
    assert bool(re.search(r"fused_\w*clone", src)) == reread, src


@pytest.mark.parametrize("weighted", [False, True], ids=["head-norm", "weighted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_op_is_the_graphs_function(weighted: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(_seed())
    x = torch.randn(6, 4, 64, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype) if weighted else None
    positions = torch.randint(0, 100_000, (6,), generator=g)
    cos, sin = cos_sin.reference(positions, _inv_freq(32, 10000.0, YARN))  # type: ignore[attr-defined]
    got = torch.ops.deepinfer.rms_norm_rope(x, w, 1e-6, cos, sin)
    assert torch.equal(got, norm_rope.reference(x, w, 1e-6, cos, sin))  # type: ignore[attr-defined]
    torch.library.opcheck(torch.ops.deepinfer.rms_norm_rope.default, (x, w, 1e-6, cos, sin))


def _norm_and_rotate(
    q: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The two calls of a V4 attention layer: the unweighted query-head norm and the latent's."""
    cos, sin = cos_sin(positions, freq)
    return norm_rope(q, None, 1e-6, cos, sin), norm_rope(kv, w, 1e-6, cos, sin)


@pytest.mark.parametrize("tokens", [1, 37])
def test_compiled_norm_rope_equals_eager(tokens: int) -> None:
    """At every size the swap puts one op node per call, and compiled equals eager."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(tokens, 8, 64, generator=g), torch.randn(tokens, 64, generator=g)
    w = 1 + 0.1 * torch.randn(64, generator=g)
    positions = torch.randint(0, 50_000, (tokens,), generator=g)
    freq = _inv_freq(32, 10000.0, YARN)
    be = make_backend("cpu", environ={})
    compiled = compile_graph(_norm_and_rotate, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(q, kv, w, positions, freq)
    for a, b in zip(got, _norm_and_rotate(q, kv, w, positions, freq)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    assert be.rewrites().get("norm_rope_kernel", 0) == 2, f"seed={seed}"
