"""The tile sweep of ``bench/moe_kernel.py --sweep T``: tile candidates of the routed-expert
kernels (prefill and decode lists), timed at T tokens against the math of ``graphs/moe.py``; and
the op under test with its reference (bf16, shared expert folded in, or MXFP4)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from ..graphs.moe import routed_experts, shared_expert
from ..io.quant import dequant_mxfp4
from ..kernels.triton.moe import moe_experts_fp4_triton, moe_experts_shared_triton, moe_experts_triton
from ..kernels.triton.moe_tiles import Tiles, expert_tiles, max_blocks
from .timing import graph_ms

# Candidates of the prefill tile sweep (bm, bn, bk, group_m, warps, stages, half); each list
# starts from the tiles ``choose_tiles`` picks at T = 4096, then the same without half-height
# last blocks. Two fp32 accumulators of bm x bn in the gate/up kernel bound its tile at
# 128 x 128 on 8 warps.
_GATE_UP_SWEEP = [
    (128, 128, 64, 16, 8, 3, True),
    (128, 128, 64, 16, 8, 3, False),
    (128, 128, 64, 16, 8, 4, True),
    (128, 128, 32, 16, 8, 5, True),
    (128, 64, 64, 16, 4, 4, True),
    (64, 128, 64, 16, 4, 4, True),
    (128, 128, 64, 8, 8, 3, True),
    (128, 128, 128, 16, 8, 2, True),
    (64, 64, 64, 16, 4, 5, False),
    (128, 128, 64, 16, 8, 4, False),
    (128, 64, 128, 16, 4, 3, True),
    (256, 64, 64, 8, 8, 3, True),
    (64, 256, 64, 8, 8, 3, True),
    (128, 128, 32, 8, 4, 4, True),
]
_DOWN_SWEEP = [
    (128, 256, 64, 8, 8, 4, True),
    (128, 256, 64, 8, 8, 4, False),
    (128, 256, 64, 8, 8, 3, True),
    (128, 128, 64, 8, 8, 4, True),
    (128, 128, 64, 8, 4, 4, True),
    (256, 128, 64, 8, 8, 3, True),
    (128, 256, 32, 8, 8, 5, True),
    (64, 256, 64, 8, 4, 4, True),
    (128, 128, 128, 8, 8, 3, True),
    (128, 128, 64, 8, 4, 3, True),
    (256, 128, 64, 8, 8, 4, True),
    (128, 256, 64, 16, 8, 3, False),
    (64, 128, 64, 8, 4, 4, True),
]


# Decode candidates (both kernels): the chosen narrow and wide tiles, and column widths and
# pipeline depths around them.
_DECODE_SWEEP = [
    (16, 32, 128, 1, 4, 4, False),
    (16, 128, 128, 1, 4, 3, False),
    (16, 64, 128, 1, 4, 4, False),
    (16, 64, 128, 1, 4, 3, False),
    (16, 32, 128, 1, 4, 3, False),
    (16, 32, 256, 1, 4, 3, False),
    (16, 64, 256, 1, 4, 3, False),
    (16, 128, 64, 1, 4, 4, False),
    (16, 32, 128, 1, 2, 4, False),
]


# MXFP4 decode candidates: only tiles that keep a row's bits at every row count (k tile 64,
# columns >= 64, ``moe_tiles.fp4_tiles``), over columns, warps and pipeline depth; the first is the chosen one.
_FP4_DECODE_SWEEP = [(16, 64, 64, 1, 4, 3, False)] + [
    (16, bn, 64, 1, w, st, False)
    for bn in (64, 128, 256)
    for w in (4, 8)
    for st in (3, 4, 5)
    if (bn, w, st) != (64, 4, 3)
]

# MXFP4 prefill candidates, the same rule (k tile 64, columns >= 64), with 256-row blocks: does a
# decode shared by more rows pay? (It did not on the H100: docs/decisions.md, session 47.)
_FP4_PREFILL_SWEEP = [
    (bm, bn, 64, 8, w, st, True) for bm in (128, 256) for bn in (64, 128) for w in (4, 8) for st in (3, 4)
]


def expert_op(
    w: dict, sh: dict | None, q4: dict | None = None
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """The op under test, ``(x, idx, rw, limit, out=, tiles=) -> [T, D]``, and its math
    (``graphs/moe.py``): the bf16 routed experts, plus the shared expert ``sh`` when given, or
    with ``q4`` (``{name: (codes, scales)}``) the MXFP4 ones against their dequantised weights."""
    if q4 is not None:
        w4 = (q4["w1"][0], q4["w1"][1], q4["w3"][0], q4["w3"][1], q4["w2"][0], q4["w2"][1])

        def op4(x, idx, rw, limit, out=None, tiles=None):
            return moe_experts_fp4_triton(x, *w4, idx, rw, limit, out=out, tiles=tiles)

        def reference4(x, idx, rw, limit):
            return routed_experts.reference({n: dequant_mxfp4(*q4[n], x.dtype) for n in q4}, limit, x, idx, rw)

        return op4, reference4

    def op(
        x: torch.Tensor,
        idx: torch.Tensor,
        rw: torch.Tensor,
        limit: float,
        out: torch.Tensor | None = None,
        tiles: tuple[Tiles, Tiles] | None = None,
    ) -> torch.Tensor:
        if sh is None:
            return moe_experts_triton(x, w["w1"], w["w3"], w["w2"], idx, rw, limit, out=out, tiles=tiles)
        return moe_experts_shared_triton(
            x, w["w1"], w["w3"], w["w2"], sh["w1"], sh["w3"], sh["w2"], idx, rw, limit, out=out, tiles=tiles
        )

    def reference(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, limit: float) -> torch.Tensor:
        routed = routed_experts.reference(w, limit, x, idx, rw)
        return routed if sh is None else routed + shared_expert(sh, limit, x).float()

    return op, reference


def sweep(
    t: int, w: dict, limit: float, top: int, iters: int, sh: dict | None = None, q4: dict | None = None
) -> list[dict]:
    """Time the bf16 op (with the shared expert ``sh`` folded in when given; the MXFP4 one with
    ``q4``, its base tiles ``fp4_tiles`` of bf16's, over ``_FP4_DECODE_SWEEP`` or
    ``_FP4_PREFILL_SWEEP``) at ``t`` tokens over the gate/up candidates (down tiles as chosen),
    then the down candidates (gate/up as chosen).
    Each row: the kernel's programs, whole-op ms and TFLOP/s, max rel diff."""
    e, inter, d = w["w1"].shape
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(t, e, device="cuda").topk(top, dim=-1).indices
    rw = torch.rand(t, top, device="cuda")
    out = torch.empty(t, d, device="cuda")
    op, reference = expert_op(w, sh, q4)
    ref = reference(x, idx, rw, limit)
    pairs, experts = t * (top + (sh is not None)), e + (sh is not None)
    flops = 6 * pairs * d * inter
    base = expert_tiles(pairs, experts, inter, d, 0, q4 is not None, 2, 1 if q4 is not None else 2)
    decode = t <= 64
    rows = []
    for part, n, cands in (
        ("gate_up", inter, _DECODE_SWEEP if decode else _GATE_UP_SWEEP),
        ("down", d, _DECODE_SWEEP if decode else _DOWN_SWEEP),
    ):
        if q4 is not None:  # MXFP4: k tile 64 and columns >= 64 keep a row's bits (fp4_tiles)
            cands = _FP4_DECODE_SWEEP if decode else [base[part == "down"], *_FP4_PREFILL_SWEEP]
        for cand in cands:
            tiles = (Tiles(*cand), base[1]) if part == "gate_up" else (base[0], Tiles(*cand))
            programs = max_blocks(pairs, experts, cand[0]) * triton.cdiv(n, cand[1])
            try:
                err = ((op(x, idx, rw, limit, tiles=tiles) - ref).abs().max() / ref.abs().max()).item()
                ms = graph_ms(lambda: op(x, idx, rw, limit, out=out, tiles=tiles), iters)
            except Exception as exc:  # a config Triton cannot compile (shared memory, registers)
                rows.append({"part": part, "tiles": list(cand), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            rows.append(
                {
                    "part": part,
                    "tiles": list(cand),
                    "programs": programs,
                    "chosen": Tiles(*cand) == base[0 if part == "gate_up" else 1],
                    "ms": round(ms, 4),
                    "TFLOPs": round(flops / ms / 1e9, 1),
                    "max_rel_diff": err,
                }
            )
            print(rows[-1], flush=True)
    return rows
