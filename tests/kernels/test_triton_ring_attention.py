"""The Triton ``ring_mqa`` kernel (decode attention reading the window ring and the entry pool in
place) against ``graphs/attention.py::mqa_ring``, and bit for bit against ``sparse_mqa`` over the
keys gathered the way the reference gathers them.

Every case draws a fresh seed (printed in the failure message). On CPU the kernels run under
Triton's interpreter in fp32 at small sizes (small ``block_n`` / ``split`` reach tiles that straddle
the ring and the entries, several splits, and the parallel path); with CUDA, bf16 at the model's
sizes runs too.
"""

from __future__ import annotations

import math

import pytest
import torch
from sm90_ptxas import PTXAS
from test_triton_attention import PATHS, _fresh_seed, needs_cuda

from deepinfer_fx.graphs.attention import mqa_ring
from deepinfer_fx.graphs.window import ring_positions, window_bias
from deepinfer_fx.kernels.triton.attention import sparse_mqa_triton
from deepinfer_fx.kernels.triton.ring_attention import ring_mqa_triton


def _case(seed: int, c: int, h: int, d: int, w: int, e: int, k: int | None, dtype: torch.dtype, device: str):
    """``c`` chunks in a pool of ``c + 2`` slots (taken in shuffled order), positions from before
    the ring fills (empty slots) to far past it; entries ``e`` a slot (``None``: no entries), read
    through ``k`` rows (``None``: all of them) with a 0 / -inf bias that hides about a third."""
    g = torch.Generator().manual_seed(seed)
    s = c + 2
    q = torch.randn(c, 1, h, d, generator=g)
    ring = torch.randn(s, w, d, generator=g)
    slots = torch.randperm(s, generator=g)[:c]
    pos = torch.randint(0, 4 * w, (c,), generator=g)
    pos[0] = w // 3  # part of the ring never written
    entries = rows = bias = None
    if e:
        entries = torch.randn(s, e, d, generator=g)
        n = e if k is None else k
        if k is not None:
            rows = torch.randint(0, e, (c, k), generator=g)
        hidden = torch.rand(c, 1, n, generator=g) < 0.3
        bias = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    sink = torch.randn(h, generator=g)
    angles = torch.rand(c, 1, d // 16, generator=g) * 2 * math.pi
    to = lambda x, dt=None: None if x is None else x.to(device, dt) if dt else x.to(device)  # noqa: E731
    return (
        to(q, dtype),
        to(ring, dtype),
        to(slots),
        to(pos),
        to(entries, dtype),
        to(rows),
        to(bias),
        to(sink),
        to(angles.cos()),
        to(angles.sin()),
    )


CASES = [(3, 4, 32, 24, 0, None), (3, 4, 32, 24, 40, None), (4, 8, 64, 32, 50, 20), (2, 4, 48, 16, 30, 37)]


@pytest.mark.parametrize("spare", [0, 5], ids=["ring-is-window", "spare-rows"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("c, h, d, w, e, k", CASES, ids=["window", "entries", "rows", "d48-rows"])
def test_matches_reference(
    device: str, path: str, c: int, h: int, d: int, w: int, e: int, k: int | None, spare: int
) -> None:
    """A ring of ``w`` rows whose queries see the last ``w - spare`` positions (a speculating
    engine's ring holds the longest draft more, ``graphs/state.py``)."""
    seed = _fresh_seed()
    args = _case(seed, c, h, d, w, e, k, torch.float32, device)
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    assert ring_mqa_triton(*args, window=w - spare, out=out, **PATHS[path]) is out
    want = mqa_ring(*args, w - spare)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


# (ring rows, tiling): tiles wholly in the ring or among the entries (two loops), one split
# holding both kinds; and tiles that straddle the ring's end (each row picks its source)
BITWISE = {
    "whole": (32, dict(block_n=16, split=32)),
    "whole-split-across": (32, dict(block_n=16, split=48)),
    "straddling": (24, dict(block_n=16, split=32)),
}


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("layout", list(BITWISE))
def test_bitwise_equals_gathered(device: str, layout: str, parallel: bool) -> None:
    """The same keys gathered for ``sparse_mqa`` give the same bits: one arithmetic, two ways in."""
    seed = _fresh_seed()
    w, tiling = BITWISE[layout]
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(seed, 4, 8, 64, w, 50, 20, torch.float32, device)
    chosen = entries[slots].gather(1, rows[..., None].expand(-1, -1, entries.shape[-1]))
    keys = torch.cat([ring[slots], chosen], 1)
    full_bias = torch.cat([window_bias(pos[:, None], ring_positions(pos, w), w), bias], -1)
    a = ring_mqa_triton(q, ring, slots, pos, entries, rows, bias, sink, cos, sin, parallel=parallel, **tiling)
    b = sparse_mqa_triton(q, keys, full_bias, sink, cos, sin, parallel=parallel, **tiling)
    assert torch.equal(a, b), f"seed {seed}"


def test_batch_invariance(device: str) -> None:
    """A chunk alone (parallel: few programs) == the same chunk among 70 (sequential)."""
    seed = _fresh_seed()
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(seed, 70, 4, 32, 24, 40, 30, torch.float32, device)
    batched = ring_mqa_triton(q, ring, slots, pos, entries, rows, bias, sink, cos, sin, block_n=16, split=32)
    for ci in (0, 69, 35):
        one = slice(ci, ci + 1)
        alone = ring_mqa_triton(
            q[one],
            ring,
            slots[one],
            pos[one],
            entries,
            rows[one],
            bias[one],
            sink,
            cos[one],
            sin[one],
            block_n=16,
            split=32,
        )
        assert torch.equal(alone[0], batched[ci]), f"seed {seed}: chunk {ci} differs alone"


def test_bad_inputs_are_named(device: str) -> None:
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(
        _fresh_seed(), 2, 4, 32, 16, 20, 8, torch.float32, device
    )
    with pytest.raises(ValueError, match="ring_mqa: mismatched inputs.*entry_bias"):
        ring_mqa_triton(q, ring, slots, pos, entries, rows, bias[..., :-1], sink, cos, sin)
    with pytest.raises(ValueError, match="one query a chunk"):
        ring_mqa_triton(q.expand(2, 3, 4, 32), ring, slots, pos, entries, rows, bias, sink, cos, sin)


@needs_cuda
@pytest.mark.parametrize("c", [1, 8, 64])
@pytest.mark.parametrize("e, k", [(0, None), (32, None), (1040, 512)], ids=["SWA", "HCA", "CSA"])
def test_bf16_model_sizes(c: int, e: int, k: int | None) -> None:
    """P8 decode shapes: 64 heads x 512, a 128-row ring; bf16 against the reference and bit for
    bit against ``sparse_mqa`` over the gathered keys."""
    seed = _fresh_seed()
    q, ring, slots, pos, entries, rows, bias, sink, cos, sin = _case(
        seed, c, 64, 512, 128, e, k, torch.bfloat16, "cuda"
    )
    out = ring_mqa_triton(q, ring, slots, pos, entries, rows, bias, sink, cos, sin)
    want = mqa_ring(q, ring, slots, pos, entries, rows, bias, sink, cos, sin, 128)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}")
    keys, full_bias = ring[slots], window_bias(pos[:, None], ring_positions(pos, 128), 128)
    if e:
        chosen = entries[slots] if rows is None else entries[slots].gather(1, rows[..., None].expand(-1, -1, 512))
        keys, full_bias = torch.cat([keys, chosen], 1), torch.cat([full_bias, bias], -1)
    assert torch.equal(out, sparse_mqa_triton(q, keys, full_bias, sink, cos, sin)), f"seed {seed}"


# --- offline compile for the H200 --------------------------------------------------------------

# P8 decode: (kernel, key source, entries a slot, keys a query): plain keys gathered beforehand;
# the ring alone (SWA), with all entries (HCA) and through the indexer's row list (CSA)
SM90 = {
    "sequential-plain": ("sequential", None, 0, 640),
    "sequential-swa": ("sequential", "swa", 0, 128),
    "sequential-hca": ("sequential", "hca", 32, 160),
    "sequential-csa": ("sequential", "csa", 1040, 640),
    "split-plain": ("split", None, 0, 640),
    "split-hca": ("split", "hca", 32, 160),
    "split-csa": ("split", "csa", 1040, 640),
}


def _compile_for_sm90(out_dir: str) -> None:
    """PTX of the decode kernels for sm_90 with the launcher's P8 decode tiling (bf16, 64 heads
    x 512, a 128-row ring), one file per ``SM90`` case, into ``out_dir``, specialised as a
    launch specialises them (integer arguments of 1 are constants, multiples of 16 aligned).
    Runs in a child process without the interpreter (``sm90_ptxas.compile_in_subprocess``)."""
    from pathlib import Path

    import triton
    from sm90_ptxas import compile_sm90

    from deepinfer_fx.kernels.triton import attention
    from deepinfer_fx.kernels.triton.mqa_kernels import mqa_sequential, mqa_split

    h, d, w = 64, 512, 128
    for name, (kind, layer, e, n) in SM90.items():
        fn = mqa_sequential if kind == "sequential" else mqa_split
        ring, k = layer is not None, n - w
        split = attention.default_split(n)
        ints = {
            "T": 1,
            "H": h,
            "N": n,
            "W": w if ring else 0,
            "window": w if ring else 0,
            "split": split,
            "n_tiles": 0,
            "n_splits": triton.cdiv(n, split),
            "stride_qr": h * d,
            "stride_qh": d,
            "stride_kb": (w if ring else n) * d,
            "stride_kn": d,
            "stride_br": k if ring else n,
            "stride_bn": 1,
            "stride_es": e * d if ring else 0,
            "stride_en": d if ring else 0,
            "stride_rr": k if layer == "csa" else 0,
            "stride_rn": 1 if layer == "csa" else 0,
            "stride_or": h * d,
            "stride_oh": d,
        }
        types = {
            "q_ptr": "*bf16",
            "k_ptr": "*bf16",
            "e_ptr": "*bf16",
            "out_ptr": "*bf16",
            "qk_scale": "fp32",
            "r_ptr": "*i64" if layer == "csa" else "*bf16",
            "slots_ptr": "*i64",
            "pos_ptr": "*i64",
        }
        consts = {
            "BH": attention._BH,
            "HB": h // attention._BH,
            "BLOCK_N": attention._BLOCK_N,
            "BLOCK_D": d,
            "D": d,
            "HALF": 32,
            "BLOCK_HALF": 32,
            "DOT_FP32": False,
            "SKIP": False,
            "RING": ring,
            "ROWS": layer == "csa",
            "WHOLE": w % attention._BLOCK_N == 0,
            "PDL": True,
        } | {a: 1 for a, v in ints.items() if v == 1}
        consts = {a: v for a, v in consts.items() if a in fn.arg_names}
        kernel = compile_sm90(
            fn,
            types,
            consts,
            lambda a: ints.get(a, 1) % 16 == 0,
            num_warps=attention._NUM_WARPS,
            num_stages=attention._NUM_STAGES,
        )
        Path(out_dir, f"{name}.ptx").write_text(kernel.asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory):
    from sm90_ptxas import compile_in_subprocess

    return compile_in_subprocess("test_triton_ring_attention", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("case", [c for c in SM90 if not c.endswith("plain")])
def test_ring_kernels_spill_no_more_than_gathered(case: str, sm90_ptx) -> None:
    """Reading in place must cost no more registers than reading gathered keys: with each row
    picking its own 64-bit pointer the ring kernels spilled 150-200 bytes on sm_90 and ran up to
    ~1.5x the gathered kernel's time on an H200 (bench/results/attention_kernel_decode_ring_spilling_s15.json)."""
    from sm90_ptxas import ptxas_report

    spills, _, log = ptxas_report((sm90_ptx / f"{case}.ptx").read_text())
    plain, _, _ = ptxas_report((sm90_ptx / f"{case.split('-')[0]}-plain.ptx").read_text())
    assert spills[0] <= plain[0], log
