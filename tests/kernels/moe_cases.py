"""Shared by the routed-expert kernel tests (``test_triton_moe.py``, ``test_triton_moe_fp4.py``):
random cases, the reference, the closeness check, and P8's bf16 weights on the GPU."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.graphs.moe import routed_experts

reference = routed_experts.reference
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def moe_case(
    seed: int,
    t: int,
    e: int,
    d: int,
    i: int,
    k: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    experts: list[int] | None = None,
) -> dict:
    """Random inputs; ``experts`` restricts routing to those ids (k of them drawn per token,
    with repeats when fewer than k are given)."""
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    w = {"w1": randn(e, i, d) / d**0.5, "w3": randn(e, i, d) / d**0.5, "w2": randn(e, d, i) / i**0.5}
    pool = torch.tensor(experts if experts is not None else list(range(e)), device=device)
    if len(pool) >= k:
        idx = pool[torch.rand(t, len(pool), generator=g, device=device).argsort(-1)[:, :k]]
    else:
        idx = pool[torch.randint(len(pool), (t, k), generator=g, device=device)]
    rw = torch.rand(t, k, generator=g, device=device) + 0.1
    return {"x": randn(t, d).to(dtype), "w": {n: v.to(dtype) for n, v in w.items()}, "idx": idx, "rw": rw}


def check_close(got: torch.Tensor, want: torch.Tensor, seed: int, tol: float) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, f"seed {seed}: {got.dtype} {tuple(got.shape)}"
    assert torch.isfinite(got).all(), f"seed {seed}: non-finite output"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"seed {seed}: max |diff| / max |ref| = {err:.3g} > {tol}"


def p8_case() -> dict:
    """A fresh seed's bf16 case at the P8 benchmark's widths (D 4096, I 2048, E 64, k 6), 4,096 tokens."""
    seed = random.randrange(2**31)
    return {"seed": seed, **moe_case(seed, 4096, 64, 4096, 2048, 6, "cuda", torch.bfloat16)}
