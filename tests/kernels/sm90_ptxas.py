"""The offline half of the kernel tests' H200 checks: ptxas (Triton's bundled copy, or
TRITON_PTXAS_PATH) assembles PTX compiled for sm_90 and reports registers and spills, with no
GPU present."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from triton import knobs


def _ptxas() -> str | None:
    try:
        return knobs.nvidia.ptxas.path
    except RuntimeError:  # neither runs here
        return None


PTXAS = _ptxas()


def ptxas_report(ptx: str) -> tuple[list[int], int, str]:
    """(spill store / load bytes, registers, ptxas's log) of one kernel's PTX for sm_90a."""
    assert PTXAS is not None, "ptxas is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", str(src), "-o", str(src.with_suffix(".cubin"))],
                             capture_output=True, text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    registers = int(re.search(r"Used (\d+) registers", log).group(1))  # type: ignore[union-attr]
    return spills, registers, log
