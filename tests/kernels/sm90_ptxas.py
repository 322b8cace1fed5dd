"""The offline half of the kernel tests' H200 checks: ptxas (Triton's bundled copy, or
TRITON_PTXAS_PATH) assembles PTX compiled for sm_90 and reports registers and spills, with no
GPU present."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def compile_in_subprocess(module: str, out: Path) -> Path:
    """Run ``module._compile_for_sm90(out)`` (a test module beside this file) in a fresh
    interpreter without ``TRITON_INTERPRET``: in this process Triton's JIT was replaced by the
    interpreter at import, and only the real one compiles to PTX. Returns ``out``."""
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here), env.get("PYTHONPATH", "")])
    code = f"from {module} import _compile_for_sm90; _compile_for_sm90({str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out
