"""The skinny GEMM (``kernels/triton/linear.py::_skinny_kernel``) compiled offline for sm_90 (the
H200) at the model's sizes, wherever ptxas is: bf16 and fp32 results, split K, the tensor-descriptor
variant, block-FP8 weights in 16- and 64-row blocks. None may spill; the PTX must keep PDL's order
(prefetches, then the wait, then every load) and split K's barrier, atomic and L2 reads. The
kernel's numerics are tested in ``test_triton_linear.py``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import triton

from linear_helpers import GROUP_WEIGHTS, MODEL_WEIGHTS, split_bounds
from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.kernels.triton import linear
from deepinfer_fx.kernels.triton.linear import BM, Tiles, choose_tiles


# (weights' N, K, X_BLOCK_N): each P8 weight, each group, and wo_a as stacked diagonal blocks.
SM90_CASES = (
    [((n,), k, 0) for n, k in MODEL_WEIGHTS] + [(ns, k, 0) for ns, k in GROUP_WEIGHTS] + [((8192,), 4096, 1024)]
)


# Block-FP8 weights held as stored (``skinny_linear_fp8``): V4.1's wq_a, wq_b, wo_b (32-blocks)
# and V4's wq_b (128-blocks), and the grouped wo_a of both (``skinny_linear_blocks``), as
# (N, K, block, X_BLOCK_N).
SM90_FP8_CASES = [
    (1280, 5120, 32, 0),
    (32768, 1280, 32, 0),
    (5120, 8192, 32, 0),
    (32768, 1024, 128, 0),
    (16384, 4096, 32, 1024),
    (8192, 4096, 128, 1024),
]


# fp8 groups (``skinny_linear_fp8_group``): wq_a + wkv of V4.1 (32-blocks) and V4 (128-blocks),
# as (weights' N, K, block).
SM90_FP8_GROUPS = [((1280, 512), 5120, 32), ((1024, 512), 4096, 128)]


def _case_name(ns: tuple[int, ...], k: int, x_block_n: int) -> str:
    return f"{'+'.join(map(str, ns))}x{k}" + (f"-blocks{x_block_n}" if x_block_n else "")


def _consts(ns: tuple[int, ...], k: int, t: Tiles, x_block_n: int, line: int) -> dict:
    """The constants a launch over weights ``ns`` x ``k`` with tiles ``t`` specialises on
    (``line``: elements of a 128-byte cache line of the weight)."""
    bounds = split_bounds(k, t)
    tile0 = [0]
    for n in ns:
        tile0.append(tile0[-1] + -(-n // t.bn))
    consts = {
        "stride_xk": 1,
        "stride_wk": 1,
        "K": k,
        "K_SPLIT": bounds[1],
        "SPLITS": len(bounds) - 1,
        "BM": t.bm,
        "BN": t.bn,
        "BK": t.bk,
        "EVEN": all(n % t.bn == 0 for n in ns),
        "PREC": "tf32",
        "NS": ns,
        "TILE0": tuple(tile0[:-1]),
        "COL0": tuple(sum(ns[:g]) for g in range(len(ns))),
        "N_ALL": sum(ns),
        "X_BLOCK_N": x_block_n,
        "PREFETCH_LINES": triton.next_power_of_2(-(-min(t.prefetch * t.bk, bounds[1]) // line)),
        "LINE": line,
        "PDL": True,
    }
    if len(bounds) == 2:
        consts |= {"ws_ptr": None, "count_ptr": None}
    return consts


def _compile_for_sm90(out_dir: str) -> None:
    """PTX for sm_90 of the kernel at every MODEL_WEIGHTS size, bf16 and fp32 results, into
    ``out_dir``. Runs in a child process without the interpreter, under which Triton's compiler
    cannot build IR. The signature is what a launch specialises on: contiguous bf16 operands
    (unit k strides become constants; N and the row strides, multiples of 16, aligned), 16-byte
    aligned pointers, M and the workspace's split stride left unspecialised."""
    fn = linear._skinny_kernel
    for ns, k, x_block_n in SM90_CASES:
        t = choose_tiles(sum(ns), k)
        consts = _consts(ns, k, t, x_block_n, 64)
        consts |= {"stride_sn": 0, "stride_sk": 0, "SB": 0}
        for out in ("bf16", "fp32"):
            pointers = {
                "x_ptr": "*bf16",
                "w_ptrs": ("*bf16",) * len(ns),
                "out_ptrs": (f"*{out}",) * len(ns),
                "ws_ptr": "*fp32",
                "count_ptr": "*i32",
                "scale_ptrs": ("*bf16",) * len(ns),  # the launcher's stand-in: unscaled, never read
            }
            kernel = compile_sm90(
                fn,
                pointers,
                consts | {"w_desc": None},
                ["stride_xm", "stride_wn"],
                num_warps=t.warps,
                num_stages=t.stages,
            )
            Path(out_dir, f"{_case_name(ns, k, x_block_n)}-{out}.ptx").write_text(kernel.asm["ptx"])
            if len(ns) == 1:  # the tensor-descriptor variant (``Tiles.tma``)
                desc = {"w_desc": f"tensordesc<bf16[{t.bn}, {t.bk}]>"}
                kernel = compile_sm90(
                    fn, pointers | desc, consts, ["stride_xm", "stride_wn"], num_warps=t.warps, num_stages=t.stages
                )
                Path(out_dir, f"{_case_name(ns, k, x_block_n)}-{out}-tma.ptx").write_text(kernel.asm["ptx"])
    fp8_cases = [((n,), k, block, x_block_n) for n, k, block, x_block_n in SM90_FP8_CASES]
    cases = fp8_cases + [(ns, k, block, 0) for ns, k, block in SM90_FP8_GROUPS]
    for (ns, k, block, x_block_n), bm in itertools.product(cases, (BM, linear.FP8_BM)):
        t = choose_tiles(sum(ns), k, max_bk=min(128, block), bm=bm)
        consts = _consts(ns, k, t, x_block_n, 128) | {"stride_sk": 1, "SB": block}
        pointers = {
            "x_ptr": "*bf16",
            "w_ptrs": ("*fp8e4nv",) * len(ns),
            "out_ptrs": ("*bf16",) * len(ns),
            "ws_ptr": "*fp32",
            "count_ptr": "*i32",
            "scale_ptrs": ("*fp32",) * len(ns),
        }
        # pointer loads, then tensor copies (single weights only)
        for desc in (None, f"tensordesc<fp8e4nv[{t.bn}, {t.bk}]>") if len(ns) == 1 else (None,):
            kernel = compile_sm90(
                fn,
                pointers | ({"w_desc": desc} if desc else {}),
                consts | ({} if desc else {"w_desc": None}),
                ["stride_xm", "stride_wn", "stride_sn"],
                num_warps=t.warps,
                num_stages=t.stages,
            )
            name = f"fp8-{_case_name(ns, k, x_block_n)}-b{block}-m{bm}" + ("-tma" if desc else "")
            Path(out_dir, f"{name}.ptx").write_text(kernel.asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_linear_sm90", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("out", ["bf16", "fp32"])
@pytest.mark.parametrize("ns,k,x_block_n", SM90_CASES, ids=str)
def test_compiles_for_sm90_without_spills(
    ns: tuple[int, ...], k: int, x_block_n: int, out: str, sm90_ptx: Path
) -> None:
    """No spills, and at most 128 registers (four warps: several programs per SM). With split K:
    one gpu-scope acq_rel atomic, issued after a barrier that follows every partial store, and
    the partials read back through L2 (``ld.global.cg``); with one split, neither. With PDL: L2
    prefetches of weight, then the wait, and only then any load; the release after the wait."""
    ptx = (sm90_ptx / f"{_case_name(ns, k, x_block_n)}-{out}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 128, log
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
    prefetches = [i for i, line in enumerate(lines) if line.startswith("prefetch.global.L2")]
    assert prefetches and max(prefetches) < wait, "weights are prefetched before the wait"
    assert not any(("ld.global" in line or "cp.async" in line) for line in lines[:wait]), "a load before the wait"
    assert any(line.startswith("griddepcontrol.launch_dependents;") for line in lines[wait:])
    atoms = [i for i, line in enumerate(lines) if "atom." in line]
    if choose_tiles(sum(ns), k).split == 1:
        assert not atoms and not any("ld.global.cg" in line for line in lines)
        return
    assert len(atoms) == 1 and "atom.global.gpu.acq_rel.add" in lines[atoms[0]], (
        lines[atoms[0]] if atoms else "no atomic"
    )
    last_store = max(i for i in range(atoms[0]) if "st.global" in lines[i])
    assert any(line.startswith("bar.sync") for line in lines[last_store : atoms[0]]), (
        "no barrier between the partial stores and the atomic"
    )
    assert any("ld.global.cg" in line for line in lines[atoms[0] :]), "partials must be read through L2"


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("bm", [BM, linear.FP8_BM])
@pytest.mark.parametrize(
    "ns,k,block,x_block_n,tma",
    [((n,), k, b, x, tma) for n, k, b, x in SM90_FP8_CASES for tma in (False, True)]
    + [(ns, k, b, 0, False) for ns, k, b in SM90_FP8_GROUPS],
    ids=str,
)
def test_fp8_variant_compiles_for_sm90_without_spills(
    ns: tuple[int, ...], k: int, block: int, x_block_n: int, tma: bool, bm: int, sm90_ptx: Path
) -> None:
    """The block-FP8 variant (tiles dequantised in registers), one weight through pointer loads or
    tensor copies, or a group (each weight its own scales), in 16- and 64-row blocks: no spills,
    at most 128 registers (64-row blocks: 192, a 64 x 128 fp32 accumulator is 64 of them), the
    PDL wait before any load."""
    name = f"fp8-{_case_name(ns, k, x_block_n)}-b{block}-m{bm}" + ("-tma.ptx" if tma else ".ptx")
    spills, registers, log = ptxas_report((sm90_ptx / name).read_text())
    assert spills == [0, 0] and registers <= (128 if bm == BM else 192), log
    lines = [line.strip() for line in (sm90_ptx / name).read_text().splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
    assert not any(("ld.global" in line or "cp.async" in line) for line in lines[:wait]), "a load before the wait"
    assert any("cvt" in line and "e4m3" in line for line in lines), "fp8 values converted in registers"


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("out", ["bf16", "fp32"])
@pytest.mark.parametrize("ns,k,x_block_n", [c for c in SM90_CASES if len(c[0]) == 1], ids=str)
def test_tma_variant_compiles_for_sm90_without_spills(
    ns: tuple[int, ...], k: int, x_block_n: int, out: str, sm90_ptx: Path
) -> None:
    """The tensor-descriptor variant: no spills, at most 128 registers, its weight tiles come as
    bulk tensor copies, and none is issued before the PDL wait."""
    ptx = (sm90_ptx / f"{_case_name(ns, k, x_block_n)}-{out}-tma.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 128, log
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
    copies = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor" in line]
    assert copies and min(copies) > wait, "tensor copies, all after the wait"
