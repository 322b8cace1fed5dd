"""The routed-expert Triton kernels run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``,
in a child process: the mode is fixed when the kernels are defined), against the eager math of
``graphs/moe.py`` over the dequantised weights: bf16-free shapes in fp32, the tile shapes of
decode (few rows an expert) and prefill (many), k tiles that overrun K (masked), for plain, block
FP8 and MXFP4 weights. The GPU tests compile the same kernels for sm_90."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, sys, torch
from deepinfer_fx.graphs.moe import routed_experts
from deepinfer_fx.io.quant import dequant_fp8_block, dequant_mxfp4, quant_fp8_block, quant_mxfp4, ue8m0_to_float
from deepinfer_fx.kernels.triton.moe import moe_experts_fp4_triton, moe_experts_fp8_triton, moe_experts_triton

seed, cases = int(sys.argv[1]), json.loads(sys.argv[2])
out = []
for fmt, e, i, d, t, k in cases:
    g = torch.Generator().manual_seed(seed)
    w = {n: torch.randn(e, *s, generator=g) / s[1] ** 0.5 for n, s in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i)))}
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    rw = torch.rand(t, k, generator=g)
    if fmt == "fp4":
        q = {n: quant_mxfp4(v) for n, v in w.items()}
        q = {n: (a.view(torch.uint8), s.view(torch.uint8)) for n, (a, s) in q.items()}
        ref_w = {n: dequant_mxfp4(a, s) for n, (a, s) in q.items()}
        got = moe_experts_fp4_triton(x, q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1], idx, rw, 6.0)
    elif fmt == "fp8":
        q = {n: quant_fp8_block(v, 32) for n, v in w.items()}
        q = {n: (a, ue8m0_to_float(s).contiguous()) for n, (a, s) in q.items()}
        ref_w = {n: dequant_fp8_block(a, s, 32) for n, (a, s) in q.items()}
        got = moe_experts_fp8_triton(x, q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1], idx, rw, 6.0, 32)
    else:
        ref_w = w
        got = moe_experts_triton(x, w["w1"], w["w3"], w["w2"], idx, rw, 6.0)
    ref = routed_experts.reference(ref_w, 6.0, x, idx, rw)
    out.append(((got - ref).abs().max() / ref.abs().max()).item())
print(json.dumps(out))
"""

# (format, experts, intermediate, hidden, tokens, k): decode-like (few rows an expert), then a
# prefill-like batch (over 64 rows an expert: the 128-row half-height tiles), then widths whose
# k tiles overrun K (96 and 160 are multiples of 32, not of the 128 / 64 tiles)
CASES = [
    (fmt, *shape)
    for fmt in ("plain", "fp8", "fp4")
    for shape in ((4, 64, 128, 5, 2), (2, 64, 64, 140, 2), (3, 96, 160, 7, 2))
]


def test_expert_kernels_match_the_eager_math() -> None:
    seed = random.SystemRandom().randrange(2**31)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(seed), json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    bad = {CASES[j]: err for j, err in enumerate(errors) if not err < 1e-5}
    assert not bad, f"seed {seed}: relative errors {bad}"
