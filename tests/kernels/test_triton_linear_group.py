"""Groups of weights sharing an input in one launch (``skinny_linear_group_triton``, the
``deepinfer::skinny_linear_group`` op) against one call per weight and the exact products. On
CPU under Triton's interpreter (fp32) and, on a GPU, P8's groups in bf16 with batch invariance.
The kernel's single-weight paths are tested in ``test_triton_linear.py``; the group cases'
sm_90 compile in ``test_triton_linear_sm90.py``."""

from __future__ import annotations

import pytest
import torch
from linear_helpers import (
    DTYPES,
    GROUP_WEIGHTS,
    assert_close,
    cuda_only,
    fresh_seed,
    live_counters,
    operands,
    reference,
)

from deepinfer_fx.kernels.ops_linear import MAX_GROUP
from deepinfer_fx.kernels.triton.linear import Tiles, choose_tiles, skinny_linear_group_triton, skinny_linear_triton

# (M, widths of the group's weights, K, tiles): column tiles that end inside a weight, split K,
# two row blocks, six weights.
GROUP_CASES = [
    (3, (48, 32), 64, None),
    (5, (40, 24, 16), 96, Tiles(32, 32, 3, 4, 3)),
    (20, (32, 64), 64, Tiles(16, 16, 2, 4, 3)),
    (1, (16, 32, 48, 16, 64, 32), 48, Tiles(32, 16, 1, 4, 3)),
]


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,ns,k,tiles", GROUP_CASES)
def test_group_is_each_weight_alone(
    m: int, ns: tuple[int, ...], k: int, tiles: Tiles | None, dtype: torch.dtype, out_fp32: bool, device: str
) -> None:
    """One launch over a group == one call per weight with the group's tiles, bitwise (each
    column runs the same dots and split sums wherever its weight sits in the group), and within
    accumulation error of the exact products; the counters end at zero. A group's weights load
    through pointers (the rule's TMA takes single weights), so the calls alone do too: under the
    interpreter a descriptor-loaded tile gave other last bits (seen when TMA entered the rule)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to(device=device, dtype=dtype) for n in ns]
    t = (tiles or choose_tiles(sum(ns), k))._replace(tma=False)
    why = f"seed={seed} M={m} N={ns} K={k} tiles={t} {dtype} out_fp32={out_fp32}"
    got = skinny_linear_group_triton(x, ws, out_fp32, tiles)
    assert len(got) == len(ws), why
    for i, (w, y) in enumerate(zip(ws, got)):
        assert torch.equal(y, skinny_linear_triton(x, w, out_fp32, t)), f"{why}: weight {i}"
        assert_close(y, x, w, out_fp32, f"{why}: weight {i}")
    if t.split > 1:
        assert not live_counters(x.device).any(), f"{why}: counters left nonzero"


def test_group_refuses_what_it_cannot_take(device: str) -> None:
    x = torch.randn(2, 32, device=device)
    w = torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="1 to"):
        skinny_linear_group_triton(x, [w] * (MAX_GROUP + 1), False)
    with pytest.raises(ValueError, match="share a layout"):
        skinny_linear_group_triton(x, [w, torch.randn(32, 16, device=device).T], False)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        skinny_linear_group_triton(x, [w, torch.randn(16, 48, device=device)], False)


def test_group_op_reference_on_cpu() -> None:
    seed = fresh_seed()
    x, w = operands(seed, 4, 32, 48, torch.float32, "cpu")
    ws = [w, w[:16].clone()]
    got = torch.ops.deepinfer.skinny_linear_group(x, ws, True)
    assert all(torch.equal(a, reference(x, b, True)) for a, b in zip(got, ws)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.skinny_linear_group.default, (x, ws, True))


@cuda_only
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("ns,k", GROUP_WEIGHTS, ids=str)
def test_group_model_sizes(ns: tuple[int, ...], k: int, out_fp32: bool) -> None:
    """P8's groups: each output within accumulation error, and row r alone == row r in a batch."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, k, generator=g).to("cuda", torch.bfloat16)
    ws = [(torch.randn(n, k, generator=g) * k**-0.5).to("cuda", torch.bfloat16) for n in ns]
    full = skinny_linear_group_triton(x, ws, out_fp32)
    for i, (w, y) in enumerate(zip(ws, full)):
        assert_close(y, x, w, out_fp32, f"seed={seed} N={ns} weight {i}")
    for r in (0, 7):
        alone = skinny_linear_group_triton(x[r : r + 1], ws, out_fp32)
        assert all(torch.equal(a[0], y[r]) for a, y in zip(alone, full)), f"seed={seed} N={ns} row {r}"
