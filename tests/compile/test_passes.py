"""The pass manager, the fusion passes, graph dumps and our compile backend, on a small function
built from the model's own ``rms_norm`` and ``swiglu``."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
import torch.fx

from deepinfer_fx.graphs.moe import swiglu
from deepinfer_fx.graphs.norm import linear, rms_norm
from deepinfer_fx.passes import manager
from deepinfer_fx.passes.compiler import (
    META_KEY,
    DeepinferBackend,
    _PipelineAsInductorPass,
    compile_graph,
    make_backend,
)
from deepinfer_fx.passes.dump import graph_name

RMS, SWIGLU = "rms_norm_fusion", "swiglu_clamp_fusion"
RMS_OP, SWIGLU_OP = torch.ops.deepinfer.rms_norm.default, torch.ops.deepinfer.swiglu_clamp.default
# kernel swaps (not installed around these blocks) and the grouping of their projections
SWAPS = (
    "moe_experts_kernel",
    "moe_shared_fused_kernel",
    "mhc_sinkhorn_kernel",
    "skinny_linear_kernel",
    "skinny_linear_fp8_kernel",
    "skinny_linear_blocks_kernel",
    "mhc_site_kernel",
    "mhc_head_kernel",
    "route_topk_kernel",
    "sparse_mqa_kernel",
    "ring_mqa_kernel",
    "compressor_kernel",
    "indexer_topk_kernel",
    "indexer_scores_kernel",
    "topk_mask_kernel",
    "rope_table_op",
    "rope_kernel",
    "norm_rope_kernel",
    "skinny_linear_group",
)
NO_SWAPS = dict.fromkeys(SWAPS, 0)

pytestmark = pytest.mark.usefixtures("fresh_compile")


def ffn_block(
    x: torch.Tensor, norm_w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """norm -> clamped SwiGLU -> down projection, plus an unweighted per-head norm: two RMSNorm
    sites (weighted and not) and one SwiGLU site."""
    h = rms_norm(x, norm_w, 1e-6)
    y = linear(swiglu(h, w1, w3, 7.0).to(x.dtype), w2)
    heads = rms_norm(y.unflatten(-1, (4, -1)), None, 1e-6)
    return heads.flatten(-2) + x


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    d, i = 32, 24

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    # Scaled so that the clamps at 7 bite on some elements.
    return r(6, d).to(dtype), r(d), r(i, d, scale=2.0), r(i, d, scale=2.0), r(d, i, scale=0.3)


def _targets(backend: DeepinferBackend) -> set[object]:
    assert len(backend.graphs) == 1, "fullgraph compile of one function: one graph"
    return {n.target for n in backend.graphs[0].graph.nodes if n.op == "call_function"}


def _run(backend: DeepinferBackend, dtype: torch.dtype = torch.float32) -> None:
    args = _inputs(dtype)
    out = compile_graph(ffn_block, backend)(*args)
    if {RMS, SWIGLU} <= set(backend.pipeline.names):
        # Every reference region became an op whose reference is the graphs function itself.
        torch.testing.assert_close(out, ffn_block(*args), rtol=0, atol=0)
    else:
        # An unfused SwiGLU runs Inductor's decomposition of silu, x / (1 + exp(-x)), which
        # may differ from the eager kernel in the last bit.
        torch.testing.assert_close(out, ffn_block(*args))


# --- the passes fire ------------------------------------------------------------------------


def test_patterns_trace_the_references_inside_a_swapped_step() -> None:
    """Patterns are traced on first use, which may fall inside a step that swapped a place the
    pattern's function calls (batch invariance puts its mean in ``reduce.mean_over``); they are
    traced from the references all the same, so later graphs still match."""
    from deepinfer_fx.graphs.swap import swapped

    be = make_backend("cpu", environ={})
    with swapped({"reduce.mean_over": lambda x, dim, keepdim=False: x.sum(dim, keepdim=keepdim) / x.shape[dim]}):
        next(p for p in be.pipeline.passes if p.name == RMS)._matcher  # noqa: B018  (traces the patterns now)
    _run(be)
    assert be.rewrites()[RMS] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_passes_fire_and_match_eager(dtype: torch.dtype) -> None:
    be = make_backend("cpu", environ={})
    _run(be, dtype)
    assert be.rewrites() == {RMS: 2, SWIGLU: 1, **NO_SWAPS}
    targets = _targets(be)
    assert {RMS_OP, SWIGLU_OP} <= targets
    assert torch.ops.aten.rsqrt.default not in targets  # the reference pattern is gone
    assert be.graphs[0].meta[META_KEY] == be.cache_key()


def test_inductor_path_fires_and_matches_eager() -> None:
    be = make_backend("cpu", environ={}, inductor=True)
    args = _inputs(torch.float32)
    out = compile_graph(ffn_block, be)(*args)
    torch.testing.assert_close(out, ffn_block(*args))  # Inductor may reorder the float math
    assert be.rewrites() == {RMS: 2, SWIGLU: 1, **NO_SWAPS}
    assert {RMS_OP, SWIGLU_OP} <= _targets(be)


def test_inductor_pdl_is_turned_off_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpatched, Inductor's PDL kernels do not all wait on their predecessor (``passes/inductor_pdl.py``)."""
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config

    seen: list[dict] = []
    monkeypatch.setattr(
        compile_fx_module, "compile_fx", lambda gm, inputs, config_patches: seen.append(config_patches) or gm
    )
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    be = make_backend("cpu", environ={}, inductor=True)
    be._compile_inductor(gm, [torch.zeros(2)], None)
    assert "triton.enable_pdl" not in seen[-1]  # off already (upstream's default): nothing to patch
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", True, raising=False)  # as TORCHINDUCTOR_ENABLE_PDL=1
    with pytest.warns(UserWarning, match="TORCHINDUCTOR_ENABLE_PDL .* is ignored"):
        be._compile_inductor(gm, [torch.zeros(2)], None)
    assert seen[-1]["triton.enable_pdl"] is False


def test_near_misses_are_left_alone() -> None:
    """A norm over the wrong dim and an asymmetric clamp look alike but are not these ops."""

    def f(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.square().mean(0, keepdim=True) + 1e-6)
        s = torch.nn.functional.silu(g.clamp(max=7.0)) * u.clamp(-3.0, 7.0)
        return n.sum() + s.sum()

    be = make_backend("cpu", environ={})
    args = (torch.randn(4, 8), torch.randn(4, 8) * 5, torch.randn(4, 8) * 5)
    torch.testing.assert_close(compile_graph(f, be)(*args), f(*args))
    assert be.rewrites() == {RMS: 0, SWIGLU: 0, **NO_SWAPS}


# --- switching passes off --------------------------------------------------------------------


def test_disable_by_api_removes_the_rewrite() -> None:
    be = make_backend("cpu", disabled=[RMS], environ={})
    _run(be)
    assert be.pipeline.names == (SWIGLU, *SWAPS)
    targets = _targets(be)
    assert RMS_OP not in targets and torch.ops.aten.rsqrt.default in targets
    assert SWIGLU_OP in targets


def test_disable_by_env_removes_the_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(manager.ENV_DISABLE, f" {SWIGLU} ,")
    be = make_backend("cpu")  # reads os.environ
    _run(be)
    targets = _targets(be)
    assert SWIGLU_OP not in targets and RMS_OP in targets


def test_api_and_env_disables_add_up() -> None:
    p = manager.build_pipeline("nvidia", [RMS], environ={manager.ENV_DISABLE: SWIGLU})
    assert p.names == SWAPS and p.disabled == {RMS, SWIGLU}


@pytest.mark.parametrize("where", ["api", "env"])
def test_unknown_pass_name_is_a_clear_error(where: str) -> None:
    kwargs = (
        {"disabled": ["rms_norm_fuson"], "environ": {}}
        if where == "api"
        else {"environ": {manager.ENV_DISABLE: "nope"}}
    )
    with pytest.raises(ValueError, match="unknown graph pass") as err:
        make_backend("cpu", **kwargs)
    assert RMS in str(err.value) and SWIGLU in str(err.value)  # the known names are listed


def test_unknown_accelerator_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'.*cpu.*nvidia.*ascend"):
        manager.build_pipeline("tpu", environ={})


# --- registry, pipelines, uuids --------------------------------------------------------------


class _NvidiaOnly(manager.GraphPass):
    name: ClassVar[str] = "test_nvidia_only"
    accelerators: ClassVar[frozenset[str]] = frozenset({"nvidia"})

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        return 0


class _NvidiaOnlyEdited(_NvidiaOnly):
    def __call__(self, gm: torch.fx.GraphModule) -> int:
        return 0  # same name, different source: an edit


def test_pipelines_follow_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager, "_REGISTRY", dict(manager._REGISTRY))  # keep the global one clean
    manager.register_pass(_NvidiaOnly)
    assert manager.build_pipeline("nvidia", environ={}).names == (RMS, SWIGLU, *SWAPS, "test_nvidia_only")
    assert manager.build_pipeline("cpu", environ={}).names == (RMS, SWIGLU, *SWAPS)
    assert manager.build_pipeline("ascend", environ={}).names == (RMS, SWIGLU)  # no kernels to swap in there
    # Disabling a known pass that this accelerator does not run is allowed (a no-op).
    assert manager.build_pipeline("cpu", ["test_nvidia_only"], environ={}).names == (RMS, SWIGLU, *SWAPS)


def test_bad_registrations_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager, "_REGISTRY", dict(manager._REGISTRY))

    class Tpu(_NvidiaOnly):
        name: ClassVar[str] = "test_tpu"
        accelerators: ClassVar[frozenset[str]] = frozenset({"tpu"})

    class Clash(_NvidiaOnly):
        name: ClassVar[str] = RMS

    with pytest.raises(ValueError, match="unknown accelerators"):
        manager.register_pass(Tpu)
    with pytest.raises(ValueError, match="two passes are named"):
        manager.register_pass(Clash)


def test_uuids_follow_source_and_enter_the_cache_key() -> None:
    a, b = _NvidiaOnly(), _NvidiaOnlyEdited()
    assert a.uuid() == _NvidiaOnly().uuid()  # stable
    assert a.uuid() != b.uuid()  # an edit changes it
    full = make_backend("cpu", environ={})
    partial = make_backend("cpu", disabled=[SWIGLU], environ={})
    assert full.cache_key() != partial.cache_key()
    assert full.cache_key() != make_backend("nvidia", environ={}).cache_key()
    # What Inductor puts into its FX-graph and AOT-autograd cache keys:
    assert _PipelineAsInductorPass(full, None).uuid() == full.cache_key()


# --- dumps -----------------------------------------------------------------------------------


def test_dump_has_every_stage(tmp_path) -> None:
    name = graph_name("decode", t=6, r=2)
    assert name == "decode-t6-r2"
    be = make_backend("cpu", dump_dir=tmp_path, name=name, environ={})
    _run(be)
    gdir = tmp_path / name
    index = json.loads((gdir / "index.json").read_text())
    labels = [s["label"] for s in index["stages"]]
    assert labels == ["captured", "aten", RMS, SWIGLU, *SWAPS]
    assert index["pipeline"]["uuid"] == be.cache_key()
    for s in index["stages"]:
        assert (gdir / s["file"]).read_text().strip()
    passes = {s["label"]: s for s in index["stages"][2:]}
    assert passes[RMS]["rewrites"] == 2 and passes[SWIGLU]["rewrites"] == 1
    rms_diff = (gdir / passes[RMS]["diff"]).read_text()
    assert "+" in rms_diff and "torch.ops.deepinfer.rms_norm" in rms_diff and "-" in rms_diff
    assert "torch.ops.deepinfer.swiglu_clamp" in (gdir / passes[SWIGLU]["diff"]).read_text()
    assert "aten.rsqrt" in (gdir / "01-aten.py").read_text()
    md = (gdir / "index.md").read_text()
    assert all(s["file"] in md for s in index["stages"])
    root = json.loads((tmp_path / "index.json").read_text())
    assert root["graphs"] == [{"name": name, "stages": labels}]
    assert name in (tmp_path / "index.md").read_text()


def test_dump_of_a_recompiled_name_gets_its_own_dir(tmp_path) -> None:
    be = make_backend("cpu", dump_dir=tmp_path, name="prefill-t8", disabled=[SWIGLU], environ={})
    compiled = compile_graph(ffn_block, be)
    compiled(*_inputs(torch.float32))
    compiled(*_inputs(torch.bfloat16))  # new dtype: Dynamo recompiles
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["prefill-t8", "prefill-t8.1"]
    labels = [s["label"] for s in json.loads((tmp_path / "prefill-t8.1" / "index.json").read_text())["stages"]]
    assert labels == ["captured", "aten", RMS, *SWAPS]


def test_pipelines_build_without_triton() -> None:
    """Triton is a test extra, not a dependency: without it every pipeline still builds, its
    swaps included (the NVIDIA kernel registration is where Triton is imported, lazily)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"  # any 'import triton' now raises ImportError
        "from deepinfer_fx.passes import build_pipeline\n"
        "for acc in ('cpu', 'nvidia', 'ascend'):\n"
        "    build_pipeline(acc, environ={}).swaps()\n"
        "from deepinfer_fx.kernels.triton import register_nvidia_kernels\n"
        "assert register_nvidia_kernels() is False\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
