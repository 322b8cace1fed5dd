"""The skinny GEMM over a block-FP8 weight held as stored (``skinny_linear_fp8_triton``,
``deepinfer::skinny_linear_fp8``) against ``graphs/norm.py::project_fp8``: the weight dequantised
tile by tile to x's dtype must give the product of the weight the reference dequantises, within
fp32 accumulation error (bf16: one rounding more), for both released block sizes (32: V4.1,
128: V4), K split or not, N off the tiles; a row's result is the same bits alone or in a batch.
CPU: the interpreter with fp32 operands; a GPU adds bf16 at the V4.1 projections' widths."""

from __future__ import annotations

import pytest
import torch

from linear_helpers import DTYPES, assert_close, cuda_only, fresh_seed

from deepinfer_fx.graphs.norm import dequant_dense, project_fp8
from deepinfer_fx.io.quant import quant_fp8_block, ue8m0_to_float
from deepinfer_fx.kernels import ops_linear
from deepinfer_fx.graphs.norm import project_blocks
from deepinfer_fx.kernels.triton.linear import (
    Tiles,
    choose_tiles,
    skinny_linear_blocks_triton,
    skinny_linear_fp8_triton,
    skinny_linear_group_triton,
)

# (M, N, K, block, tiles): None is the shape rule (k tile = the block's, at most 128).
CASES = [
    (1, 96, 64, 32, None),
    (5, 64, 128, 32, None),
    (16, 80, 96, 32, Tiles(32, 32, 3, 4, 3)),  # three splits, N off the column tile
    (3, 128, 256, 128, None),
    (7, 160, 384, 128, Tiles(32, 64, 2, 4, 3)),  # 64-deep k tiles inside 128 blocks, two splits
    (64, 48, 64, 32, None),  # the largest decode bucket: one 64-row block (linear.FP8_BM) a weight tile
    (40, 64, 256, 128, Tiles(32, 64, 2, 4, 3, bm=64)),  # one 64-row block, rows off it, two splits
]


def _operands(seed: int, m: int, n: int, k: int, block: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w8, scale = quant_fp8_block(torch.randn(n, k, generator=g) * k**-0.5, block)
    return x, w8.to(device), ue8m0_to_float(scale).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("m, n, k, block, tiles", CASES)
def test_matches_the_dequantised_product(
    device: str, dtype: torch.dtype, out_fp32: bool, m: int, n: int, k: int, block: int, tiles
) -> None:
    seed = fresh_seed()
    x, w8, scale = _operands(seed, m, n, k, block, dtype, device)
    got = skinny_linear_fp8_triton(x, w8, scale, out_fp32, tiles)
    w = dequant_dense(w8, scale, dtype)  # what the reference multiplies
    assert_close(got, x, w, out_fp32, f"seed {seed}")
    want = project_fp8.reference(x, w8, scale, out_fp32)  # type: ignore[attr-defined]
    assert got.dtype == want.dtype and got.shape == want.shape


def test_a_row_is_the_same_bits_alone_and_in_a_batch(device: str) -> None:
    seed = fresh_seed()
    x, w8, scale = _operands(seed, ops_linear.FP8_MAX_ROWS, 96, 128, 32, torch.float32, device)
    batch = skinny_linear_fp8_triton(x[:16], w8, scale, False)
    for i in (0, 7, 15):
        assert torch.equal(skinny_linear_fp8_triton(x[i : i + 1], w8, scale, False)[0], batch[i]), (
            f"seed {seed}: row {i}"
        )
    # above 16 rows the 64-row blocks (linear.FP8_BM): a row is the same bits in any such batch
    wide, part = (skinny_linear_fp8_triton(x[:m], w8, scale, False) for m in (ops_linear.FP8_MAX_ROWS, 17))
    assert torch.equal(wide[:17], part), f"seed {seed}"


# (M, G, R, K, block, tiles): the grouped wo_a held in block FP8 (V4.1's 32 blocks: several in a
# block's rows; V4's 128: R = 32 rows of one scale block, K off it).
BLOCKS = [
    (1, 2, 32, 64, 32, None),
    (9, 4, 48, 96, 32, None),
    (3, 2, 32, 160, 128, Tiles(32, 32, 2, 4, 3)),
    (40, 2, 32, 64, 32, None),  # above 16 rows: 64-row blocks (linear.FP8_BM)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, g, r, k, block, tiles", BLOCKS)
def test_blocks_match_the_dequantised_block_diagonal_product(
    device: str, dtype: torch.dtype, m: int, g: int, r: int, k: int, block: int, tiles
) -> None:
    """``skinny_linear_blocks`` over a block-FP8 ``wo_a`` == the block-diagonal product of the
    weight the reference (``norm.project_blocks`` with scales) dequantises."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, g * k, generator=gen).to(device=device, dtype=dtype)
    w8, s8 = quant_fp8_block(torch.randn(g * r, k, generator=gen) * k**-0.5, block)  # the stacked blocks
    w8, scale = w8.to(device), ue8m0_to_float(s8).to(device)
    got = skinny_linear_blocks_triton(x, w8, g, scale, tiles)
    w = dequant_dense(w8, scale, dtype)
    assert_close(got, x, torch.block_diag(*w.unflatten(0, (g, -1))), False, f"seed {seed}")
    want = project_blocks.reference(x, w8, g, scale)  # type: ignore[attr-defined]
    assert got.dtype == want.dtype and got.shape == want.shape


def test_the_swap_domain_and_bad_inputs() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w8, scale = quant_fp8_block(torch.randn(96, 64), 32)
    s = ue8m0_to_float(scale)
    assert ops_linear.fp8_decode_sized(x, w8, s)
    bound = ops_linear.FP8_MAX_ROWS
    assert ops_linear.fp8_decode_sized(torch.zeros(bound, 64, dtype=torch.bfloat16), w8, s)  # decode b64
    assert not ops_linear.fp8_decode_sized(torch.zeros(bound + 1, 64, dtype=torch.bfloat16), w8, s)  # prefill-sized
    assert not ops_linear.fp8_decode_sized(x.float(), w8, s)  # fp32 activations: the reference
    w8b, scale8 = quant_fp8_block(torch.randn(96, 64), 8)  # 8-blocks: no k tile fits one
    assert not ops_linear.fp8_decode_sized(x, w8b, ue8m0_to_float(scale8))
    with pytest.raises(ValueError, match="float8_e4m3fn w"):
        skinny_linear_fp8_triton(x.float(), w8.float(), s, False)
    with pytest.raises(ValueError, match="power-of-two part >= 16"):
        skinny_linear_fp8_triton(x.float(), w8b, ue8m0_to_float(scale8), False)


@cuda_only
@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("n, k", [(1280, 5120), (32768, 1280), (512, 5120), (5120, 8192)])  # V4.1 wq_a, wq_b, wkv, wo_b
def test_v41_widths_in_bf16_on_cuda(m: int, n: int, k: int) -> None:
    seed = fresh_seed()
    x, w8, scale = _operands(seed, m, n, k, 32, torch.bfloat16, "cuda")
    got = ops_linear.skinny_linear_fp8(x, w8, scale, False)
    assert_close(got, x, dequant_dense(w8, scale, torch.bfloat16), False, f"seed {seed}")


# (M, widths of the group's weights, K, block, tiles): fp8 projections of one input in one launch
# (``deepinfer::skinny_linear_fp8_group``): two splits with N off the tile, 128-blocks in 64-deep k.
FP8_GROUPS = [
    (3, (64, 32), 96, 32, Tiles(32, 32, 3, 4, 3)),
    (2, (96, 48, 32), 256, 128, Tiles(16, 64, 2, 4, 3)),
    (5, (32, 64), 128, 32, None),
]


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("m, ns, k, block, tiles", FP8_GROUPS)
def test_fp8_group_is_each_weight_alone(device: str, out_fp32: bool, m: int, ns, k: int, block: int, tiles) -> None:
    """One launch over fp8 weights == one call per weight with the group's tiles, bit for bit (a
    column runs the same dots and split sums wherever its weight sits), and each within
    accumulation error of the dequantised product."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device)
    held = [quant_fp8_block(torch.randn(n, k, generator=g) * k**-0.5, block) for n in ns]
    ws, scales = [w.to(device) for w, _ in held], [ue8m0_to_float(s).to(device) for _, s in held]
    t = tiles or choose_tiles(sum(ns), k, max_bk=min(128, block & -block))
    got = skinny_linear_group_triton(x, ws, out_fp32, tiles, scales)
    for i, (w, s, y) in enumerate(zip(ws, scales, got)):
        why = f"seed {seed}: weight {i}"
        assert torch.equal(y, skinny_linear_fp8_triton(x, w, s, out_fp32, t._replace(tma=False))), why
        assert_close(y, x, dequant_dense(w, s, x.dtype), out_fp32, why)
    ops = torch.ops.deepinfer.skinny_linear_fp8_group(
        x.cpu(), [w.cpu() for w in ws], [s.cpu() for s in scales], out_fp32
    )
    for i, (w, s, y) in enumerate(zip(ws, scales, ops)):
        assert torch.equal(y, project_fp8.reference(x.cpu(), w.cpu(), s.cpu(), out_fp32)), f"seed {seed}: op {i}"  # type: ignore[attr-defined]


def test_fp8_group_refuses_mixed_blocks(device: str) -> None:
    x = torch.randn(2, 128, device=device)
    a, sa = quant_fp8_block(torch.randn(32, 128), 32)
    b, sb = quant_fp8_block(torch.randn(32, 128), 128)
    scales = [ue8m0_to_float(sa).to(device), ue8m0_to_float(sb).to(device)]
    with pytest.raises(ValueError, match="scale blocks differ"):
        skinny_linear_group_triton(x, [a.to(device), b.to(device)], False, scales=scales)
    with pytest.raises(ValueError, match="a scale each"):
        skinny_linear_group_triton(x, [a.to(device), b.to(device)], False, scales=scales[:1])
    # the fake only: the schema and aot_dispatch checks compare fp8 inputs, which torch's CPU cannot
    torch.library.opcheck(
        torch.ops.deepinfer.skinny_linear_fp8_group.default,
        (x.cpu(), [a, a.clone()], [scales[0].cpu()] * 2, True),
        test_utils=("test_faketensor",),
    )
