import os
import sys
from pathlib import Path

# Triton's interpreter (below) runs tl.dot as a numpy matmul. OpenBLAS's Haswell and Zen kernels
# round a row differently at a different row count: on an AMD EPYC whose environment set
# OPENBLAS_CORETYPE=Haswell, 6 of the kernels' 8 batch-invariance tests failed for the BLAS's sake,
# and all 8 pass with its SkylakeX kernels. So those, wherever the CPU has AVX-512, before numpy loads.
if " avx512f" in Path("/proc/cpuinfo").read_text(errors="ignore"):
    os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"

import torch  # noqa: E402

# Shared test helpers (tiny configs, the HF oracle) live in tests/models.
sys.path.insert(0, str(Path(__file__).parent / "models"))

# Without a GPU, Triton kernel tests run under Triton's interpreter. It must be chosen before
# anything imports Triton (torch.compile does, in other tests of the same worker): Triton's own
# library functions are decorated at import, and compiled ones cannot run inside the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _refuse_unknown_launch_keywords() -> None:
    """Triton's interpreter drops launch keywords that are neither a kernel parameter nor a
    compile option; the GPU launcher raises on them (an H200 run once failed on a constexpr
    passed to a kernel that did not declare it, after every interpreter test had passed). Refuse
    them here by the launcher's own rule."""
    from dataclasses import fields

    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.runtime.interpreter import InterpretedFunction

    options = {f.name for f in fields(CUDAOptions)}
    run = InterpretedFunction.run

    def checked(self, *args, grid, warmup, **kwargs):
        unknown = sorted(set(kwargs) - set(self.arg_names) - options)
        if unknown:
            raise KeyError(
                f"{self.fn.__name__}: launch keyword(s) {unknown} are neither its parameters nor launch options"
            )
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = checked


if os.environ.get("TRITON_INTERPRET") == "1":
    _refuse_unknown_launch_keywords()
