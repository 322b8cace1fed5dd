"""``deepinfer::engram_rows``'s Triton kernel against ``graphs/engram.py::gather_rows``, bit for bit:
fp8 rows with ue8m0 scales (every byte value, scale byte 0 included) and unquantised tables; on
the GPU also from a host table registered for the device (the path compiled steps take)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.engine.engram_tables import _register
from deepinfer_fx.graphs.engram import gather_rows
from deepinfer_fx.kernels.triton.engram import engram_rows_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _table(rows: int, head: int, dtype: torch.dtype, g: torch.Generator):
    if dtype == torch.float8_e4m3fn:
        w = torch.randint(0, 256, (rows, head), dtype=torch.uint8, generator=g)
        w[w & 0x7F == 0x7F] = 0  # e4m3fn's NaN codes: a table holds none
        s = torch.randint(0, 140, (rows, head // 32), dtype=torch.uint8, generator=g)
        s[0, 0] = 0
        return w.view(torch.float8_e4m3fn), s
    return torch.randn(rows, head, generator=g).to(dtype), None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_engram_rows_kernel_equals_reference(dtype: torch.dtype) -> None:
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    w, s = _table(301, 64, dtype, g)
    ids = torch.randint(0, 301, (7, 5), generator=g)
    ids[0, 0] = 0
    want = gather_rows.reference(w, s, ids)
    got = engram_rows_triton(w.to(DEVICE), None if s is None else s.to(DEVICE), ids.to(DEVICE))
    assert got.shape == (7, 5, 64) and torch.equal(got.cpu(), want), f"seed={seed} {dtype}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host tables are read by a GPU")
def test_engram_rows_from_registered_host_memory_on_cuda() -> None:
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    w, s = _table(4099, 256, torch.float8_e4m3fn, g)
    _register(w), _register(s)
    ids = torch.randint(0, 4099, (64, 24), generator=g)
    got = torch.ops.deepinfer.engram_rows(w, s, ids.cuda())
    assert torch.equal(got.cpu(), gather_rows.reference(w, s, ids)), f"seed={seed}"
