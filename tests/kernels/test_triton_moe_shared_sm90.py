"""The offline sm_90 compile of the Triton routed-experts kernels (``kernels/triton/moe_kernels.py``)
with and without the shared expert folded in (``test_triton_moe_shared.py``), and of their MXFP4
variants, at the P8 benchmark's widths: no spills, tensor cores, PDL waits, and the shared memory
that ``moe_tiles.tile_smem`` assumes. Needs ptxas, no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.kernels.triton.moe_tiles import Tiles, tile_smem

# (bm, bn, bk, group_m, warps, stages, half) of choose_tiles' decode and prefill tiles at P8 widths
# (narrow: the T = 1 tiles at 4 stages, and at 3 as ``_one_wave`` picks them with the fold)
_P8_TILES = {
    "decode": ((16, 128, 128, 1, 4, 3, False), (16, 128, 128, 1, 4, 3, False)),
    "narrow4": ((16, 32, 128, 1, 4, 4, False), (16, 32, 128, 1, 4, 4, False)),
    "narrow3": ((16, 32, 128, 1, 4, 3, False), (16, 32, 128, 1, 4, 3, False)),
    "prefill": ((128, 128, 64, 16, 8, 3, True), (128, 256, 64, 8, 8, 4, True)),
}


def _compile_for_sm90(out_dir: str) -> None:
    """PTX for sm_90 of the gate/up and down kernels (bf16, D 4096, I 2048, 64 experts, k 6) and
    of the pair sort and the combine, with and without the shared expert, into ``out_dir`` (run in a child
    process without the interpreter, see ``sm90_ptxas.compile_in_subprocess``). Pointers,
    strides and widths carry the 16-divisibility a real launch at these sizes specialises on."""
    from deepinfer_fx.kernels.triton.moe_tiles import Tiles, fp4_tiles
    from deepinfer_fx.kernels.triton.moe_kernels import (
        combine_kernel,
        count_pairs_kernel,
        down_kernel,
        gate_up_kernel,
        place_pairs_kernel,
        sort_pairs_one_kernel,
    )

    def emit(kernel, name: str, types: dict, consts: dict, warps: int, stages: int) -> None:
        compiled = compile_sm90(
            kernel,
            types,
            consts,
            lambda a: a.startswith("stride") or a in ("N", "SPAN", "D"),
            num_warps=warps,
            num_stages=stages,
        )
        Path(out_dir, f"{name}.ptx").write_text(compiled.asm["ptx"])
        Path(out_dir, f"{name}.smem").write_text(str(compiled.metadata.shared))

    bf16 = dict.fromkeys(
        (
            "x_ptr",
            "w1_ptr",
            "w3_ptr",
            "sw1_ptr",
            "sw3_ptr",
            "s1_ptr",
            "s3_ptr",
            "h_ptr",
            "w2_ptr",
            "sw2_ptr",
            "s2_ptr",
            "y_ptr",
        ),
        "*bf16",
    )
    types = {
        **bf16,
        "pairs_ptr": "*i32",
        "rw_ptr": "*fp32",
        "ends_ptr": "*i32",
        "limit": "fp32",
        "idx_ptr": "*i64",
        "hist_ptr": "*i32",
        "cursor_ptr": "*i32",
    }
    common = {"E_P": 128, "FP8": False, "FP4": False, "QBLOCK": 1, "EVEN": True, "PREC": "tf32", "PDL": True}
    for shared in (False, True):
        for kind, (g, d) in _P8_TILES.items():
            emit(
                gate_up_kernel,
                f"gate_up-{kind}-{shared}",
                types,
                {
                    **common,
                    "K": 4096,
                    "TOPK": 6,
                    "SHARED": shared,
                    "BM": g[0],
                    "BN": g[1],
                    "BK": g[2],
                    "GROUP_M": g[3],
                    "CLAMP": True,
                    "HALF": g[6],
                },
                g[4],
                g[5],
            )
            emit(
                down_kernel,
                f"down-{kind}-{shared}",
                types,
                {
                    **common,
                    "K": 2048,
                    "SHARED": shared,
                    "BM": d[0],
                    "BN": d[1],
                    "BK": d[2],
                    "GROUP_M": d[3],
                    "HALF": d[6],
                },
                d[4],
                d[5],
            )
            if not shared:  # MXFP4 weights (uint8 codes and ue8m0 scales) at the tiles moe.py picks for them
                fp4 = {**types, **dict.fromkeys(("w1_ptr", "w3_ptr", "w2_ptr", "s1_ptr", "s3_ptr", "s2_ptr"), "*u8")}
                g4, d4 = fp4_tiles(Tiles(*g), Tiles(*d), 2048, 4096)
                for mode, tag in ((1, "fp4"), (2, "fp4bits")):  # Triton's microscaled dot; the PTX decode
                    emit(
                        gate_up_kernel,
                        f"{tag}-gate_up-{kind}",
                        fp4,
                        {
                            **common,
                            "FP4": mode,
                            "K": 4096,
                            "TOPK": 6,
                            "SHARED": False,
                            "BM": g4[0],
                            "BN": g4[1],
                            "BK": g4[2],
                            "GROUP_M": g4[3],
                            "CLAMP": True,
                            "HALF": g4[6],
                        },
                        g4[4],
                        g4[5],
                    )
                    emit(
                        down_kernel,
                        f"{tag}-down-{kind}",
                        fp4,
                        {
                            **common,
                            "FP4": mode,
                            "K": 2048,
                            "SHARED": False,
                            "BM": d4[0],
                            "BN": d4[1],
                            "BK": d4[2],
                            "GROUP_M": d4[3],
                            "HALF": d4[6],
                        },
                        d4[4],
                        d4[5],
                    )
        sort = {"TOPK": 6, "SHARED": shared, "E_P": 128, "CHUNK": 256, "PDL": True}
        emit(count_pairs_kernel, f"count-{shared}", types, sort, 4, 3)
        emit(
            place_pairs_kernel, f"place-{shared}", types, {**sort, "G_P": 64, "G_ROWS": 32}, 4, 3
        )  # moe.py's rule at E_P 128
        emit(sort_pairs_one_kernel, f"sort_one-{shared}", types, sort, 4, 3)
        # each token's k (+ the shared) bf16 expert rows summed into fp32, as moe.py launches it at D 4096
        emit(
            combine_kernel,
            f"combine-{shared}",
            {**types, "out_ptr": "*fp32"},
            {"TOPK": 6 + shared, "BD": 1024, "PDL": True},
            4,
            3,
        )


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kind", list(_P8_TILES))
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
@pytest.mark.parametrize("tag", ["fp4", "fp4bits"])
def test_fp4_kernels_compile_for_sm90_without_spills(tag: str, kernel: str, kind: str, sm90_ptx: Path) -> None:
    """The MXFP4 path decodes its weight tiles in registers: at the tiles moe.py picks for it
    (narrower than bf16's where those spilled) it compiles for the H200 with no spills, on
    tensor cores; so does the PTX decode (``Tiles.fp4_bits``), whose packed byte moves show."""
    ptx = (sm90_ptx / f"{tag}-{kernel}-{kind}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, log
    assert "mma" in ptx
    assert ("prmt.b32 t0" in ptx) == (tag == "fp4bits")


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_moe_shared_sm90", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize(
    "kernel",
    [
        "gate_up-decode",
        "down-decode",
        "gate_up-narrow4",
        "down-narrow4",
        "gate_up-narrow3",
        "down-narrow3",
        "gate_up-prefill",
        "down-prefill",
        "count",
        "place",
        "sort_one",
        "combine",
    ],
)
def test_kernels_compile_for_sm90_without_spills(kernel: str, shared: bool, sm90_ptx: Path) -> None:
    """Both variants compile for the H200 with no spills; the GEMMs on tensor cores. The shared
    variant selects a base pointer per block and should cost no more than a few registers."""
    ptx = (sm90_ptx / f"{kernel}-{shared}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, log
    if kernel.startswith(("gate_up", "down")):
        assert "mma" in ptx
        _, routed_registers, _ = ptxas_report((sm90_ptx / f"{kernel}-False.ptx").read_text())
        assert registers <= routed_registers + 16, (
            f"{kernel}: {registers} registers, {routed_registers} without the shared expert"
        )
    assert "griddepcontrol.wait" in ptx, "PDL (kernels/triton/pdl.py)"
    if kernel == "combine":  # reads only what the down GEMM wrote: nothing before the wait; rows in 16-byte vectors
        lines = [line.strip() for line in ptx.splitlines()]
        wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
        assert not any("ld.global" in line for line in lines[:wait]), "a load before the wait"
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kind", ["decode", "narrow4", "narrow3"])
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_decode_tiles_shared_memory_is_what_the_one_wave_rule_assumes(kernel: str, kind: str, sm90_ptx: Path) -> None:
    """``moe_tiles.tile_smem`` (which sizes the narrow tiles' pipeline so that a launch is one wave)
    against the compiler's figure for sm_90, bf16."""
    gated = kernel == "gate_up"
    tiles = Tiles(*_P8_TILES[kind][0 if gated else 1])
    for shared in (False, True):
        assert int((sm90_ptx / f"{kernel}-{kind}-{shared}.smem").read_text()) == tile_smem(tiles, gated), (
            kernel,
            kind,
            shared,
        )
