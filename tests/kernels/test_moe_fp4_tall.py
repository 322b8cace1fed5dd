"""The 128-row MXFP4 prefill GEMMs (``kernels/triton/moe_fp4_tall.py``) without a GPU: the rows'
kappa layout, when the op takes them, and both kernels compiled for sm_90 at every released width
(no spills, the shared-memory ring within an SM's 227 KB, each step's two MMAs one commit group
apiece with the loop leaving exactly those in flight). Their bits against the 64-row kernels are
the GPU tests of ``test_triton_moe_fp4.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from sm90_ptxas import PTXAS, compile_in_subprocess

from deepinfer_fx.kernels.triton import moe_fp4_tall as tall
from deepinfer_fx.kernels.triton import moe_fp4_wgmma as wg

_WIDTHS = ((4096, 2048), (5120, 2304), (7168, 3072))  # V4-Flash, V4.1-Flash, V4-Pro (D, I)


def test_kappa_rows_put_each_k_where_the_kernels_sum_it() -> None:
    """Memory k = 32 g + 8 w + 4 h + n of each 128-k tile lands at kappa = 8 (4 w + n) + 2 g + h,
    the register-operand kernels' reduction order, in every row and tile."""
    rows, k = 3, 512
    x = torch.arange(rows * k, dtype=torch.float32).reshape(rows, k)
    got = tall.kappa_rows(x)
    for m in range(k):
        tile, j = divmod(m, 128)
        g, w, h, n = j // 32, j // 8 % 4, j // 4 % 2, j % 4
        assert torch.equal(got[:, tile * 128 + 8 * (4 * w + n) + 2 * g + h], x[:, m]), m


def test_gate_up_writes_h_where_the_down_rows_are_read() -> None:
    """The gate/up epilogue's column map (``_kappa_column``, its Python body run on a tensor) puts
    column c of h where ``kappa_rows`` would move it, so the down programs' TMA reads h as the
    gate/up input was read."""
    c = torch.arange(2304)  # V4.1's I: 18 tiles of 128
    x = torch.randn(2, 2304)
    assert torch.equal(tall.kappa_rows(x)[:, tall._kappa_column.fn(c)], x[:, c])


def test_tall_blocks_only_above_tall_from(monkeypatch) -> None:
    """128-row blocks are taken where an expert has more than ``TALL_FROM`` rows on average, and
    never while it is None."""
    assert wg.TALL_FROM is None or wg.TALL_FROM >= 64
    monkeypatch.setattr(wg, "TALL_FROM", None)
    assert wg.wgmma_rows(4096 * 6, 64) == 64
    monkeypatch.setattr(wg, "TALL_FROM", 96)
    assert [wg.wgmma_rows(t * 6, 64) for t in (1, 512, 1024, 1025, 4096)] == [8, 64, 64, 128, 128]


def _compile_for_sm90(out_dir: str) -> None:
    """Both kernels at every released width, assembled by ptxas."""
    from sm90_ptxas import compile_sm90, ptxas_report
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([tall.TALL, 64], gl.bfloat16)
    desc = f"tensordesc<bf16[{tall.TALL}, 64],{layout!r}>"
    types = {"x_desc": desc, "h_desc": desc, "h_ptr": "*bf16", "y_ptr": "*bf16", "pairs_ptr": "*i32"}
    types |= {"ends_ptr": "*i32", "limit": "fp32", "stride_we": "i64", "stride_se": "i64"}
    types |= {n: "*u8" for n in ("w1_ptr", "w3_ptr", "w2_ptr", "s1_ptr", "s3_ptr", "s2_ptr")}
    rows = []
    for d, i in _WIDTHS:
        gate_up = compile_sm90(
            tall.fp4_tall_gate_up_kernel,
            types,
            {"K": d, "E_P": 512, "CLAMP": True, "STAGES": tall.STAGES},
            ("N", "stride_we", "stride_wn", "stride_se"),
            num_warps=8,
        )
        down = compile_sm90(
            tall.fp4_tall_down_kernel,
            types,
            {"K": i, "E_P": 512, "STAGES": tall.STAGES},
            ("N", "stride_we", "stride_wn"),
            num_warps=8,
        )
        for name, k in (("gate_up", gate_up), ("down", down)):
            ptx = k.asm["ptx"]
            spills, registers, _ = ptxas_report(ptx)
            rows.append(
                {"kernel": name, "d": d, "spills": spills, "registers": registers, "smem": k.metadata.shared,
                 "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "commits": ptx.count("wgmma.commit_group"),
                 "waits": sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))),
                 "tma": ptx.count("cp.async.bulk.tensor"), "decode_muls": ptx.count("mul.rn.bf16x2")}
            )  # fmt: skip
    Path(out_dir, "tall.json").write_text(json.dumps(rows))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
def test_tall_kernels_compile_for_sm90_at_every_released_width(tmp_path: Path) -> None:
    compile_in_subprocess("test_moe_fp4_tall", tmp_path)
    rows = json.loads((tmp_path / "tall.json").read_text())
    assert len(rows) == 2 * len(_WIDTHS)
    for r in rows:
        assert r["spills"] == [0, 0], r
        assert r["smem"] <= 227 * 1024, r  # one program an SM, with the ring and the decoded tiles
        # two loop forms (one or two scale multiplies) x two 64-k halves x four 16-k MMAs
        assert r["wgmma"] == 16 and r["commits"] == 4, r
        assert r["waits"] == ["0", "2"], r  # a step leaves its own two groups in flight, then all retire
        assert r["tma"] > 0 and r["decode_muls"] > 0, r
