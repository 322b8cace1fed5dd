"""Inductor's programmatic dependent launch (PDL), made safe: every kernel waits first.

With ``triton.enable_pdl`` Inductor launches its Triton kernels with PDL and puts
``griddepcontrol.wait`` (``gdc_wait``) in them, but only before an access to a buffer that the
scheduler's previous node wrote (or, for a store, read) (``TritonKernel._handle_pdl_before_access``
in torch 2.11 and 2.13). A kernel that only reads older buffers loads them before its wait, and
one that only stores (a fill, an arange, an index built from shapes) never waits at all. The
first may read a buffer that a kernel two launches back is still writing, whenever the kernel in
between never waited; the second finishes while its predecessor still runs, so the kernel after
it waits on the wrong grid. Either reads stale data, and only sometimes (the PDL GPU tests of
session 8 saw it as bits that moved between replays).

The rule our own kernels follow (``kernels/triton/pdl.py``) restores the induction: every
PDL-launched kernel waits before its first access to global memory. Then a kernel that lets its
successor start has completed its wait, so every kernel before it has completed. Here that rule
replaces the dependency test of ``_handle_pdl_before_access``: the wait goes before the first
load or store whatever the previous node touched (hoisted before a reduction loop as Inductor
does; its ``_filter_pdl`` keeps only the first wait of a kernel). What PDL still buys: the next
kernel's launch, its programs' scheduling and the index math before its first access overlap
the tail of the kernel before it. Inductor's ``gdc_launch_dependents`` after the last load
stays as upstream emits it.

``install`` patches the class once per process; with ``triton.enable_pdl`` off the patched
method returns at once, as the original does. Compiled graphs cached by an unpatched Inductor
must not be reused, so ``PATCH_ID`` goes into our backend's cache key whenever it turns PDL on.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

PATCH_ID_PREFIX = "inductor-pdl-wait-first"
# The TritonKernel members the patched method relies on: present in torch 2.11 and 2.13.
_NEEDED = ("_handle_pdl_before_access", "_handle_pdl_after_load", "_filter_pdl", "_enable_pdl_codegen", "GDC_WAIT")


def _wait_before_first_access(self: Any, wait_buffer: Any, *dependencies: Any, consider_reads: bool = False) -> None:
    """``TritonKernel._handle_pdl_before_access`` with the wait unconditional (see the module
    docstring): emitted before every access, deduplicated to the first by ``_filter_pdl``."""
    if not self._enable_pdl_codegen():
        return
    if self.inside_reduction and self.range_trees[-1].is_loop:
        wait_buffer = self.body  # before the loop, not once an iteration
    wait_buffer.writeline(self.GDC_WAIT)


_wait_before_first_access.deepinfer_patch = True  # type: ignore[attr-defined]

PATCH_ID = f"{PATCH_ID_PREFIX}-{hashlib.sha256(inspect.getsource(_wait_before_first_access).encode()).hexdigest()[:16]}"


def supported() -> str | None:
    """None when this torch's Inductor can be patched, else why not (for the error message)."""
    try:
        from torch._inductor.codegen.triton import TritonKernel
    except ImportError as e:  # pragma: no cover - Inductor ships with every supported torch
        return f"torch._inductor.codegen.triton cannot be imported ({e})"
    missing = [name for name in _NEEDED if not hasattr(TritonKernel, name)]
    if missing:
        return f"this torch's Inductor TritonKernel lacks {missing}"
    params = list(inspect.signature(TritonKernel._handle_pdl_before_access).parameters)
    if params[:2] != ["self", "wait_buffer"] or "consider_reads" not in params:
        return f"this torch's TritonKernel._handle_pdl_before_access takes {params}, not (self, wait_buffer, *deps, consider_reads)"
    return None


_UPSTREAM: list[Any] = []  # the method install() replaced, for tests that compare with it


def upstream() -> Any:
    """Inductor's own ``_handle_pdl_before_access``, patched or not."""
    from torch._inductor.codegen.triton import TritonKernel

    return _UPSTREAM[0] if _UPSTREAM else TritonKernel._handle_pdl_before_access


def install() -> None:
    """Patch Inductor's Triton codegen so that every PDL kernel waits before its first access;
    idempotent. Raises RuntimeError naming the fix when this torch cannot be patched."""
    problem = supported()
    if problem is not None:
        raise RuntimeError(
            f"DEEPINFER_PDL=1 needs Inductor's PDL codegen patched, but {problem}; "
            "set DEEPINFER_PDL=0 or use torch 2.11 to 2.13"
        )
    from torch._inductor.codegen.triton import TritonKernel

    if not getattr(TritonKernel._handle_pdl_before_access, "deepinfer_patch", False):
        _UPSTREAM[:] = [TritonKernel._handle_pdl_before_access]
        TritonKernel._handle_pdl_before_access = _wait_before_first_access  # type: ignore[method-assign]


def installed() -> bool:
    from torch._inductor.codegen.triton import TritonKernel

    return bool(getattr(TritonKernel._handle_pdl_before_access, "deepinfer_patch", False))
