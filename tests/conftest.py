import os
import sys
from pathlib import Path

import torch

# Shared test helpers (tiny configs, the HF oracle) live in tests/models.
sys.path.insert(0, str(Path(__file__).parent / "models"))

# Under pytest-xdist the workers are as many processes as cores: a second intra-op thread a
# worker oversubscribes the machine, and OpenMP's spinning threads starve the other worker
# (2 cores: the soak test 11 s alone, 56 s beside a compile test, 10 s with one thread a worker;
# docs/decisions.md). Subprocesses (torchrun ranks, Inductor's compile workers) inherit the cap.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

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


def _row_independent_dots() -> None:
    """Triton's interpreter runs a block's ``tl.dot`` as one numpy matmul in the accumulator's
    dtype, and OpenBLAS sums a row in another order at another row count (its Haswell and Zen
    kernels, on an AMD EPYC without AVX-512: 6 of the kernels' 8 batch-invariance tests failed for
    the BLAS's sake). Products of fp32 or narrower operands are exact in float64, so a block's dot
    summed there and rounded once is the same for any row count, while the kernel's own
    accumulation over its K blocks (``+ acc``, in the accumulator's dtype) is still what it is."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        fp8 = any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b))
        if fp8 or d.data.dtype != np.float32 or max(a.data.itemsize, b.data.itemsize) > 4:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle(exact.astype(np.float32) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _refuse_unknown_launch_keywords()
    _row_independent_dots()
