import os
import sys
from pathlib import Path

import torch

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
            raise KeyError(f"{self.fn.__name__}: launch keyword(s) {unknown} are neither its parameters nor launch options")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = checked


if os.environ.get("TRITON_INTERPRET") == "1":
    _refuse_unknown_launch_keywords()
