"""The two-launch Triton compressor pooling against ``graphs/compressor.py::pool_windows``.

Every case draws a fresh seed (in the failure message) and starts from a ring full of random
stale rows, so a row read from the wrong place or written at the wrong time shows. The outputs
are poisoned (NaN latents, window id -1, the negated completion flags), so an unwritten element
fails. Compared: window ids and completion exactly, latents to fp32 precision, and the ring of
every real slot exactly after the call (the scratch slot is left out: the reference parks its
masked rows there and the kernel writes none). Cases: CSA (ratio 4, overlapping windows), HCA
(ratio 8, 16 and 128, disjoint), V4.1 (ratio 2 gated, ratio 1 without a gate); decode-like (one
token per chunk, at position 0, mid-window and window-closing positions, with a padding chunk
on the scratch slot) and prefill-like (chunks spanning several windows from starts that are not
multiples of the ratio); latents wide enough that a window's channels split over several
programs, the last block partly masked; and whole sequences fed chunk by chunk, each side
carrying its own ring. A window's latent is the same bit for bit whatever batch it comes in.
On CUDA also model sizes, the op's dispatch to two launches and a CUDA-graph replay. Everywhere
ptxas is, both kernels are compiled for sm_90 at the model's sizes offline and must not spill.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton

from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.graphs.compressor import pool_windows
from deepinfer_fx.kernels.triton.compressor import (
    _compressor_norm_kernel,
    _compressor_pool_kernel,
    compressor_pool_triton,
    norm_config,
    pool_config,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="model-sized inputs need a GPU")
EPS = 1e-6


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


class Case:
    """Random inputs of one call: chunks ``starts`` / ``lens`` padded to ``length`` rows, on
    distinct real slots of a state with ``n_slots`` real slots plus the scratch slot; chunks of
    length 0 sit on the scratch slot, as a compiled step's padding does."""

    def __init__(
        self,
        seed: int,
        ratio: int,
        overlap: bool,
        dim: int,
        length: int,
        starts: list[int],
        lens: list[int],
        gated: bool = True,
        device: str = "cpu",
        norm_dtype: torch.dtype = torch.float32,
        strided: bool = False,
        n_slots: int | None = None,
        spare: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        halves = 2 if overlap else 1
        width, ring, c = dim * halves, ratio * halves + spare, len(starts)
        self.n_slots = n_slots or c + 2
        self.ratio, self.overlap = ratio, overlap

        def rows(scale: float) -> torch.Tensor:
            x = torch.randn(c, length, width + 5 if strided else width, generator=g).to(device) * scale
            return x[..., 3 : 3 + width] if strided else x  # strided: a column slice of wider rows

        self.kv = rows(1.0)
        self.gate = rows(2.0) if gated else None
        self.rows_kv = torch.randn(self.n_slots + 1, ring, width, generator=g).to(device)
        self.rows_gate = torch.randn(self.n_slots + 1, ring, width, generator=g).to(device)
        real = torch.randperm(self.n_slots, generator=g)[:c]
        self.slots = torch.where(torch.tensor(lens) > 0, real, self.n_slots).to(device)
        self.starts = torch.tensor(starts, device=device)
        self.lens = torch.tensor(lens, device=device)
        self.norm = (1 + 0.2 * torch.randn(dim, generator=g)).to(device, norm_dtype)

    def args(self, rows_kv: torch.Tensor, rows_gate: torch.Tensor) -> tuple:
        return (
            self.kv,
            self.gate,
            rows_kv,
            rows_gate,
            self.slots,
            self.starts,
            self.lens,
            self.norm,
            self.ratio,
            self.overlap,
            EPS,
        )


def _check(case: Case, why: str) -> None:
    want_ring = (case.rows_kv.clone(), case.rows_gate.clone())
    got_ring = (case.rows_kv.clone(), case.rows_gate.clone())
    w, complete, latents = pool_windows(*case.args(*want_ring))
    out = (torch.full_like(w, -1), ~complete, torch.full_like(latents, float("nan")))
    got = compressor_pool_triton(*case.args(*got_ring), out=out)
    assert all(a is b for a, b in zip(got, out)), why
    assert torch.equal(got[0], w), f"{why}: window ids"
    assert torch.equal(got[1], complete), f"{why}: completion"
    torch.testing.assert_close(got[2], latents, rtol=1e-5, atol=1e-5, msg=lambda m: f"{why}: latents\n{m}")
    real = case.n_slots
    for name, a, b in zip(("rows_kv", "rows_gate"), got_ring, want_ring):
        torch.testing.assert_close(a[:real], b[:real], rtol=0, atol=0, msg=lambda m: f"{why}: ring {name}\n{m}")


# name: (ratio, overlap, gated, dim, L, starts, lens)
CPU_CASES = {
    # decode: position 0, mid-window, window-closing (3, 7), just past a close, and padding
    "csa-decode": (4, True, True, 16, 1, [0, 3, 5, 7, 8, 0], [1, 1, 1, 1, 1, 0]),
    "csa-prefill": (4, True, True, 16, 13, [6, 1, 0, 4], [13, 10, 3, 0]),
    "csa-prefill-short": (4, True, True, 16, 3, [2, 5, 0], [3, 2, 3]),  # L < ratio: one possible window
    "hca-decode": (8, False, True, 24, 1, [0, 7, 15, 20], [1, 1, 1, 1]),
    "hca-prefill": (8, False, True, 24, 19, [3, 0, 9], [19, 16, 5]),
    "hca128-decode": (128, False, True, 8, 1, [127, 0, 255, 300], [1, 1, 1, 1]),
    "hca128-prefill": (128, False, True, 8, 140, [100, 0], [140, 129]),
    "v41-ratio2-decode": (2, False, True, 16, 1, [0, 1, 2, 5], [1, 1, 1, 1]),
    "v41-ratio2-prefill": (2, False, True, 16, 7, [3, 0, 1], [7, 4, 6]),
    "v41-ratio1": (1, False, False, 16, 5, [0, 6, 3, 2], [5, 1, 4, 0]),
    # channels over several programs (pool_config): 3 blocks of 64, 3 of 32, 2 of 32, 2 of 256, 2 of 512
    "csa-decode-split": (4, True, True, 160, 1, [0, 3, 5, 7, 8, 0], [1, 1, 1, 1, 1, 0]),
    "csa-prefill-split": (4, True, True, 160, 13, [6, 1, 0, 4], [13, 10, 3, 0]),
    "hca16-split": (16, False, True, 72, 19, [3, 0, 9], [19, 16, 5]),
    "hca128-split": (128, False, True, 40, 140, [100, 0], [140, 129]),
    "v41-ratio2-split": (2, False, True, 300, 7, [3, 0, 1], [7, 4, 6]),
    "v41-ratio1-split": (1, False, False, 600, 5, [0, 6, 3, 2], [5, 1, 4, 0]),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_pooling_matches_reference(name: str, device: str) -> None:
    seed = _fresh_seed()
    ratio, overlap, gated, dim, length, starts, lens = CPU_CASES[name]
    case = Case(seed, ratio, overlap, dim, length, starts, lens, gated=gated, device=device)
    _check(case, f"seed={seed} {name}")


@pytest.mark.parametrize("name", ["csa-decode", "csa-prefill", "hca-prefill", "v41-ratio2-prefill", "v41-ratio1"])
def test_rings_with_spare_rows(name: str, device: str) -> None:
    """A speculating engine's rings hold the longest draft more rows (``graphs/state.py``):
    position p at ``p % ring``, a window still pooling its own span."""
    seed = _fresh_seed()
    ratio, overlap, gated, dim, length, starts, lens = CPU_CASES[name]
    case = Case(seed, ratio, overlap, dim, length, starts, lens, gated=gated, device=device, spare=3)
    _check(case, f"seed={seed} {name} spare 3")


@pytest.mark.parametrize("name", ["csa-prefill", "hca-prefill"])
def test_strided_rows_and_bf16_norm_weight(name: str, device: str) -> None:
    seed = _fresh_seed()
    ratio, overlap, gated, dim, length, starts, lens = CPU_CASES[name]
    case = Case(
        seed,
        ratio,
        overlap,
        dim,
        length,
        starts,
        lens,
        gated=gated,
        device=device,
        norm_dtype=torch.bfloat16,
        strided=True,
    )
    _check(case, f"seed={seed} {name} strided")


@pytest.mark.parametrize("spare", [0, 3], ids=["ring", "spare-rows"])
@pytest.mark.parametrize("ratio,overlap,gated", [(4, True, True), (8, False, True), (1, False, False)])
@pytest.mark.parametrize("chunking", ["decode", "prefill-then-decode"])
def test_sequences_fed_in_chunks(
    ratio: int, overlap: bool, gated: bool, chunking: str, spare: int, device: str
) -> None:
    """Three sequences of different lengths fed step by step, each side (kernel, reference)
    carrying its own ring from step to step: equal latents at every step, equal rings after;
    with spare ring rows, also the latents of the reference on a ring without them."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    dim, halves, n_seq = 8, 2 if overlap else 1, 3
    total = [3 * ratio + 2, 2 * ratio + 1, ratio + 3]
    base = Case(
        seed, ratio, overlap, dim, 1, [0] * n_seq, [1] * n_seq, gated=gated, device=device, n_slots=n_seq, spare=spare
    )
    ring_k = (torch.zeros_like(base.rows_kv), torch.zeros_like(base.rows_gate))
    ring_r = (torch.zeros_like(base.rows_kv), torch.zeros_like(base.rows_gate))
    plain = tuple(torch.zeros_like(t[:, : ratio * halves]) for t in ring_r)  # no spare rows
    pos = [0] * n_seq
    first = [min(t, 2 * ratio + 1) for t in total] if chunking == "prefill-then-decode" else [1] * n_seq
    while any(p < t for p, t in zip(pos, total)):
        lens = [0 if p >= t else (f if p == 0 else 1) for p, t, f in zip(pos, total, first)]
        length = max(lens)
        kv = torch.randn(n_seq, length, dim * halves, generator=g).to(device)
        gate = torch.randn(n_seq, length, dim * halves, generator=g).to(device) if gated else None
        slots = torch.where(torch.tensor(lens) > 0, torch.arange(n_seq), n_seq).to(device)
        meta = (
            slots,
            torch.tensor(pos, device=device),
            torch.tensor(lens, device=device),
            base.norm,
            ratio,
            overlap,
            EPS,
        )
        got = compressor_pool_triton(kv, gate, *ring_k, *meta)
        want = pool_windows(kv, gate, *ring_r, *meta)
        without = pool_windows(kv, gate, *plain, *meta)
        why = f"seed={seed} at positions {pos}"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), why
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5, msg=lambda m: f"{why}\n{m}")
        torch.testing.assert_close(want[2], without[2], rtol=0, atol=0, msg=lambda m: f"{why}: spare rows\n{m}")
        pos = [p + n for p, n in zip(pos, lens)]
    for a, b in zip(ring_k, ring_r):
        torch.testing.assert_close(a[:n_seq], b[:n_seq], rtol=0, atol=0, msg=lambda m: f"seed={seed} ring\n{m}")


def test_split_cases_split() -> None:
    """The -split cases above do spread a window over programs, and so do the model's decode
    windows: CSA at dim 512 (width 1024) and HCA over at least 8 programs, the indexer over 2."""

    def blocks(dim: int, ring: int) -> int:
        return triton.cdiv(dim, pool_config(dim, ring)["BLOCK_D"])

    for name, (ratio, overlap, _, dim, *_) in CPU_CASES.items():
        assert (blocks(dim, ratio * (2 if overlap else 1)) > 1) == name.endswith("-split"), name
    assert blocks(512, 8) >= 8 and blocks(512, 128) >= 8 and blocks(128, 8) >= 2


@pytest.mark.parametrize("ratio,overlap,gated,dim", [(4, True, True, 160), (128, False, True, 40)])
def test_window_does_not_depend_on_the_batch(ratio: int, overlap: bool, gated: bool, dim: int, device: str) -> None:
    """One decode chunk alone and the same chunk beside others in a longer, padded batch: the
    same latent bit for bit (the tiling depends on the widths and the ratio only)."""
    seed = _fresh_seed()
    start = 3 * ratio - 1  # closes a window
    batch = Case(
        seed, ratio, overlap, dim, 2 * ratio + 3, [5, start, 0], [2 * ratio + 3, 1, 2], gated=gated, device=device
    )
    alone = (
        batch.kv[1:2, :1],
        None if batch.gate is None else batch.gate[1:2, :1],
        batch.rows_kv.clone(),
        batch.rows_gate.clone(),
        batch.slots[1:2],
        batch.starts[1:2],
        batch.lens[1:2],
        batch.norm,
        ratio,
        overlap,
        EPS,
    )
    got_alone = compressor_pool_triton(*alone)
    got_batch = compressor_pool_triton(*batch.args(batch.rows_kv.clone(), batch.rows_gate.clone()))
    assert bool(got_alone[1][0, 0]) and bool(got_batch[1][1, 0]), f"seed={seed}"
    assert torch.equal(got_alone[2][0, 0], got_batch[2][1, 0]), f"seed={seed}"


def test_layout_that_does_not_fit_is_refused(device: str) -> None:
    case = Case(_fresh_seed(), 4, True, 16, 1, [0], [1], device=device)
    with pytest.raises(ValueError, match="do not fit"):
        compressor_pool_triton(*case.args(case.rows_kv[:, :4], case.rows_gate[:, :4]))


# --- CUDA only ------------------------------------------------------------------------------

# V4: CSA compressor (head_dim 512) and its indexer (128), HCA (ratio 128); V4.1: ratio 2 and
# ratio 1 (no gate) at head_dim 512. Decode batches of 64 and prefill chunks of thousands.
GPU_CASES = {
    "csa-decode-64": (4, True, True, 512, 1, "decode", 64),
    "csa-index-decode-64": (4, True, True, 128, 1, "decode", 64),
    "csa-prefill": (4, True, True, 512, 2048, "prefill", 3),
    "hca-decode-64": (128, False, True, 512, 1, "decode", 64),
    "hca-prefill": (128, False, True, 512, 4096, "prefill", 2),
    "v41-ratio2-decode-64": (2, False, True, 512, 1, "decode", 64),
    "v41-ratio1-prefill": (1, False, False, 512, 1024, "prefill", 2),
}


def _gpu_case(seed: int, name: str) -> Case:
    ratio, overlap, gated, dim, length, kind, c = GPU_CASES[name]
    rng = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 8 * ratio, (c,), generator=rng).tolist()
    if kind == "decode":  # make some of them close a window and one start the sequence
        starts = [s - s % ratio + ratio - 1 if i % 3 == 0 else s for i, s in enumerate(starts)]
        starts[1] = 0
        lens = [1] * c
    else:
        lens = [length, max(1, length - 5 * ratio - 1)] + [length // 3] * (c - 2)
        starts[0] = 1
    return Case(seed, ratio, overlap, dim, length, starts, lens, gated=gated, device="cuda", norm_dtype=torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_model_sizes(name: str) -> None:
    seed = _fresh_seed()
    _check(_gpu_case(seed, name), f"seed={seed} {name}")


@needs_cuda
def test_op_dispatches_to_two_launches() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::compressor_pool", "CUDA")
    seed = _fresh_seed()
    case = _gpu_case(seed, "csa-decode-64")
    ring = (case.rows_kv.clone(), case.rows_gate.clone())
    torch.ops.deepinfer.compressor_pool(*case.args(*ring))  # compile outside the profile
    ring = (case.rows_kv.clone(), case.rows_gate.clone())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = torch.ops.deepinfer.compressor_pool(*case.args(*ring))
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(launches) == 2, f"seed={seed}: {launches}"
    assert "_compressor_pool_kernel" in launches[0] and "_compressor_norm_kernel" in launches[1], (
        f"seed={seed}: {launches}"
    )
    want_ring = (case.rows_kv.clone(), case.rows_gate.clone())
    want = pool_windows(*case.args(*want_ring))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed={seed}"
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    for a, b in zip(ring, want_ring):
        assert torch.equal(a[:-1], b[:-1]), f"seed={seed}"
    torch.library.opcheck(
        torch.ops.deepinfer.compressor_pool.default, case.args(case.rows_kv.clone(), case.rows_gate.clone())
    )


@needs_cuda
def test_cuda_graph_replay() -> None:
    """Captured once, replayed with new starts and rows: no host decision inside the launcher."""
    seed = _fresh_seed()
    case = _gpu_case(seed, "csa-decode-64")
    ring = (case.rows_kv.clone(), case.rows_gate.clone())
    args = case.args(*ring)
    compressor_pool_triton(*args)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = compressor_pool_triton(*args)
    for step in range(3):
        ring[0].copy_(case.rows_kv)
        ring[1].copy_(case.rows_gate)
        case.starts.add_(step + 1)
        case.kv.normal_()
        graph.replay()
        want_ring = (case.rows_kv.clone(), case.rows_gate.clone())
        want = pool_windows(*case.args(*want_ring))
        why = f"seed={seed} replay {step}"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), why
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5, msg=lambda m: f"{why}\n{m}")
        for a, b in zip(ring, want_ring):
            assert torch.equal(a[:-1], b[:-1]), why


# --- offline compile for the H200 --------------------------------------------------------------

# The model's compressors (dim, ratio, overlap, gated): V4's CSA (width 1024), its indexer and
# HCA; V4.1's ratio 2 and ratio 1 (no gate).
SM90_CASES = {
    "csa": (512, 4, True, True),
    "csa-index": (128, 4, True, True),
    "hca": (512, 128, False, True),
    "v41-ratio2": (512, 2, False, True),
    "v41-ratio1": (512, 1, False, False),
}


def _compile_for_sm90(out_dir: str) -> None:
    """PTX of both launches for sm_90 at every SM90_CASES size, into ``out_dir``. Runs in a child
    process without the interpreter: under it Triton's own library functions (tl.sum, tl.max)
    are interpreted ones, which its compiler cannot inline. The signatures are what a launch
    specialises on: contiguous fp32 rows (unit channel strides become constants; the others,
    multiples of 16, aligned), a bf16 norm weight, 16-byte aligned pointers."""
    pointers = {
        "slots_ptr": "*i64",
        "starts_ptr": "*i64",
        "lens_ptr": "*i64",
        "norm_ptr": "*bf16",
        "w_ptr": "*i64",
        "done_ptr": "*u8",
        "eps": "fp32",
    }

    def ptx(fn: triton.runtime.jit.JITFunction, constants: dict, num_warps: int) -> str:
        return compile_sm90(fn, pointers, constants, lambda a: a.startswith("s_"), num_warps=num_warps).asm["ptx"]

    for name, (dim, ratio, overlap, gated) in SM90_CASES.items():
        halves = 2 if overlap else 1
        cfg = pool_config(dim, ratio * halves)
        warps = cfg.pop("num_warps")
        unit = dict.fromkeys(("s_kd", "s_gd", "s_rd", "s_qd"), 1)
        consts = {
            "DIM": dim,
            "RATIO": ratio,
            "HALVES": halves,
            "SPAN": ratio * halves,
            "RING": ratio * halves + 5,  # a speculating engine's spare rows: the modulus alone
            "HAS_GATE": gated,
            **unit,
            **cfg,
        }
        Path(out_dir, f"{name}-pool.ptx").write_text(ptx(_compressor_pool_kernel, consts, warps))
        cfg = norm_config(dim)
        warps = cfg.pop("num_warps")
        Path(out_dir, f"{name}-norm.ptx").write_text(
            ptx(_compressor_norm_kernel, {"DIM": dim, "RATIO": ratio, **cfg}, warps)
        )


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_compressor", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kernel", ["pool", "norm"])
@pytest.mark.parametrize("name", list(SM90_CASES))
def test_compiles_for_sm90_without_spills(name: str, kernel: str, sm90_ptx: Path) -> None:
    """ptxas reports registers and spills of the PTX; 128 registers leave room for two programs
    of 8 warps per SM."""
    ptx = (sm90_ptx / f"{name}-{kernel}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 128, log
    if kernel == "pool":
        assert "ld.global.v4" in ptx, "rows load in 16-byte vectors"
        assert "bar.sync" in ptx, "the ring write waits for the ring reads of the program"
