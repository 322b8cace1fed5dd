"""The ``compressor_kernel`` swap: ``deepinfer::compressor_pool`` equals the graphs function it
stands for (results and the ring it writes), passes ``opcheck`` with its declared mutation, and
a compiled compressor step with the swap in force equals the eager one: on CPU, where the op
runs its reference under functionalisation, and on CUDA with Inductor, where the Triton kernel
writes the ring in place."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.graphs.batch import Group
from deepinfer_fx.graphs.compressor import new_latents, pool_windows
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.kernels.triton import register_nvidia_kernels
from deepinfer_fx.passes.compiler import compile_graph, make_backend

pytestmark = pytest.mark.usefixtures("fresh_compile")

EPS = 1e-6
SWAP = "compressor_kernel"


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _pool_args(
    seed: int, ratio: int, overlap: bool, gated: bool, length: int, starts: list[int], lens: list[int]
) -> tuple:
    """Random rows and ring (stale rows included) for chunks on distinct slots of a 4-slot state."""
    g = torch.Generator().manual_seed(seed)
    dim, halves = 8, 2 if overlap else 1
    c = len(starts)
    kv = torch.randn(c, length, dim * halves, generator=g)
    gate = torch.randn(c, length, dim * halves, generator=g) * 2 if gated else None
    ring = (torch.randn(5, ratio * halves, dim * halves, generator=g) for _ in range(2))
    slots = torch.randperm(4, generator=g)[:c]
    return (
        kv,
        gate,
        *ring,
        slots,
        torch.tensor(starts),
        torch.tensor(lens),
        torch.randn(dim, generator=g),
        ratio,
        overlap,
        EPS,
    )


CASES = {  # ratio, overlap, gated, L, starts, lens
    "csa-decode": (4, True, True, 1, [0, 3, 6], [1, 1, 1]),
    "csa-prefill": (4, True, True, 9, [5, 0], [9, 6]),
    "hca-prefill": (8, False, True, 11, [3, 0], [11, 0]),
    "v41-ratio1": (1, False, False, 3, [2, 0], [3, 2]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_op_is_the_graphs_function(case: str) -> None:
    seed = _seed()
    args = _pool_args(seed, *CASES[case])
    mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    want = pool_windows(*args)
    got = torch.ops.deepinfer.compressor_pool(*mine)
    for a, b in zip((*want, args[2], args[3]), (*got, mine[2], mine[3])):
        assert torch.equal(a, b), f"seed={seed}"


@pytest.mark.parametrize("case", ["csa-prefill", "v41-ratio1"])
def test_opcheck(case: str) -> None:
    torch.library.opcheck(torch.ops.deepinfer.compressor_pool.default, _pool_args(_seed(), *CASES[case]))


def _params(g: torch.Generator, hidden: int, dim: int, ratio: int, overlap: bool, device: str) -> dict:
    width = dim * (2 if overlap else 1)
    p = {
        "wkv": torch.randn(width, hidden, generator=g) * hidden**-0.5,
        "wgate": torch.randn(width, hidden, generator=g) * hidden**-0.5,
        "ape": torch.randn(ratio, width, generator=g),
        "norm": 1 + 0.1 * torch.randn(dim, generator=g),
    }
    return {k: v.to(device) for k, v in p.items()}


def _step(
    p: dict,
    st: dict,
    x: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    ratio: int,
    overlap: bool,
):
    c, length = x.shape[:2]
    g = Group(torch.arange(length, device=x.device).expand(c, length), slots, starts, lens)
    return new_latents(p, st, x, g, ratio, overlap, EPS)


def _compiled_vs_eager(
    ratio: int, overlap: bool, enabled: bool, accelerator: str, inductor: bool, device: str, tol: float
) -> None:
    """A prefill chunk and then a decode step through the compiled compressor (the ring carries
    over between them) == the same calls eagerly, ring included; the pass counts one op per
    call when enabled and none when disabled (the reference is traced instead)."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    hidden, dim, slots = 16, 8, 3
    halves = 2 if overlap else 1
    p = _params(g, hidden, dim, ratio, overlap, device)
    st = {k: torch.zeros(slots + 1, ratio * halves, dim * halves, device=device) for k in ("rows_kv", "rows_gate")}
    eager_st = {k: v.clone() for k, v in st.items()}
    be = make_backend(accelerator, disabled=() if enabled else (SWAP,), environ={}, inductor=inductor)
    compiled = compile_graph(_step, be)
    steps = [  # (L, starts, lens) on slots 0..2; the second step continues the first (slot 2 starts then)
        (7, [0, 3, 5], [7, 6, 0]),
        (7, [7, 9, 0], [7, 2, 5]),
    ]
    with torch.no_grad():
        for length, starts, lens in steps:
            x = torch.randn(slots, length, hidden, generator=g).to(device)
            meta = tuple(torch.tensor(v, device=device) for v in (list(range(slots)), starts, lens))
            with swapped(be.pipeline.swaps()):
                got = compiled(p, st, x, *meta, ratio, overlap)
            want = _step(p, eager_st, x, *meta, ratio, overlap)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}")
    for k in st:
        torch.testing.assert_close(
            st[k][:slots], eager_st[k][:slots], rtol=0, atol=0, msg=lambda m: f"seed={seed} {k}: {m}"
        )
    assert len(be.graphs) == 1 and be.rewrites().get(SWAP, 0) == int(enabled), f"seed={seed}"
    assert (SWAP in be.pipeline.names) == enabled


@pytest.mark.parametrize("ratio,overlap", [(4, True), (2, False)])
@pytest.mark.parametrize("enabled", [True, False])
def test_compiled_swap_equals_eager(ratio: int, overlap: bool, enabled: bool) -> None:
    """CPU, aot_eager: the op runs its reference under functionalisation."""
    _compiled_vs_eager(ratio, overlap, enabled, "cpu", False, "cpu", 1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs for CUDA tensors")
@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_inductor_step_runs_the_kernel_on_cuda(ratio: int, overlap: bool) -> None:
    """CUDA, Inductor: the swapped op dispatches to the Triton kernel inside the compiled graph,
    writing the ring that is the graph's input."""
    assert register_nvidia_kernels()
    _compiled_vs_eager(ratio, overlap, True, "nvidia", True, "cuda", 1e-5)
