"""The offline half of the kernel tests' H200 checks: ptxas (Triton's bundled copy, or
TRITON_PTXAS_PATH) assembles PTX compiled for sm_90 and reports registers and spills, with no
GPU present."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triton import knobs

if TYPE_CHECKING:
    from triton.compiler import CompiledKernel


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


ArgType = str | tuple[str, ...]  # an argument's Triton type: a tuple of them for a tuple argument


def compile_sm90(fn: Any, types: Mapping[str, ArgType], constants: dict[str, Any],
                 aligned: Iterable[str] | Callable[[str], bool] = (), *, align_pointers: bool = True,
                 **options: Any) -> CompiledKernel:
    """Compile the JIT kernel ``fn`` for sm_90 as a launch would specialise it; returns Triton's
    compiled kernel (``.asm["ptx"]``, ``.metadata.shared``). Only in a process without
    ``TRITON_INTERPRET`` (see ``compile_in_subprocess``), hence the imports in here.

    Each argument of ``fn`` is a constexpr if it is in ``constants``, else of its type in
    ``types`` (a tuple of types for a tuple argument), else ``*fp32`` if it is named ``*_ptr``
    and ``i32`` otherwise. Divisible by 16 are the pointers (each element of a tuple of them)
    unless ``align_pointers`` is false, and the other non-constexpr arguments that ``aligned``
    names or accepts. ``options`` are the compile options (num_warps, num_stages, ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    is_aligned = aligned if callable(aligned) else frozenset(aligned).__contains__
    signature: dict[str, ArgType] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        ty = signature[name] = types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
        if isinstance(ty, tuple):
            divisible = [(i, j) for j, t in enumerate(ty) if align_pointers and t.startswith("*")]
        else:
            divisible = [(i,)] if (align_pointers and ty.startswith("*")) or is_aligned(name) else []
        attrs |= {path: [["tt.divisibility", 16]] for path in divisible}
    src = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
