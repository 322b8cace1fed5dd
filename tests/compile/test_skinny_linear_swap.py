"""The ``skinny_linear_kernel`` swap: decode-sized ``linear`` / ``linear_fp32`` calls become one
``deepinfer::skinny_linear`` node each, every other call traces the reference GEMM, and the
compiled function equals the eager one on CPU (where the op runs its reference). Likewise the
``skinny_linear_blocks_kernel`` swap for the grouped ``project_blocks``."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.graphs.norm import linear, linear_fp32, project, project_blocks
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.io.quant import quant_fp8_block, ue8m0_to_float
from deepinfer_fx.kernels.ops_linear import FP8_MAX_ROWS, MAX_ROWS, decode_sized
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.passes.manager import registered_passes

pytestmark = pytest.mark.usefixtures("fresh_compile")

LINEAR, BLOCKS_SWAP = registered_passes()["skinny_linear_kernel"], registered_passes()["skinny_linear_blocks_kernel"]
SWAP = LINEAR.name
BLOCKS = BLOCKS_SWAP.name
BF16 = torch.bfloat16


def _seed() -> int:
    return torch.seed() % 2**31


def block(
    x: torch.Tensor, big: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, wodd: torch.Tensor, w32: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Three decode-sized calls (2-D bf16 out, 3-D fp32 out, 2-D fp32 out) and three that must
    keep the reference: too many rows, a weight dim not a multiple of 16, fp32 operands."""
    h = linear(x, wa)  # [4, 32]
    z = linear_fp32(h.view(2, 2, -1), wb)  # [2, 2, 48], fp32
    r = linear_fp32(x, wa)  # [4, 32], fp32
    return h, z, r, linear(big, wa), linear(x, wodd), linear(x.float(), w32)


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    return (
        r(4, 64).to(BF16),
        r(MAX_ROWS + 1, 64).to(BF16),
        r(32, 64).to(BF16),
        r(48, 32).to(BF16),
        r(24, 64).to(BF16),
        r(32, 64),
    )


def test_decode_sized() -> None:
    w = torch.empty(32, 64, dtype=BF16)
    assert decode_sized(torch.empty(1, 64, dtype=BF16), w)
    assert decode_sized(torch.empty(4, 4, 64, dtype=BF16), w)  # 16 flattened rows
    assert not decode_sized(torch.empty(1, 17, 64, dtype=BF16), w)  # 17
    assert not decode_sized(torch.empty(0, 64, dtype=BF16), w)
    assert not decode_sized(torch.empty(2, 64), w)  # fp32 activations
    assert not decode_sized(torch.empty(2, 24, dtype=BF16), torch.empty(32, 24, dtype=BF16))  # K = 24
    assert not decode_sized(torch.empty(2, 64, dtype=BF16), torch.empty(40, 64, dtype=BF16))  # N = 40


def test_replacement_equals_reference_eagerly() -> None:
    seed = _seed()
    args = _inputs(seed)
    want = block(*args)
    with swapped(LINEAR.swap()):
        got = block(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"seed={seed} output {i}"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"seed={seed} output {i}: {m}")


@pytest.mark.parametrize("enabled", [True, False])
def test_compiled_swap_equals_eager(enabled: bool) -> None:
    """Compiled with the swaps in force == eager; the pass counts the three decode-sized calls
    when enabled and none when disabled (the reference is traced instead)."""
    seed = _seed()
    args = _inputs(seed)
    be = make_backend("cpu", disabled=() if enabled else (SWAP,), environ={})
    compiled = compile_graph(block, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    want = block(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, f"seed={seed} output {i}"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed} output {i}: {m}")
    assert len(be.graphs) == 1 and be.rewrites().get(SWAP, 0) == 3 * int(enabled), f"seed={seed}"
    assert (SWAP in be.pipeline.names) == enabled
    assert project.place == LINEAR.place  # type: ignore[attr-defined]


def grouped(o: torch.Tensor, wa: torch.Tensor, big: torch.Tensor, odd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``project_blocks`` as ``attention.grouped_output`` calls it (4 groups): decode-sized on 2-D
    and 3-D rows, then too many rows and a block of 8 rows (weight N = 32, but R = 8 is no
    multiple of 16: the op would refuse it, so the swap must keep the reference)."""
    return (
        project_blocks(o, wa, 4),
        project_blocks(o.view(2, 2, -1), wa, 4),
        project_blocks(big, wa, 4),
        project_blocks(o, odd, 4),
    )


def _grouped_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(4, 4 * 32, generator=g).to(BF16),
        (torch.randn(4 * 16, 32, generator=g) / 32**0.5).to(BF16),
        torch.randn(MAX_ROWS + 1, 4 * 32, generator=g).to(BF16),
        (torch.randn(4 * 8, 32, generator=g) / 32**0.5).to(BF16),
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_blocks_swap_compiled_equals_eager(enabled: bool) -> None:
    """The grouped projection: decode-sized calls become ``deepinfer.skinny_linear_blocks``
    nodes (two), the rest trace the reference; compiled == eager on CPU."""
    seed = _seed()
    args = _grouped_inputs(seed)
    be = make_backend("cpu", disabled=() if enabled else (BLOCKS,), environ={})
    compiled = compile_graph(grouped, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(*args)
    want = grouped(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"seed={seed} output {i}"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed} output {i}: {m}")
    assert len(be.graphs) == 1 and be.rewrites().get(BLOCKS, 0) == 2 * int(enabled), f"seed={seed} {be.rewrites()}"
    assert project_blocks.place == BLOCKS_SWAP.place  # type: ignore[attr-defined]


FP8 = registered_passes()["skinny_linear_fp8_kernel"]


def fp8_block(x: torch.Tensor, w8: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Block-FP8 weights held as stored: two decode-sized calls (bf16 out, fp32 out) and one with
    too many rows, which keeps the reference (the weight dequantised, then the GEMM)."""
    return linear(x[:4], w8, s), linear_fp32(x[:2], w8, s), linear(x, w8, s)


@pytest.mark.parametrize("enabled", [True, False])
def test_compiled_fp8_swap_equals_eager(enabled: bool) -> None:
    """``skinny_linear_fp8_kernel``: compiled == eager, bit for bit on the CPU (the op runs its
    reference there), and the pass counts the two decode-sized calls when enabled."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(FP8_MAX_ROWS + 3, 64, generator=g).to(BF16)
    w8, scale = quant_fp8_block(torch.randn(96, 64, generator=g) * 0.125, 32)
    s = ue8m0_to_float(scale)
    be = make_backend("cpu", disabled=() if enabled else (FP8.name,), environ={})
    compiled = compile_graph(fp8_block, be)
    with torch.no_grad(), swapped(be.pipeline.swaps()):
        got = compiled(x, w8, s)
    want = fp8_block(x, w8, s)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, f"seed={seed} output {i}"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"seed={seed} output {i}: {m}")
    assert be.rewrites().get(FP8.name, 0) == 2 * int(enabled), f"seed={seed} {be.rewrites()}"
