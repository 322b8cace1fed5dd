"""The two mHC launches (``kernels/triton/mhc.py``) compiled offline for the H200 (sm_90, the
model's width) wherever ptxas is: no spills, PDL's wait before any load, the dtypes' dot paths,
16-byte stream vectors, and at most 80 registers for the finish kernel's prefill variant. The
numerical tests are in ``test_triton_mhc.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import triton

from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.kernels.triton.mhc import _mhc_dots_kernel, _mhc_finish_kernel, launch_config

ITERS = 20


def _compile_for_sm90(out_dir: str) -> None:
    """PTX of both launches for sm_90 at the model's width (N = 4, D = 4096, bf16 streams, fp32
    weights; with and without pre_in, and the finish kernel's head variant, whose unread
    coefficient pointers are None as the launcher passes them), into ``out_dir``. Runs in a child process without the
    interpreter: under it Triton's library functions (tl.sum, tl.sigmoid) and the shared
    Sinkhorn helper are interpreted ones, which its compiler cannot inline. Pointers and row
    strides are 16-byte aligned, as at a real launch."""
    types = {"x_ptr": "*bf16", "u_ptr": "*bf16", "rms_eps": "fp32", "hc_eps": "fp32"}

    def ptx(fn: triton.runtime.jit.JITFunction, constants: dict, num_warps: int) -> str:
        return compile_sm90(fn, types, constants, ["stride_xt"], num_warps=num_warps).asm["ptx"]

    n, d = 4, 4096
    for bf16, unroll in ((False, False), (True, False), (True, True)):
        dots = dict(launch_config(n, d, bf16)["dots"], DOT_FP32=False, UNROLL=unroll)
        warps = dots.pop("num_warps")
        types["x_ptr"] = "*bf16" if bf16 else "*fp32"
        Path(out_dir, f"dots-{'bf16' if bf16 else 'fp32'}{'-unrolled' if unroll else ''}.ptx").write_text(
            ptx(
                _mhc_dots_kernel,
                {"K": n * d, "M": 2 * n + n * n, "PDL": True, "FN_LINES": dots["CHUNK"] // 32, "LINE": 32, **dots},
                warps,
            )
        )
    types["x_ptr"] = "*bf16"
    finish = dict(launch_config(n, d)["finish"])
    warps = finish.pop("num_warps")
    for has_pre in (False, True):
        for first in (True, False):
            consts = {
                "N": n,
                "D": d,
                "ITERS": ITERS,
                "HAS_PRE_IN": has_pre,
                "HEAD": False,
                "PDL": True,
                "LOADS_FIRST": first,
                **finish,
            }
            Path(out_dir, f"finish-{has_pre}{'' if first else '-prefill'}.ptx").write_text(
                ptx(_mhc_finish_kernel, consts, warps)
            )
    head = dict(launch_config(n, d, True, head=True)["finish"])
    assert head.pop("num_warps") == warps
    unread = dict.fromkeys(("pre_in_ptr", "pre_ptr", "post_ptr", "comb_ptr"))
    consts = {
        "N": n,
        "D": d,
        "ITERS": 1,
        "HAS_PRE_IN": False,
        "HEAD": True,
        "PDL": True,
        "LOADS_FIRST": True,
        **unread,
        **head,
    }
    Path(out_dir, "finish-head.ptx").write_text(ptx(_mhc_finish_kernel, consts, warps))


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_mhc_sm90", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize(
    "kernel",
    [
        "dots-fp32",
        "dots-bf16",
        "dots-bf16-unrolled",
        "finish-False",
        "finish-True",
        "finish-False-prefill",
        "finish-True-prefill",
        "finish-head",
    ],
)
def test_compiles_for_sm90_without_spills(kernel: str, sm90_ptx: Path) -> None:
    """No spills, PDL's wait and trigger before any load, and never tf32: fp32 streams' dot is plain fp32 FMAs; bf16
    streams' dots are bf16 tensor-core MMAs; the collapse loads the streams in 16-byte vectors. The head's finish
    stores only its collapse: no Sinkhorn, none of the site's coefficient stores."""
    ptx = (sm90_ptx / f"{kernel}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    # The unrolled dots hold a whole chunk of x and fn; they run at decode (<= 256 tokens: at most
    # 4 x 64 programs, one wave), where no SM holds more than a few programs.
    assert spills == [0, 0] and registers <= (168 if kernel.endswith("unrolled") else 128), log
    if kernel.endswith("prefill"):  # thousands of one-warp programs queue at prefill: keep an SM's share of them
        assert registers <= 80, log
    assert "tf32" not in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, "PDL (kernels/triton/pdl.py)"
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
    assert not any(("ld.global" in line or "cp.async" in line) for line in lines[:wait]), "a load before the wait"
    if kernel.startswith("dots"):  # fn is asked of L2 before the wait
        prefetches = [i for i, line in enumerate(lines) if line.startswith("prefetch.global.L2")]
        assert prefetches and max(prefetches) < wait, "fn is prefetched before the wait"
    if kernel == "dots-fp32":
        assert "fma.rn.f32" in ptx and "mma" not in ptx
    elif kernel.startswith("dots-bf16"):
        assert "mma" in ptx and "bf16" in ptx
    else:
        assert "ld.global.v4" in ptx
    stores = [line for line in lines if "st.global" in line]
    if kernel.startswith("finish"):  # the collapse in 16-byte vectors; only a site's finish stores its coefficients
        assert any("st.global.v4" in line for line in stores), stores
        assert all("st.global.v4" in line for line in stores) == (kernel == "finish-head"), stores
