"""Triton kernels: the NVIDIA implementations of the ``deepinfer`` ops.

Each module registers its kernels for the ``cuda`` dispatch key of an op declared in
``kernels/ops.py`` (``torch.library.register_kernel``), so CPU tensors keep running the
references and CUDA tensors run Triton. ``register_nvidia_kernels`` imports every module once;
it is a no-op where Triton is not installed. Under ``TRITON_INTERPRET=1`` the launchers also run
on CPU tensors, which is how CI tests small cases on machines without a GPU.
"""

from __future__ import annotations

import importlib

# One module per op family; importing a module registers its kernels.
_MODULES: tuple[str, ...] = (
    "norm",
    "swiglu",
    "sinkhorn",
    "moe",
    "attention",
    "ring_attention",
    "compressor",
    "indexer",
    "linear",
    "rope",
    "rope_table",
    "mhc",
    "mhc_expand",
    "router",
    "batch_invariant",
    "bi_reduce",
    "bi_attention",
    "engram",
)

_registered = False


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def register_nvidia_kernels() -> bool:
    """Register every Triton kernel for CUDA tensors; False where Triton is missing."""
    global _registered
    if _registered:
        return True
    if not triton_available():
        return False
    for name in _MODULES:
        importlib.import_module(f"{__name__}.{name}")
    _registered = True
    return True
