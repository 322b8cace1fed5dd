"""``deepinfer::bi_matmul``'s Triton kernel (``kernels/triton/batch_invariant.py``) on a GPU: a
row's bits do not depend on M (1 to 4096 rows, P8's projection shapes, bf16 and fp32), and the
result is close to cuBLAS's. Skipped without CUDA (Triton's interpreter cannot run bf16 dots)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (written for the H200)")

# [N, K] of P8 projections: wq_b, wo_b, wq_a, wkv, the head
SHAPES = [(32768, 1024), (4096, 8192), (1024, 4096), (512, 4096), (129280, 4096)]
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


def test_runs_of_one_call_repeat_bit_for_bit() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(100, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    first = torch.ops.deepinfer.bi_matmul(x, w, True)
    assert all(torch.equal(torch.ops.deepinfer.bi_matmul(x, w, True), first) for _ in range(5))


def test_engine_flag_refuses_on_cuda() -> None:
    """Until attention, the expert GEMMs, mHC and the indexer have batch-invariant kernels, the
    engine refuses the flag on CUDA instead of running half of it."""
    from tiny import tiny_v4

    import deepinfer_fx
    from deepinfer_fx import LLM
    from deepinfer_fx.config import config_from_dict

    model = deepinfer_fx.random_model(
        config_from_dict(tiny_v4()).replace(fake_quant=False), seed=0, dtype=torch.bfloat16, device="cuda"
    )
    with pytest.raises(ValueError, match="not built on cuda"):
        LLM(model, device="cuda", max_model_len=32, batch_invariant=True, eager=True)
