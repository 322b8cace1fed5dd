"""Inductor's PDL codegen, patched so that every kernel waits before its first memory access
(``passes/inductor_pdl.py``).

No GPU here, so the kernels are generated for the CPU through Inductor's Triton CPU backend with
PDL codegen forced on, and their source is read: the property is where ``gdc_wait`` stands. The
kernels then fail to run (the interpreter cannot execute ``gdc_wait``; a CUDA-only Triton has no CPU
target), which these tests expect.
On the H200, ``tests/compile/test_steps.py::test_pdl_on_and_off_replay_the_same_bits_on_cuda``
runs the patched kernels."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.utils._triton as torch_triton
from torch._inductor.codegen.triton import TritonKernel

from deepinfer_fx.kernels import launch_options
from deepinfer_fx.passes import inductor_pdl
from deepinfer_fx.passes.compiler import make_backend

_ACCESS = re.compile(r"tl\.(load|store|atomic_\w+)\(|bucketize_binary_search\(")
_WAIT = TritonKernel.GDC_WAIT


def _kernel_sources(fn: Callable[..., object], *args: torch.Tensor, handle: Callable[..., None]) -> list[str]:
    """The body of every Triton kernel Inductor generates for ``fn`` with PDL forced on and
    ``handle`` as ``_handle_pdl_before_access``."""
    sources: list[str] = []
    codegen = TritonKernel.codegen_kernel

    def record(self: TritonKernel, *a: object, **k: object) -> str:
        src = codegen(self, *a, **k)
        sources.append(src[src.rindex("@triton.jit") :])  # the kernel, after any helper functions
        return src

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonKernel, "_enable_pdl_codegen", staticmethod(lambda: True))
        mp.setattr(TritonKernel, "_handle_pdl_before_access", handle)
        mp.setattr(TritonKernel, "codegen_kernel", record)
        mp.setattr(torch_triton, "triton_hash_with_backend", lambda: "0" * 64)  # no GPU driver to hash
        torch._dynamo.reset()
        with (
            inductor_config.patch(cpu_backend="triton", fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            try:
                torch.compile(fn, backend="inductor", fullgraph=True)(*args)
            except Exception as e:  # the interpreter cannot run gdc_wait, a CUDA-only Triton has no
                # CPU target (the H200's): only the codegen matters
                assert any(m in repr(e) for m in ("gdc", "_semantic", "jit", "compatible backends")), e
        torch._dynamo.reset()
    assert sources, "Inductor generated no Triton kernel"
    return sources


def _early_accesses(src: str) -> list[str]:
    """Lines of ``src`` that touch global memory before its first ``gdc_wait`` (all of them
    when it never waits)."""
    lines = src.splitlines()
    first_wait = next((i for i, line in enumerate(lines) if _WAIT in line), len(lines))
    return [line.strip() for line in lines[:first_wait] if _ACCESS.search(line)]


def _step(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Kernels of the kinds a decode step has: a persistent and a looped reduction, a kernel
    that only stores (positions from shapes), one that reads only graph inputs after another
    wrote something else, a scatter, a scan."""
    normed = torch.rms_norm(x, (x.shape[-1],), w) * 2
    positions = torch.arange(x.shape[0] * 3) + 7
    other = y.cos()
    row_sums = y.reshape(2, -1).sum(-1)  # 2 rows of 4096: a reduction loop
    scattered = torch.zeros(16).index_put_((idx,), x[:, 0], accumulate=True)
    return normed, positions, other, row_sums, scattered, normed.cumsum(-1)


def _args() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(torch.seed())
    return (
        torch.randn(4, 64, generator=g),
        torch.randn(64, 128, generator=g),
        torch.randn(64, generator=g),
        torch.randint(0, 16, (4,), generator=g),
    )


def test_upstream_codegen_lets_kernels_touch_memory_before_waiting() -> None:
    """Why the patch exists, and proof that the check below can fail: unpatched, some kernel
    loads or stores before its wait, or never waits."""
    sources = _kernel_sources(_step, *_args(), handle=inductor_pdl.upstream())
    assert any(_early_accesses(s) for s in sources), "upstream now waits first everywhere: revisit inductor_pdl.py"


def test_patched_codegen_waits_before_every_first_access() -> None:
    sources = _kernel_sources(_step, *_args(), handle=inductor_pdl._wait_before_first_access)
    assert len(sources) >= 4
    for src in sources:
        assert _early_accesses(src) == [], src
        assert src.count(_WAIT) == 1, src  # Inductor's filter keeps the first wait only
        loop = src.find("for r0_offset in")
        if loop >= 0:  # hoisted: waited once, before the reduction loop
            assert src.index(_WAIT) < loop, src


def test_backend_turns_on_patched_pdl_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx_module

    seen: list[dict] = []
    monkeypatch.setattr(
        compile_fx_module, "compile_fx", lambda gm, inputs, config_patches: seen.append(config_patches) or gm
    )
    monkeypatch.setattr(TritonKernel, "_handle_pdl_before_access", inductor_pdl.upstream())
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    off = make_backend("nvidia", pdl=False, inductor=True)
    on = make_backend("nvidia", inductor=True)  # on by default (launch_options.pdl_wanted)
    cpu = make_backend("cpu", pdl=True, inductor=True)  # no PDL on a CPU
    assert (off.pdl, on.pdl, cpu.pdl) == (False, True, False)
    off._compile_inductor(gm, [torch.zeros(2)], None)
    assert "triton.enable_pdl" not in seen[-1] and not inductor_pdl.installed()
    on._compile_inductor(gm, [torch.zeros(2)], None)
    assert seen[-1]["triton.enable_pdl"] is True and inductor_pdl.installed()
    # A graph compiled by an unpatched Inductor with PDL on must not be a cache hit.
    assert on.cache_key() != off.cache_key() and inductor_pdl.PATCH_ID in on.cache_key()


def test_the_engine_hands_its_pdl_setting_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM`` reads ``DEEPINFER_PDL`` once and sets the launch option that the backend (and our
    kernels' launchers) read; a bad value is refused naming the variable."""
    from deepinfer_fx import LLM

    try:
        for value, want in (("0", False), ("1", True)):
            monkeypatch.setenv("DEEPINFER_PDL", value)
            LLM("demo", max_model_len=64, max_num_seqs=1)
            assert launch_options.pdl_wanted() is want and make_backend("nvidia", inductor=True).pdl is want
        monkeypatch.setenv("DEEPINFER_PDL", "maybe")
        with pytest.raises(ValueError, match="DEEPINFER_PDL='maybe' is invalid"):
            LLM("demo", max_model_len=64, max_num_seqs=1)
    finally:
        launch_options.use_pdl(True)  # the default, for the tests after this one


def test_an_unpatchable_inductor_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(TritonKernel, "_filter_pdl")
    with pytest.raises(RuntimeError, match="DEEPINFER_PDL=0"):
        inductor_pdl.install()
