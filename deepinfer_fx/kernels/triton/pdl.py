"""Programmatic dependent launch (PDL) of our Triton kernels on sm_90 and later GPUs.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
running: its launch and the ramp-up of its programs overlap the other's tail. It must not touch
memory before ``griddepcontrol.wait`` returns, which waits until the previous grid has completed
and its writes are visible. Every kernel here therefore waits first, and only then lets the
next kernel launch, so whenever one of our kernels lets its successor start, every kernel
before it on the stream has completed. That holds by induction only if every PDL-launched
kernel waits before it exits: a PDL kernel that never waits may finish while its predecessor
still runs, and the kernel after it then waits on the wrong grid (NVIDIA/cccl#9134). Inductor's
own PDL codegen (``triton.enable_pdl``) waits only when a kernel reads or overwrites what the
scheduler's previous node wrote, so its other kernels load before waiting or never wait;
``passes/inductor_pdl.py`` patches it to wait before the first access, as ours do. Kernels launched
without PDL (Inductor's, cuBLAS, NCCL) start only after everything before them has completed.

Short kernels release the next one at once (``wait_previous``). Weight-streaming kernels (the
skinny GEMV, the expert GEMMs) release it after their main loop (``wait_only`` ...
``release_next``): released at once, a chain of skinny GEMVs ran at 13.7 us a launch against
11.0 without PDL, the next grid's waiting programs taking the SM slots as the running one's
finished. Weights are never written during a step, so the skinny GEMV asks for its first k
tiles of weight into L2 before its wait (``prefetch_l2``).

Measured on an H200 in CUDA graphs (``python -m deepinfer_fx.bench.pdl_chain``, us a launch,
plain / PDL / PDL + prefetch): one-row RMSNorms 1.38 / 1.15; 32 MiB skinny GEMVs 11.14 / 11.58
/ 11.29 (alone, PDL still costs them a little); a norm feeding a GEMV 6.58 / 5.88 / 5.84.

A whole P8 decode step gained nothing from our kernels alone (session 9: b1 2.253 / 2.238 ms,
b8 4.843 / 5.111 ms), but with Inductor's kernels PDL-launched too (patched) it went from 2.220
to 2.139 ms at b1 and 4.829 to 4.727 ms at b8 (``bench/results/pdl_ab_s10.json``), so
``DEEPINFER_PDL`` is on by default. Under ``TRITON_INTERPRET`` and on CPU tensors it is always
off: the interpreter cannot run the inline assembly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..launch_options import derived_cache, pdl_wanted

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ON: dict[int, bool] = derived_cache()


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """The first statement of a short kernel: with PDL, wait for the previous grid's results,
    then let the next grid launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_only(PDL: tl.constexpr):
    """The first statement of a weight-streaming kernel (its ``release_next`` comes after the
    main loop): with PDL, wait for the previous grid's results."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """With PDL, let the next grid launch (after ``wait_only``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the cache lines at ``ptrs`` (valid addresses) to be brought into L2; no result."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


def pdl_enabled(device: torch.device) -> bool:
    """PDL for launches on ``device``: a CUDA device of compute capability 9 or later, not the
    interpreter, and PDL wanted (``launch_options.use_pdl``: the engine's ``DEEPINFER_PDL``)."""
    if device.type != "cuda" or _INTERPRET:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ON:
        _ON[index] = pdl_wanted() and torch.cuda.get_device_capability(index)[0] >= 9
    return _ON[index]


def pdl_args(device: torch.device) -> dict[str, bool]:
    """The two launch arguments every kernel takes: the ``PDL`` constexpr of its body and
    Triton's ``launch_pdl`` launch option, both on or both off."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}
