"""``deepinfer::bi_matmul``'s (and ``bi_matmul_group``'s, ``bi_matmul_blocks``') Triton kernel (``kernels/triton/batch_invariant.py``) and
``deepinfer::bi_moe_experts`` (``kernels/triton/moe.py``) on a GPU: a row's bits do not
depend on M (1 to 4096 rows, P8's projection shapes, bf16 and fp32; the experts at every released
width), the matmul's close to cuBLAS's and the experts' the speed path's own. Skipped without CUDA
(Triton's interpreter cannot run bf16 dots)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (written for the H200)")

# [N, K] of P8 projections: wq_b, wo_b, wq_a, wkv, the head, the router (k split 16 ways), and
# an mHC-sized fp32 mix (24 rows of 16384, 64 ways)
SHAPES = [(32768, 1024), (4096, 8192), (1024, 4096), (512, 4096), (129280, 4096), (64, 4096), (24, 16384)]
ROWS = (1, 2, 7, 8, 16, 17, 63, 64, 65, 256, 4096)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    from deepinfer_fx.kernels.triton import register_nvidia_kernels

    assert register_nvidia_kernels()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype,out_fp32", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_rows_do_not_depend_on_m(n: int, k: int, dtype: torch.dtype, out_fp32: bool) -> None:
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype == torch.float32 and n * k > 1 << 28:
        pytest.skip("fp32 head: 2 GiB of weight, covered in bf16")
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    x = torch.randn(max(ROWS), k, device="cuda", generator=g).to(dtype)
    full = torch.ops.deepinfer.bi_matmul(x, w, out_fp32)
    for m in ROWS:
        rows = torch.randperm(max(ROWS), device="cuda", generator=g)[:m]
        got = torch.ops.deepinfer.bi_matmul(x[rows], w, out_fp32)
        assert torch.equal(got, full[rows]), f"seed={seed} M={m}"
    ref = x.float() @ w.float().T
    err = ((full.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"seed={seed}: {err}"


# the N of projections of one input (K): V4-Flash's normed input (weights of three chunkings) and query latent
GROUPS = [((1024, 512, 256, 64, 2048, 2048), 4096), ((32768, 8192), 1024)]


@pytest.mark.parametrize("ns,k", GROUPS)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_group_rows_equal_each_projection(ns: tuple[int, ...], k: int, out_fp32: bool) -> None:
    """``bi_matmul_group`` gives each weight ``bi_matmul``'s bits at every M (one skinny launch
    per chunking up to 16 rows, a call a weight above)."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator(device="cuda").manual_seed(seed)
    ws = [(torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16) for n in ns]
    x = torch.randn(max(ROWS), k, device="cuda", generator=g).to(torch.bfloat16)
    for m in ROWS:
        rows = torch.randperm(max(ROWS), device="cuda", generator=g)[:m]
        got = torch.ops.deepinfer.bi_matmul_group(x[rows], ws, out_fp32)
        for i, w in enumerate(ws):
            assert torch.equal(got[i], torch.ops.deepinfer.bi_matmul(x[rows], w, out_fp32)), f"seed={seed} M={m} w{i}"


# (G, R, K) of the grouped wo_a: V4-Flash / V4.1-Flash (8 x 1024 of 4096), V4-Pro (16 x 1024 of 8192)
BLOCKS = [(8, 1024, 4096), (16, 1024, 8192)]


@pytest.mark.parametrize("g_,r,k", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_rows_do_not_depend_on_m(g_: int, r: int, k: int, dtype: torch.dtype) -> None:
    """``bi_matmul_blocks``: the skinny blocks kernel up to 16 rows, a launch a block above, one
    row's bits at every M; the product of the block-diagonal weight."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(g_ * r, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    x = torch.randn(max(ROWS), g_ * k, device="cuda", generator=g).to(dtype)
    full = torch.ops.deepinfer.bi_matmul_blocks(x, w, g_)
    for m in ROWS:
        rows = torch.randperm(max(ROWS), device="cuda", generator=g)[:m]
        got = torch.ops.deepinfer.bi_matmul_blocks(x[rows], w, g_)
        assert torch.equal(got, full[rows]), f"seed={seed} M={m}"
    ref = torch.einsum("mgi,gri->mgr", x.float().unflatten(1, (g_, k)), w.float().unflatten(0, (g_, r))).flatten(1)
    err = ((full.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"seed={seed}: {err}"


# tilings (BM, BN, BK, warps, stages): mma and wgmma, 1 to 8 warps
TILINGS = [(16, 32, 128, 4, 4), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (32, 32, 32, 2, 3)]


@pytest.mark.parametrize("n,k,dtype", [(1024, 4096, torch.bfloat16), (24, 16384, torch.float32)])
def test_rows_do_not_depend_on_the_tile(n: int, k: int, dtype: torch.dtype) -> None:
    """What lets ``tiles`` follow M: without a k split every tiling gives a row the same bits."""
    import triton

    from deepinfer_fx.kernels.triton.batch_invariant import _bi_matmul_kernel

    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(300, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    outs = []
    for bm, bn, bk, warps, stages in TILINGS[:3] + [(16, 32, 32, 4, 3)] if dtype == torch.float32 else TILINGS:
        y = torch.empty(300, n, device="cuda", dtype=torch.float32)
        grid = (triton.cdiv(300, bm), triton.cdiv(n, bn), 1)
        chunk = triton.cdiv(k, bk) * bk
        args = (x, w, y, 300, n, *x.stride(), *w.stride(), *y.stride(), 0)
        kw = dict(K=k, CHUNK=chunk, S=1, BM=bm, BN=bn, BK=bk if dtype != torch.float32 else min(bk, 32))
        _bi_matmul_kernel[grid](*args, **kw, IEEE=dtype == torch.float32, num_warps=warps, num_stages=stages)
        outs.append(y)
    assert all(torch.equal(o, outs[0]) for o in outs), f"seed={seed}"


def test_runs_of_one_call_repeat_bit_for_bit() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(100, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    first = torch.ops.deepinfer.bi_matmul(x, w, True)
    assert all(torch.equal(torch.ops.deepinfer.bi_matmul(x, w, True), first) for _ in range(5))


# (experts, intermediate, hidden, top-k): P8 (V4-Flash widths, fewer experts), V4.1-Flash, V4-Pro
EXPERT_SHAPES = [(16, 2048, 4096, 6), (16, 2048, 5120, 6), (8, 3072, 7168, 6)]


@pytest.mark.parametrize("e,inter,dim,k", EXPERT_SHAPES)
def test_expert_rows_do_not_depend_on_the_batch(e: int, inter: int, dim: int, k: int) -> None:
    """``deepinfer::bi_moe_experts`` (the grouped kernels with their tiles chosen by row count): a
    token's result is the same bits alone and among decode-sized and prefill-sized batches (1 to
    2048 tokens), and the speed path's own result."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1, w3 = ((torch.randn(e, inter, dim, device="cuda", generator=g) * dim**-0.5).bfloat16() for _ in range(2))
    w2 = (torch.randn(e, dim, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    t = 2048
    x = torch.randn(t, dim, device="cuda", generator=g).bfloat16()
    idx = torch.rand(t, e, device="cuda", generator=g).argsort(-1)[:, :k].sort(-1).values
    rw = torch.rand(t, k, device="cuda", generator=g)
    full = torch.ops.deepinfer.bi_moe_experts(x, w1, w3, w2, idx, rw, 10.0)
    for m in (1, 3, 8, 64, 300):
        rows = torch.randperm(t, device="cuda", generator=g)[:m]
        got = torch.ops.deepinfer.bi_moe_experts(x[rows], w1, w3, w2, idx[rows], rw[rows], 10.0)
        assert torch.equal(got, full[rows]), f"seed={seed} T={m}"
    assert torch.equal(full, torch.ops.deepinfer.moe_experts(x, w1, w3, w2, idx, rw, 10.0)), f"seed={seed}"
