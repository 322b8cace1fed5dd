"""Our torch.compile backend: capture -> ATen -> our pass pipeline -> run (eager) or Inductor.

    fn = torch.compile(step, backend=make_backend("cpu", name="decode-t64"), fullgraph=True)

Two paths, one graph form for the passes (ATen, functionalised, Inductor's decompositions; see
``pattern.py``):

- default (``inductor=False``): AOT autograd with those decompositions; our passes run on the
  forward graph, which then runs eagerly (``aot_eager`` plus passes). For CPU tests and for
  debugging a pass without Inductor in the way.
- ``inductor=True``: Inductor compiles, and our pipeline runs as its post-grad custom pass.

Cache key. Inductor caches compiled graphs (FX graph cache, AOT autograd cache) under a key that
includes ``uuid()`` of the ``CustomGraphPass`` installed as ``post_grad_custom_post_pass``; ours
returns ``Pipeline.uuid()`` (accelerator + each enabled pass's name and source hash), so editing,
adding or disabling a pass misses the cache instead of reusing a graph compiled without it. The
eager path has no persistent cache to key; there the uuid is recorded in ``gm.meta`` and in the
dump index for inspection. When dumping on the Inductor path the caches are switched off, since a
cache hit skips the passes and so would leave their stages out of the dump.

PDL. PDL wanted (``DEEPINFER_PDL``, handed down by the engine through
``kernels.launch_options.use_pdl``, or ``make_backend(pdl=...)``) on the nvidia pipeline turns on Inductor's ``triton.enable_pdl`` with
its codegen patched so that every kernel waits before its first access (``inductor_pdl.py``;
upstream's kernels do not all wait, which breaks the ordering every PDL kernel relies on), and
adds the patch's id to the cache key. ``TORCHINDUCTOR_ENABLE_PDL=1`` alone would run the
unpatched codegen, so it is overridden by ``DEEPINFER_PDL`` with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import kernels  # noqa: F401  (registers torch.ops.deepinfer.*, which the passes insert)
from ..kernels.launch_options import pdl_wanted
from . import inductor_pdl
from .dump import GraphDump, start_dump
from .invariant_guard import check_invariant_graph, inductor_patches
from .manager import PassRecord, Pipeline, build_pipeline
from .pattern import aten_decompositions

META_KEY = "deepinfer_pipeline_uuid"


class _PipelineAsInductorPass(CustomGraphPass):
    """Adapts the pipeline to Inductor's custom-pass hook, which passes a Graph and asks for a
    uuid when it builds cache keys."""

    def __init__(self, backend: DeepinferBackend, dump: GraphDump | None) -> None:
        self.backend = backend
        self.dump = dump

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        assert isinstance(gm, torch.fx.GraphModule), "Inductor hands post-grad passes a module-owned graph"
        self.backend.run_pipeline(gm, self.dump)

    def uuid(self) -> str:
        return self.backend.cache_key()


class DeepinferBackend:
    """A torch.compile backend (``(gm, example_inputs) -> callable``) bound to one pipeline and
    one graph name. ``records`` keeps what each pass did to each graph it compiled and ``graphs``
    the graphs after the pipeline, for tests and the start-up report."""

    def __init__(
        self,
        pipeline: Pipeline,
        name: str,
        dump_dir: str | os.PathLike | None,
        inductor: bool,
        pdl: bool = False,
        invariant: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.name = name
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self.inductor = inductor
        self.pdl = pdl  # Inductor's kernels launched with PDL (patched: each waits first)
        self.invariant = invariant  # a batch-invariant step: checked, and Inductor set to eager's rounding
        self.records: list[list[PassRecord]] = []
        self.graphs: list[torch.fx.GraphModule] = []

    def cache_key(self) -> str:
        key = self.pipeline.uuid() + ("+batch-invariant" if self.invariant else "")
        return f"{key}+{inductor_pdl.PATCH_ID}" if self.pdl else key

    def rewrites(self) -> dict[str, int]:
        """Rewrites per pass, summed over every graph compiled so far."""
        total: dict[str, int] = {}
        for graph in self.records:
            for r in graph:
                total[r.name] = total.get(r.name, 0) + r.rewrites
        return total

    def declines(self) -> dict[str, list[str]]:
        """Per pass, why it left calls to the reference (a kernel that cannot serve a shape), over
        every graph compiled so far; passes that declined nothing are left out."""
        total: dict[str, list[str]] = {}
        for graph in self.records:
            for r in graph:
                seen = total.setdefault(r.name, [])
                seen += [why for why in r.declined if why not in seen]
        return {name: whys for name, whys in total.items() if whys}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        dump = None
        if self.dump_dir is not None:
            dump = start_dump(self.dump_dir, self.name, self._describe())
            dump.stage("captured", gm, diff=False)
        if self.inductor:
            return self._compile_inductor(gm, example_inputs, dump)
        compile_forward = functools.partial(self._compile_eager, dump=dump)
        return aot_autograd(
            fw_compiler=compile_forward,
            bw_compiler=lambda g, _: make_boxed_func(g.forward),  # inference engine: no passes on backward
            decompositions=aten_decompositions(),
        )(gm, example_inputs)

    def run_pipeline(self, gm: torch.fx.GraphModule, dump: GraphDump | None) -> None:
        """The passes on one ATen graph, each stage dumped when asked."""
        if dump is not None:
            dump.stage("aten", gm, diff=False)

        def after(p: Any, record: PassRecord) -> None:
            if dump is not None:
                dump.stage(p.name, gm, rewrites=record.rewrites, uuid=record.uuid, declined=record.declined)

        self.records.append(self.pipeline.run(gm, after))
        if self.invariant:
            check_invariant_graph(gm, self.name)
        self.graphs.append(gm)
        gm.meta[META_KEY] = self.cache_key()

    def _compile_eager(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], dump: GraphDump | None
    ) -> Callable[..., Any]:
        self.run_pipeline(gm, dump)
        return make_boxed_func(gm.forward)

    def _compile_inductor(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], dump: GraphDump | None
    ) -> Callable[..., Any]:
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx  # heavy; only the Inductor path pays

        patches: dict[str, Any] = {"post_grad_custom_post_pass": _PipelineAsInductorPass(self, dump)}
        if self.invariant:
            patches.update(inductor_patches())
        if self.pdl:
            inductor_pdl.install()
            patches["triton.enable_pdl"] = True
        elif getattr(inductor_config.triton, "enable_pdl", False):
            # Unpatched, some of Inductor's PDL kernels never wait on their predecessor, which
            # breaks the ordering every PDL kernel relies on (inductor_pdl.py).
            warnings.warn(
                "TORCHINDUCTOR_ENABLE_PDL (Inductor's triton.enable_pdl) is ignored and turned off for "
                "deepinfer_fx's compiled steps: set DEEPINFER_PDL=1 for programmatic dependent launch of "
                "every kernel, with Inductor's kernels patched to wait first",
                stacklevel=2,
            )
            patches["triton.enable_pdl"] = False
        no_cache: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if dump is not None:
            patches["fx_graph_cache"] = False
            no_cache = torch._functorch.config.patch(enable_autograd_cache=False)
        with no_cache:
            return compile_fx(gm, list(example_inputs), config_patches=patches)

    def _describe(self) -> dict[str, Any]:
        return {
            "accelerator": self.pipeline.accelerator,
            "passes": list(self.pipeline.names),
            "disabled": sorted(self.pipeline.disabled),
            "uuid": self.cache_key(),
            "backend": "inductor" if self.inductor else "aot_eager",
            "inductor_pdl": self.pdl,
            "batch_invariant": self.invariant,
        }


def make_backend(
    accelerator: str,
    disabled: Iterable[str] = (),
    dump_dir: str | os.PathLike | None = None,
    name: str = "graph",
    *,
    inductor: bool = False,
    environ: Mapping[str, str] | None = None,
    pdl: bool | None = None,
    invariant: bool = False,
) -> DeepinferBackend:
    """A backend running ``accelerator``'s pipeline minus ``disabled`` (and minus the names in
    ``DEEPINFER_DISABLE_PASSES`` of ``environ``, default ``os.environ``); ``name`` (kind and
    bucket, see ``dump.graph_name``) names the graph's dump under ``dump_dir``. ``pdl`` (None:
    ``launch_options.pdl_wanted()``, which the engine sets from ``DEEPINFER_PDL``) PDL-launches
    Inductor's kernels on the nvidia pipeline. ``invariant``: a batch-invariant step's graphs, each
    refused if it sums floats outside the fixed-order ops, and compiled by Inductor with eager's
    rounding (``invariant_guard.py``)."""
    wanted = pdl_wanted() if pdl is None else pdl
    pdl = accelerator == "nvidia" and inductor and wanted
    pipeline = build_pipeline(accelerator, disabled, environ)
    return DeepinferBackend(pipeline, name, dump_dir, inductor, pdl, invariant)


def compile_graph(
    fn: Callable[..., Any], backend: DeepinferBackend, dynamic: bool | None = False
) -> Callable[..., Any]:
    """``torch.compile`` as the engine uses it: one whole graph per step function (a graph break
    is a bug in the model code, not something to paper over), static shapes per bucket."""
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
