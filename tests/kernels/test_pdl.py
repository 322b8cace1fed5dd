"""Programmatic dependent launch (``kernels/triton/pdl.py``): when it is on, and that a chain of
dependent kernels replayed from a CUDA graph with it gives the bits of the chain without it."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.kernels.triton import pdl
from deepinfer_fx.kernels.triton.linear import skinny_linear_triton
from deepinfer_fx.kernels.triton.norm import rms_norm_triton
from deepinfer_fx.settings import setting


def test_off_for_cpu_tensors() -> None:
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_setting_refuses_a_bad_value() -> None:
    assert setting("DEEPINFER_PDL", {}) is True  # on unless switched off (docs/architecture.md, decisions)
    assert setting("DEEPINFER_PDL", {"DEEPINFER_PDL": "0"}) is False
    with pytest.raises(ValueError, match="DEEPINFER_PDL='maybe' is invalid: expected 0 or 1"):
        setting("DEEPINFER_PDL", {"DEEPINFER_PDL": "maybe"})


def _chain(x: torch.Tensor, ws: list[torch.Tensor], norm_w: torch.Tensor) -> torch.Tensor:
    """Each launch reads what the one before wrote (and the norms what the GEMV before wrote)."""
    for w in ws:
        x = skinny_linear_triton(rms_norm_triton(x, norm_w, 1e-6), w, False)
    return x


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90+")
def test_graph_replay_with_pdl_equals_without(monkeypatch: pytest.MonkeyPatch) -> None:
    seed = random.randrange(2**31)
    g = torch.Generator("cuda").manual_seed(seed)
    d = 1024
    ws = [torch.randn(d, d, generator=g, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in range(24)]
    norm_w = torch.rand(d, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(4, d, generator=g, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(pdl, "_ON", {torch.cuda.current_device(): False})
    want = _chain(x, ws, norm_w)
    monkeypatch.setattr(pdl, "_ON", {torch.cuda.current_device(): True})
    static_x = x.clone()
    _chain(static_x, ws, norm_w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _chain(static_x, ws, norm_w)
    for _ in range(3):
        static_out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static_out, want), f"seed {seed}: PDL replay differs from the plain chain"
    x2 = torch.randn(4, d, generator=g, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(pdl, "_ON", {torch.cuda.current_device(): False})
    want2 = _chain(x2, ws, norm_w)
    static_x.copy_(x2)
    graph.replay()
    assert torch.equal(static_out, want2), f"seed {seed}: PDL replay on new input differs"
