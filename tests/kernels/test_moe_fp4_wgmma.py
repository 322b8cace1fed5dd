"""The Gluon MXFP4 expert GEMMs (``kernels/triton/moe_fp4_wgmma.py``) without a GPU: their decode
PTX (``moe_fp4_decode.py``), run instruction by instruction on every code and scale byte, gives ``dequant_mxfp4``'s
values in the pairing the kernels' k order assumes; both kernels compile for sm_90 at every
released width without spilling, and asking for them where they do not apply is refused. Their numerics
against the Triton path are the GPU tests of ``test_triton_moe_fp4.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sm90_ptxas import PTXAS, compile_in_subprocess

from deepinfer_fx.io.quant import dequant_mxfp4
from deepinfer_fx.kernels.triton import moe_fp4_wgmma as wg
from deepinfer_fx.kernels.triton.moe_fp4_decode import _decode_asm

_MASK = 0xFFFFFFFF


def _run_ptx(asm: str, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """Execute the decode's PTX (shf.{l,r}.wrap, and, lop3, mul.rn.bf16x2) on int64 tensors holding
    32-bit words; ``operands`` are $4.. (inputs), the result $0..$3."""
    regs: dict[str, torch.Tensor] = {f"${4 + i}": v & _MASK for i, v in enumerate(operands)}

    def val(tok: str) -> torch.Tensor:
        tok = tok.strip()
        if tok.startswith(("0x", "-")) or tok.isdigit():
            return torch.tensor(int(tok, 0) & _MASK, dtype=torch.int64)
        return regs[tok]

    def bf16x2_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        def half(v: torch.Tensor, shift: int) -> torch.Tensor:
            bits = ((v >> shift) & 0xFFFF).to(torch.int32).to(torch.int16)
            return bits.view(torch.bfloat16).float()

        out = 0
        for shift in (0, 16):
            p = (half(a, shift) * half(b, shift)).to(torch.bfloat16)  # exact here: a power of two times a code
            out = out | ((p.view(torch.int16).to(torch.int64) & 0xFFFF) << shift)
        return out

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [s.strip() for s in rest.split(",")]
        if op in ("shf.l.wrap.b32", "shf.r.wrap.b32"):
            a, b, n = val(src[0]), val(src[1]), int(src[2])
            assert torch.equal(a, b), "the decode only rotates"
            n = n if op.startswith("shf.l") else 32 - n
            regs[dst] = ((a << n) | (a >> (32 - n))) & _MASK
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = val(src[0]), val(src[1]), val(src[2]), int(src[3], 0)
            out = torch.zeros_like(a)
            for bit in range(8):  # the LUT's entry for each (a, b, c) bit triple
                if lut >> bit & 1:
                    fa, fb, fc = bit >> 2 & 1, bit >> 1 & 1, bit & 1
                    out = out | ((a if fa else ~a) & (b if fb else ~b) & (c if fc else ~c))
            regs[dst] = out & _MASK
        elif op == "mul.rn.bf16x2":
            regs[dst] = bf16x2_mul(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
    return [regs[f"${n}"] for n in range(4)]


def _multipliers(e: torch.Tensor, big: bool) -> list[torch.Tensor]:
    """The kernel's bf16x2 multiplier words for scale bytes ``e`` (``_decode_tile``)."""
    if not big:
        return [(e + 126) * 0x00800080]
    m2 = torch.where(e == 255, torch.tensor(0x7FC07FC0), (torch.clamp(e, min=128) - 1) * 0x00800080)
    return [(torch.clamp(e, max=128) + 126) * 0x00800080, m2]


@pytest.mark.parametrize("big", [False, True])
def test_decode_ptx_gives_dequant_values_paired_k_and_k_plus_4(big: bool) -> None:
    """Every 8-code word (each nibble position takes all 16 codes) at every scale byte the form
    takes (<= 128 one multiply, all 256 with two): output n's low half is code n's value, its high
    half code n + 4's, each times 2^(e - 127) exactly, as ``dequant_mxfp4`` gives it (NaN for 255)."""
    gen = torch.Generator().manual_seed(torch.seed())
    nib = torch.arange(16)[:, None].expand(-1, 8)  # [16, 8]: every nibble takes code c
    nib = torch.cat([nib, torch.randint(16, (240, 8), generator=gen)])  # and random mixes
    scales = torch.arange(256 if big else 129)
    codes = nib[:, None, :].expand(-1, len(scales), -1)  # [W, S, 8]
    e = scales[None, :].expand(len(nib), -1)
    words = sum(codes[..., j].to(torch.int64) << (4 * j) for j in range(8))
    out = _run_ptx(_decode_asm(big), [words, *_multipliers(e, big)])
    got = torch.stack(
        [
            ((o >> s) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16).float()
            for o in out
            for s in (0, 16)
        ],
        -1,
    )  # [W, S, 8] in the order (n=0 lo, n=0 hi, n=1 lo, ...)
    order = [j for n in range(4) for j in (n, n + 4)]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # checkpoint bytes: even k low
    # one 32-k scale group a word: the word repeated four times
    want = dequant_mxfp4(packed.reshape(-1, 4).repeat(1, 4), e.reshape(-1, 1).to(torch.uint8), torch.float32)
    want = want[:, :8].reshape(len(nib), len(scales), 8)[..., order]
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), f"first mismatch at (word, scale, slot) {same.logical_not().nonzero()[0].tolist()}"


def test_wgmma_refuses_what_the_kernels_do_not_take() -> None:
    """``wgmma=True`` off an sm_90 GPU (here: the CPU), or on weights that are not MXFP4, is refused
    by name, not run as another path."""
    from deepinfer_fx.io.quant import quant_mxfp4
    from deepinfer_fx.kernels.triton.moe import moe_experts_fp4_triton, run_experts

    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w = {n: torch.randn(4, *shape) / 16 for n, shape in (("w1", (256, 256)), ("w3", (256, 256)), ("w2", (256, 256)))}
    q = [t.view(torch.uint8) for n in ("w1", "w3", "w2") for t in quant_mxfp4(w[n])]
    idx, rw = torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Gluon fp4 GEMMs take MXFP4 weights and bf16 rows on an sm_90 GPU"):
            moe_experts_fp4_triton(x, *q, idx, rw, 10.0, wgmma=True)
    with pytest.raises(ValueError, match="leave wgmma off"):
        run_experts(x, (w["w1"], w["w3"], w["w2"]), None, 0, idx, rw, 10.0, None, wgmma=True)
    assert not wg.fits(x, 256, 256)  # not on a GPU
    assert [wg.wgmma_rows(t * 6, 64) for t in (1, 64, 300, 512, 4096)] == [8, 16, 32, 64, 64]


def _compile_for_sm90(out_dir: str) -> None:
    """Both kernels at every released width (D, I) and block height, and loading two steps ahead
    at the decode heights, assembled by ptxas."""
    import json

    from sm90_ptxas import compile_sm90, ptxas_report

    rows = []
    for d, i in ((4096, 2048), (5120, 2304), (7168, 3072)):  # V4-Flash, V4.1-Flash, V4-Pro
        for tp, ahead in ((8, 1), (16, 1), (32, 1), (64, 1), (8, 2), (16, 2)):
            types = {"x_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "pairs_ptr": "*i32", "ends_ptr": "*i32"}
            types |= {n: "*u8" for n in ("w1_ptr", "w3_ptr", "w2_ptr", "s1_ptr", "s3_ptr", "s2_ptr")}
            types |= {"limit": "fp32", "stride_we": "i64", "stride_se": "i64"}
            consts = {"K": d, "TOPK": 6, "E_P": 512, "TP": tp, "CLAMP": True, "AHEAD": ahead}
            gate_up = compile_sm90(
                wg.fp4_gate_up_kernel,
                types,
                consts,
                ("N", "stride_x", "stride_we", "stride_wn", "stride_se"),
                num_warps=4,
            )
            down = compile_sm90(
                wg.fp4_down_kernel,
                types,
                {"K": i, "E_P": 512, "TP": tp, "AHEAD": ahead},
                ("N", "stride_we", "stride_wn"),
                num_warps=4,
            )
            for name, k in (("gate_up", gate_up), ("down", down)):
                spills, registers, _ = ptxas_report(k.asm["ptx"])
                ptx = k.asm["ptx"]
                rows.append(
                    {"kernel": name, "d": d, "i": i, "tp": tp, "ahead": ahead, "spills": spills, "registers": registers,
                     "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "decode_muls": ptx.count("mul.rn.bf16x2")}
                )  # fmt: skip
    Path(out_dir, "wgmma.json").write_text(json.dumps(rows))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
def test_kernels_compile_for_sm90_at_every_released_width(tmp_path: Path) -> None:
    import json

    compile_in_subprocess("test_moe_fp4_wgmma", tmp_path)
    rows = json.loads((tmp_path / "wgmma.json").read_text())
    assert len(rows) == 36
    for r in rows:
        assert r["spills"] == [0, 0], r
        assert r["wgmma"] > 0 and r["decode_muls"] > 0, r  # the register-A wgmma and the PTX decode are there


def test_two_steps_ahead_only_in_small_launches(monkeypatch) -> None:
    """``FEW_AHEAD`` applies to launches of at most ``per_sm`` programs an SM (all of them stay
    resident with the second step's registers); larger launches load one step ahead, and with
    ``FEW_AHEAD`` 1 every launch does."""
    monkeypatch.setattr(wg, "_sms", lambda index: 132)
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(wg, "FEW_AHEAD", 2)
    assert [wg.steps_ahead(n, cuda0, 2) for n in (192, 264, 265, 2048)] == [2, 2, 1, 1]
    assert [wg.steps_ahead(n, cuda0, 4) for n in (384, 528, 529)] == [2, 2, 1]
    monkeypatch.setattr(wg, "FEW_AHEAD", 1)
    assert wg.steps_ahead(192, cuda0, 2) == 1
