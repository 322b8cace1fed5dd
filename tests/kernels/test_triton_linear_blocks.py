"""``skinny_linear_blocks`` (``kernels/triton/linear.py``): x ``[M, G*K]`` times a block-diagonal
weight stored as its stacked blocks ``[G*R, K]`` (the grouped ``wo_a``), against the dense
block-diagonal product and ``graphs/norm.py::project_blocks``.

Each column tile reads its own block's slice of x, so block g of the result must be the same
bits as a plain skinny call on x's slice g and w's rows of block g with the same tiles. On CPU
under the interpreter (fp32, small shapes); on a GPU also bf16 at P8's ``wo_a``, batch
invariance, one launch a call, and the op's dispatch."""

from __future__ import annotations

import pytest
import torch

from linear_helpers import DTYPES, assert_close, cuda_only, fresh_seed

from deepinfer_fx.graphs.norm import project_blocks
from deepinfer_fx.kernels.triton.linear import Tiles, choose_tiles, skinny_linear_blocks_triton, skinny_linear_triton

# (M, G, R, K, tiles): None is the shape rule; R = 48 narrows the column tile to 16; a split K;
# two row blocks with K off the k tile.
CASES = [
    (1, 2, 32, 64, None),
    (3, 4, 16, 48, None),
    (5, 2, 48, 64, Tiles(32, 16, 1, 4, 3)),
    (16, 3, 32, 96, Tiles(32, 32, 3, 4, 3)),
    (20, 2, 64, 40, None),
]
P8_WO_A = (8, 1024, 4096)  # groups, rank, (H / G) * head_dim


def _operands(
    seed: int, m: int, g: int, r: int, k: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, g * k, generator=gen)
    w = torch.randn(g * r, k, generator=gen) * k**-0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def _dense(w: torch.Tensor, g: int) -> torch.Tensor:
    """The block-diagonal ``[G*R, G*K]`` weight that ``w``'s row blocks stand for."""
    return torch.block_diag(*w.unflatten(0, (g, -1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,g,r,k,tiles", CASES)
def test_matches_block_diagonal_product(
    m: int, g: int, r: int, k: int, tiles: Tiles | None, dtype: torch.dtype, device: str
) -> None:
    seed = fresh_seed()
    x, w = _operands(seed, m, g, r, k, dtype, device)
    why = f"seed={seed} M={m} G={g} R={r} K={k} tiles={tiles} {dtype}"
    got = skinny_linear_blocks_triton(x, w, g, tiles=tiles)
    assert_close(got, x, _dense(w, g), False, why)
    want = project_blocks.reference(x, w, g)
    assert got.dtype == want.dtype and got.shape == want.shape, why


@pytest.mark.parametrize("m,g,r,k,tiles", CASES)
def test_each_block_is_a_plain_call_on_its_slice(
    m: int, g: int, r: int, k: int, tiles: Tiles | None, device: str
) -> None:
    """Block b of the result == ``skinny_linear(x[:, bK:(b+1)K], w[bR:(b+1)R])`` with the same
    tiles, bitwise: the offset moves the reads and nothing else."""
    seed = fresh_seed()
    x, w = _operands(seed, m, g, r, k, torch.float32, device)
    t = tiles or choose_tiles(g * r, k)
    t = t._replace(bn=min(t.bn, r & -r))
    got = skinny_linear_blocks_triton(x, w, g, tiles=t)
    for b in range(g):
        want = skinny_linear_triton(x[:, b * k : (b + 1) * k], w[b * r : (b + 1) * r], False, t)
        assert torch.equal(got[:, b * r : (b + 1) * r], want), f"seed={seed} block {b} tiles={t}"


def test_bad_shapes_are_refused(device: str) -> None:
    x, w = _operands(fresh_seed(), 2, 2, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"x \[M, G\*K\] and w \[G\*R, K\] with G = 4"):
        skinny_linear_blocks_triton(x, w, 4)
    with pytest.raises(ValueError, match="a multiple of 16"):
        skinny_linear_blocks_triton(torch.randn(2, 32, device=device), torch.randn(24, 16, device=device), 2)  # R = 12


def test_op_reference_on_cpu() -> None:
    seed = fresh_seed()
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _operands(seed, 3, 4, 16, 32, dtype, "cpu")
        got = torch.ops.deepinfer.skinny_linear_blocks(x, w, 4)
        assert torch.equal(got, project_blocks.reference(x, w, 4)), f"seed={seed} {dtype}"
        torch.library.opcheck(torch.ops.deepinfer.skinny_linear_blocks.default, (x, w, 4))


# --- GPU: P8's wo_a ----------------------------------------------------------------------


@cuda_only
def test_p8_wo_a_matches_and_is_batch_invariant() -> None:
    """At P8's wo_a: within bf16 rounding of the exact product at 1, 8 and 16 rows, and row r
    alone == row r inside the batch, bitwise."""
    g, r, k = P8_WO_A
    seed = fresh_seed()
    x, w = _operands(seed, 16, g, r, k, torch.bfloat16, "cuda")
    dense = _dense(w, g)
    full = skinny_linear_blocks_triton(x, w, g)
    for m in (1, 8, 16):
        got = skinny_linear_blocks_triton(x[:m], w, g)
        assert_close(got, x[:m], dense, False, f"seed={seed} M={m}")
        assert torch.equal(got, full[:m]), f"seed={seed}: rows of M={m} differ inside M=16"


@cuda_only
def test_op_dispatches_to_one_launch() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::skinny_linear_blocks", "CUDA")
    g, r, k = P8_WO_A
    seed = fresh_seed()
    x, w = _operands(seed, 4, g, r, k, torch.bfloat16, "cuda")
    first = torch.ops.deepinfer.skinny_linear_blocks(x, w, g)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.skinny_linear_blocks(x, w, g)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "_skinny_kernel" in kernels[0], kernels
    assert torch.equal(got, first) and torch.equal(got, skinny_linear_blocks_triton(x, w, g)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.skinny_linear_blocks.default, (x, w, g))
