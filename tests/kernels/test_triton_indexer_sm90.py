"""The indexer's scoring kernel (``kernels/triton/indexer.py::_scores_kernel``) compiled offline
for sm_90 (the H200) at the model's sizes, wherever ptxas is: bf16 keys, and a trained-format
state's MXFP4 key rows decoded in the kernel (by bytes and by int32 words), at V4's 64 and V4.1's
32 index heads, keys gathered per chunk or read from a pool by slot. None may spill; the dots must
stay on tensor cores and PDL's wait in place. The numerics are tested in ``test_triton_indexer.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.io.state_rows import RowCodec

INDEX_ROWS = RowCodec("mxfp4", 128, 32)  # the index keys' trained format (fp4 values, 32-blocks)

# The scoring kernel's sm_90 variants: name -> (index heads, keys packed as INDEX_ROWS, read by
# words). V4's indexer has 64 heads, V4.1's 32 (di 128 both).
SM90_VARIANTS = {
    "v4": (64, False, False),
    "v4-packed": (64, True, False),
    "v4-words": (64, True, True),
    "v41-words": (32, True, True),
}


def _compile_for_sm90(out_dir: str) -> None:
    """PTX of the scoring kernel for sm_90 at the model's sizes (di 128, bf16) of each of
    ``SM90_VARIANTS``, keys gathered per chunk and read from a pool by slot, into ``out_dir``
    (run in a child process without the interpreter, see ``sm90_ptxas.compile_in_subprocess``)."""
    from deepinfer_fx.kernels.triton.indexer import _BLOCK_M, _BLOCK_N, _NUM_WARPS, _scores_kernel
    from deepinfer_fx.kernels.triton.state_rows import format_args

    for name, (heads, packed, words) in SM90_VARIANTS.items():
        types = {
            "q_ptr": "*bf16",
            "k_ptr": "*u8" if packed else "*bf16",
            "slot_ptr": "*i64",
            "w_ptr": "*fp32",
            "v_ptr": "*u8",
            "out_ptr": "*fp32",
            "dot_scale": "fp32",
        }
        fmt, block, tail = format_args(INDEX_ROWS if packed else None)
        for has_slots in (False, True):
            consts = {
                "BLOCK_Q": _BLOCK_M // heads,
                "BLOCK_H": heads,
                "BLOCK_N": _BLOCK_N,
                "BLOCK_D": 128,
                "D": 128,
                "DOT_FP32": False,
                "HAS_SLOTS": has_slots,
                "KEY_FMT": fmt,
                "KEY_BLOCK": block,
                "KEY_TAIL": tail,
                "VALUE_BYTES": 2,
                "KEY_WORDS": words,
                "PDL": True,
            }
            if not has_slots:
                consts["slot_ptr"] = None
            kernel = compile_sm90(_scores_kernel, types, consts, align_pointers=False, num_warps=_NUM_WARPS)
            Path(out_dir, f"scores-{name}-{has_slots}.ptx").write_text(kernel.asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_indexer_sm90", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("variant", list(SM90_VARIANTS))
@pytest.mark.parametrize("has_slots", [False, True], ids=["gathered", "pool"])
def test_scores_compile_for_sm90(variant: str, has_slots: bool, sm90_ptx: Path) -> None:
    """Both key layouts, values or packed rows decoded in the kernel, compile for the H200 with
    tensor-core dots and no spills."""
    ptx = (sm90_ptx / f"scores-{variant}-{has_slots}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, log
    assert "mma" in ptx
    assert "griddepcontrol.wait" in ptx, "PDL (kernels/triton/pdl.py)"
