"""The Triton launches a model's compiled steps make, found without a GPU and without compiling
the steps: the offline half of "every kernel at every released width"
(``test_released_widths_sm90.py``).

The engine's decode and prefill step functions (``engine/steps.py``) run eagerly on ``meta``
tensors of the config's real shapes (no storage: a V4-Pro layer costs nothing) with the nvidia
pipeline's kernel swaps in force, as a compiled step is traced. Every ``deepinfer`` op call is
caught (a dispatch mode) and handed to the op's CUDA launcher (``kernels/triton``) on the same
meta tensors, inside ``sm90_ptxas.recorded_launches``: the launcher makes its shape decisions
and its launches are specialised for sm_90, nothing runs. Two graph passes act after tracing,
so their effect is reproduced here:

- the fusion passes put ``deepinfer::rms_norm`` and ``deepinfer::swiglu_clamp`` in place of the
  model's ``graphs/norm.py::rms_norm`` and ``graphs/moe.py::swiglu_act`` (with a clamp): those two
  functions are replaced by their ops while the steps run (every call, so at least the fused ones);
- ``skinny_linear_group`` merges decode projections of one input: the recorded
  ``skinny_linear`` / ``skinny_linear_fp8`` / ``bi_matmul`` calls are laid out as an FX graph
  (a placeholder per input tensor they view, one per weight and scale) and the pass itself
  groups them.

Kernel swaps that decline a call (``SwapRow.unserved``) are collected with their reasons.
Only in a process without ``TRITON_INTERPRET`` (``sm90_ptxas.compile_in_subprocess``)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from sm90_ptxas import Launch, recorded_launches

from deepinfer_fx.config import ModelConfig
from deepinfer_fx.engine.steps import decode_logits, prefill_logits
from deepinfer_fx.graphs import moe as graphs_moe
from deepinfer_fx.graphs import norm as graphs_norm
from deepinfer_fx.graphs.engram import EngramTable
from deepinfer_fx.graphs.model import cached_engram_layout
from deepinfer_fx.graphs.param_spec import build_tree
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.kernels.triton import pdl, register_nvidia_kernels
from deepinfer_fx.passes.grouping import SkinnyLinearGroup
from deepinfer_fx.passes.manager import build_pipeline
from deepinfer_fx.passes.kernel_swap import KernelSwap

# (kind, tokens): decode batches on each side of the launchers' size rules (skinny GEMVs up to
# 16 rows, the shared-expert fold and ring attention at 64, the mHC one-tile schedule up to
# 256 tokens) and one prefill chunk.
CASES: tuple[tuple[str, int], ...] = (("decode", 1), ("decode", 16), ("decode", 64), ("decode", 256), ("prefill", 4096))
CONTEXT = 8192  # the state's length (meta tensors hold no values: positions and top-k counts do not matter)


@dataclass
class ModelLaunches:
    """What the steps of one config launch: ``launches[key]`` the first launch of each binary
    with the case (``decode-t1``, ...) and op that made it; ``declined[swap]`` the reasons."""

    launches: dict[tuple, tuple[Launch, str, str]] = field(default_factory=dict)
    declined: dict[str, list[str]] = field(default_factory=dict)

    def add(self, launches: list[Launch], case: str, op: str) -> None:
        for launch in launches:
            self.launches.setdefault(launch.key(), (launch, case, op))


# the projection ops the grouping pass merges, and the ops it merges them into
_PROJECTIONS = (
    torch.ops.deepinfer.skinny_linear.default,
    torch.ops.deepinfer.skinny_linear_fp8.default,
    torch.ops.deepinfer.bi_matmul.default,
)
_GROUPS = (
    torch.ops.deepinfer.skinny_linear_group.default,
    torch.ops.deepinfer.skinny_linear_fp8_group.default,
    torch.ops.deepinfer.bi_matmul_group.default,
)


class _OpCalls(TorchDispatchMode):
    """Hands every ``deepinfer`` op call to its CUDA launcher (launches recorded) and lets the op's
    meta implementation give the result; projection calls wait for the grouping."""

    def __init__(self, out: ModelLaunches, case: str) -> None:
        super().__init__()
        self.out, self.case = out, case
        self.projections: list[tuple] = []  # (op, x, w[, scale], out_fp32)
        self._seen: set[tuple] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "deepinfer":
            if func in _PROJECTIONS:
                self.projections.append((func, *args))
            else:
                self.launch(func._schema.name, args, kwargs)
        return func(*args, **kwargs)

    def launch(self, op: str, args: tuple, kwargs: dict) -> None:
        key = (op, *(_meta_key(a) for a in (*args, *kwargs.values())))
        if key in self._seen:  # a layer's twin: the same launches
            return
        self._seen.add(key)
        with recorded_launches() as launches:  # the op's registered CUDA kernel (custom_op keeps them per device type)
            OPDEFS[op]._backend_fns["cuda"](*args, **kwargs)
        self.out.add(launches, self.case, op)


def _meta_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.stride(), a.dtype, a.storage_offset())
    if isinstance(a, (list, tuple)):
        return tuple(_meta_key(x) for x in a)
    return a


def _grouped(calls: list[tuple]) -> torch.fx.GraphModule:
    """The projection calls (``skinny_linear`` and ``bi_matmul``: op, x, w, out_fp32;
    ``skinny_linear_fp8``: op, x, w, scale, out_fp32) as the traced graph holds them (each
    input a view of the tensor its rows come from, each weight and scale a placeholder), after
    ``skinny_linear_group``."""

    def root(x: torch.Tensor) -> torch.Tensor:  # the tensor x views (the calls keep it alive: ids stay unique)
        return x if x._base is None else x._base

    g = torch.fx.Graph()
    roots: dict[int, torch.fx.Node] = {}
    for _, x, *_ in calls:
        if id(root(x)) not in roots:
            roots[id(root(x))] = g.placeholder(f"x{len(roots)}")
            roots[id(root(x))].meta["val"] = root(x)
    held = []  # each call's weight (and scale) placeholders
    for i, (_, _, *tensors, _) in enumerate(calls):
        held.append([g.placeholder(f"w{i}_{j}") for j in range(len(tensors))])
        for node, t in zip(held[-1], tensors):
            node.meta["val"] = t
    outs = []
    for (op, x, w, *_, out_fp32), nodes in zip(calls, held):
        view = g.call_function(torch.ops.aten.view.default, (roots[id(root(x))], list(x.shape)))
        view.meta["val"] = x
        outs.append(g.call_function(op, (view, *nodes, out_fp32)))
        outs[-1].meta["val"] = torch.empty(
            x.shape[0], w.shape[0], dtype=torch.float32 if out_fp32 else x.dtype, device="meta"
        )
    g.output(tuple(outs))
    gm = torch.fx.GraphModule({}, g)
    SkinnyLinearGroup()(gm)
    return gm


def _launch_projections(calls: list[tuple], rec: _OpCalls) -> None:
    def val(n: Any) -> Any:
        return (
            [val(m) for m in n]
            if isinstance(n, (list, tuple))
            else (n.meta["val"] if isinstance(n, torch.fx.Node) else n)
        )

    for node in _grouped(calls).graph.nodes:
        if node.op == "call_function" and node.target in _PROJECTIONS + _GROUPS:
            rec.launch(node.target._schema.name, tuple(val(a) for a in node.args), {})


class _AsTable(EngramTable):
    """A table of meta rows: a plain gather (the eager lookup checks ids on the host)."""

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        assert self._dense is not None
        return self._dense[ids].float()


@contextlib.contextmanager
def _fused_as_ops() -> Iterator[None]:
    """``rms_norm`` and clamped ``swiglu_act`` calls of the model as the ops the fusion passes
    put in their place, wherever the graphs modules hold them."""
    rms, swiglu = graphs_norm.rms_norm, graphs_moe.swiglu_act

    def rms_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return torch.ops.deepinfer.rms_norm(x, weight, eps)

    def swiglu_op(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        return torch.ops.deepinfer.swiglu_clamp(gate, up, limit) if limit else swiglu(gate, up, limit)

    patched = [
        (mod, name, value)
        for mod in list(sys.modules.values())
        if getattr(mod, "__name__", "").startswith("deepinfer_fx.graphs.")
        for name, value in vars(mod).items()
        if value is rms or value is swiglu
    ]
    for mod, name, value in patched:
        setattr(mod, name, rms_op if value is rms else swiglu_op)
    try:
        yield
    finally:
        for mod, name, value in patched:
            setattr(mod, name, value)


def _params(c: ModelConfig) -> dict:
    flat: dict[str, Any] = {}
    for s in param_specs(c, mtp=False):
        t = torch.empty(s.shape, dtype=s.dtype(torch.bfloat16), device="meta")
        flat[s.path] = _AsTable(s.path, s.shape[0], s.shape[1], dense=t) if s.quant == "engram" else t
    if c.engram_layer_ids:
        flat["engram_vocab"] = torch.zeros(c.vocab_size, dtype=torch.long, device="meta")
    return build_tree(flat)


def _step(c: ModelConfig, params: dict, kind: str, tokens: int) -> Callable[[], torch.Tensor]:
    meta = {"device": "meta", "dtype": torch.long}
    if kind == "decode":
        state = init_state(c, CONTEXT, torch.bfloat16, "meta", mtp=False, slots=tokens)
        slots = torch.zeros(tokens, **meta)
        return lambda: decode_logits(
            params,
            state,
            c,
            torch.zeros(tokens + 1, **meta),
            slots,
            torch.zeros(tokens, **meta),
            torch.zeros(tokens, **meta),
        )
    state = init_state(c, CONTEXT, torch.bfloat16, "meta", mtp=False, slots=1)
    one = torch.zeros(1, **meta)
    return lambda: prefill_logits(params, state, c, torch.zeros(tokens, **meta), one, one, one, one)


def trunk(c: ModelConfig) -> ModelConfig:
    """``c`` without its draft model: all the steps run (they hold no ``mtp.*`` parameters or
    state here), so configs with equal trunks launch the same kernels (V4-Flash and -0731)."""
    drafter = {
        f.name: f.default
        for f in dataclasses.fields(ModelConfig)
        if f.name.startswith("dspark_") and f.name != "dspark_stages"
    }
    return c.replace(dspark_stages=0, num_nextn_predict_layers=0, **drafter)


def model_launches(
    c: ModelConfig,
    cases: tuple[tuple[str, int], ...] = CASES,
    disabled: tuple[str, ...] = (),
    over: dict[str, Any] | None = None,
) -> ModelLaunches:
    """Every distinct launch of ``c``'s compiled steps in ``cases`` (bf16 activations, the
    nvidia pipeline without ``disabled``; ``over``: replacements that win over its swaps, as
    batch-invariant inference's table does), and the swaps' declines."""
    register_nvidia_kernels()
    pdl.pdl_enabled = lambda device: True  # the H200's launches (an sm_90 device, DEEPINFER_PDL on)
    if c.engram_layer_ids:
        cached_engram_layout(c)
    pipeline = build_pipeline("nvidia", disabled, environ={})
    out = ModelLaunches()
    params = _params(c)
    for kind, tokens in cases:
        rec = _OpCalls(out, f"{kind}-t{tokens}")
        with torch.no_grad(), swapped({**pipeline.swaps(), **(over or {})}), _fused_as_ops(), rec:
            _step(c, params, kind, tokens)()
        _launch_projections(rec.projections, rec)
    for p in pipeline.passes:
        if isinstance(p, KernelSwap) and (whys := p.declines()):
            out.declined[p.name] = list(whys)
    return out
