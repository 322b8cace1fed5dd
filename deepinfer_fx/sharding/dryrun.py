"""Dry runs: trace one rank's compiled steps of a big mesh in one CPU process, without weights.

``python -m deepinfer_fx.generate --mesh ep64 --dry-run --rank 5 --dump-graphs DIR`` lands here:

1. the world mesh is built on the *fake* process group (``world.fake_world``): rank ``R`` of a
   64-rank world in this one process, its EP group a real ``DeviceMesh`` view;
2. everything runs under one ``FakeTensorMode``: parameters, state and step buffers are fake
   tensors of the real config's shapes (no storage), with only rank R's expert slots
   (``rules.local_shape`` under the EPLB placement), Engram tables included (a dense
   ``EngramTable`` over a fake tensor: nothing behind the ~98 GB tables). Fake rather than
   ``meta`` tensors because Dynamo makes constants built inside a step (``torch.tensor(...,
   device=x.device)``) real tensors on a meta device, which fake tracing then refuses. The
   parameters are DTensors on the world mesh, as ``LLM`` holds them (``placed.py``); the summary
   lists their placements, and the steps take their local views;
3. the engine's own compiled steps (``StepGraphs``: decode of a few requests, prefill of one
   chunk) are traced by torch.compile with the EP swap in force. Dynamo turns the EP all-to-alls
   into functional collectives (``_c10d_functional.all_to_all_single``), so they appear in the
   ATen graphs with their shapes; running the graphs on fake tensors only propagates shapes, and
   the fake process group moves nothing. So **no value in this mode is real**: only shapes,
   dtypes and the bytes each collective would move.
4. every graph is dumped (``passes.dump``: captured, ATen, after each pass) and the collectives of
   the ATen graphs are summarised per MoE layer: each EP call is annotated with its layer
   (``torch.fx.traceback.annotate``), which the ATen nodes keep.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _resolve_process_group

from ..api import Model
from ..config import ModelConfig, load_config
from ..config import released_config
from ..engine.graph_runner import StepGraphs
from ..graphs.engram import EngramTable
from ..graphs.param_spec import build_tree
from ..graphs.params import param_specs
from ..graphs.state import init_state
from ..graphs.swap import swapped
from ..settings import DEFAULTS, EngineConfig
from .ep import ep_group
from .eplb import ExpertPlacement, default_placement, num_physical_experts
from .mesh import MeshSpec, parse_mesh
from .parallel import EP_PLACE, ep_swaps
from .placed import distribute_tree, local_tree, placement_summary
from .rules import local_shape
from .world import build_mesh, fake_world, moe_view, rank_coordinate

NOT_REAL = "NOTE: dry run on a fake process group with fake tensors: collectives moved no data and no value is real; only shapes, dtypes and bytes are."
# the prefill graph is traced with the static capacity, which shows its collectives; the engine's
# prefill on ep > 1 runs the ragged op instead (engine/ranks.EPSwaps), whose bytes follow the routing
RAGGED_PREFILL = (
    "NOTE: on ep > 1 the engine's prefill steps send only the routed pairs (deepinfer::ep_moe_ragged, splits "
    "read on the host, graphs not captured); the prefill bytes above are the static capacity's worst case, "
    "an upper bound. Decode steps send what is shown."
)
LAYER_KEY = "moe_layer"
# the packaged V4.1-Flash release config: the default dry-run target
DEFAULT_CONFIG = released_config("deepseek_v41_flash")


def abstract_params(
    c: ModelConfig, spec: MeshSpec, rank: int, placement: ExpertPlacement, dtype: torch.dtype = torch.bfloat16
) -> dict:
    """Rank ``rank``'s parameter tree as empty tensors (call it under a ``FakeTensorMode`` for
    abstract ones): the shapes the loader would produce for it (its expert slots only; everything
    else whole), in the run dtype."""
    coord = rank_coordinate(spec, rank)
    flat: dict[str, object] = {}
    for s in param_specs(c, mtp=False):
        t = torch.empty(local_shape(s, spec, coord, placement), dtype=s.dtype(dtype))
        flat[s.path] = EngramTable.from_tensor(t, name=s.path) if s.quant == "engram" else t
    if c.engram_layer_ids:
        flat["engram_vocab"] = torch.empty(c.vocab_size, dtype=torch.long)
    return build_tree(flat)


@dataclass(frozen=True)
class Collective:
    """One collective of a traced graph: what it is, over how many ranks, and the bytes this rank
    sends with it (for an all-to-all, also what it receives)."""

    graph: str
    layer: int | None  # the MoE layer whose EP call issued it (None: outside the MoE region)
    kind: str
    group_size: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def collectives(gm: torch.fx.GraphModule, graph: str) -> list[Collective]:
    """Every functional collective in an ATen graph (waits left out), in graph order."""
    out = []
    for n in gm.graph.nodes:
        target = getattr(n.target, "name", lambda: "")()
        if not target.startswith("_c10d_functional::") or "wait_tensor" in target:
            continue
        val = n.args[0].meta["val"]  # the tensor sent
        group = _resolve_process_group(n.args[-1]).size()  # functional collectives name their group
        layer = n.meta.get("custom", {}).get(LAYER_KEY)
        kind = target.split("::", 1)[1]
        out.append(Collective(graph, layer, kind, group, val.numel() * val.element_size(), tuple(val.shape), val.dtype))
    return out


def _annotated(swaps: dict[str, Callable], calls: list[int]) -> dict[str, Callable]:
    """The EP swap with each call's graph nodes tagged with its MoE layer: the MoE runs once per
    layer in layer order, so the n-th call of a step is layer n."""
    impl = swaps[EP_PLACE]

    def call(*args):
        calls.append(len(calls))
        with fx_traceback.annotate({LAYER_KEY: calls[-1]}):
            return impl(*args)

    return {EP_PLACE: call}


@dataclass
class DryRun:
    """What a dry run traced: per graph (``GraphKey.name``) its collectives, its EP calls and the
    seconds its trace took (keyed by step kind)."""

    spec: MeshSpec
    rank: int
    placement: ExpertPlacement
    graphs: dict[str, list[Collective]]  # graph name -> its collectives
    moe_calls: dict[str, int]  # graph name -> EP calls traced
    seconds: dict[str, float]
    placements: str = ""  # placed.placement_summary of the rank's DTensor parameters


def dry_run(
    c: ModelConfig,
    spec: MeshSpec,
    rank: int,
    dump_dir: str | Path | None,
    *,
    decode_requests: int = 4,
    prefill_tokens: int = 64,
    extra_experts: int = DEFAULTS.extra_experts,
    dtype: torch.dtype = torch.bfloat16,
) -> DryRun:
    """Trace rank ``rank``'s decode step (``decode_requests`` requests) and prefill step (one chunk
    of ``prefill_tokens``) on ``spec``, dumping every graph under ``dump_dir`` (None: no dump)."""
    placement = default_placement(
        c.n_routed_experts, num_physical_experts(c.n_routed_experts, spec.ep, extra_experts), spec.ep
    )
    run = DryRun(spec, rank, placement, {}, {}, {})
    with fake_world(spec.world_size, rank), torch.no_grad():
        world = build_mesh(spec)  # before the fake mode: a mesh reads its rank table
        ep_view = moe_view(world)
        # allow_non_fake_inputs: constants a compiled graph builds (small index tables) are real
        with FakeTensorMode(allow_non_fake_inputs=True):
            # the rank's parameters as the engine holds them on a mesh: DTensors, whose local
            # views the steps take
            placed = distribute_tree(abstract_params(c, spec, rank, placement, dtype), c, world, lambda s: placement)
            run.placements = placement_summary(placed)
            params = local_tree(placed)
            state = init_state(c, 4096, dtype, mtp=False, slots=decode_requests)  # long enough for every top-k
            steps = StepGraphs(
                Model(c, params),
                state,
                torch.zeros(decode_requests + 1, dtype=torch.long),
                max_requests=decode_requests,
                max_tokens=prefill_tokens,
                graphs=False,
                inductor=False,
                dump_dir=None if dump_dir is None else str(dump_dir),
            )
            slots = list(range(decode_requests))
            kinds = {
                "decode": (decode_requests, lambda: steps.decode(slots, [prefill_tokens + 7 * i for i in slots])),
                "prefill": (prefill_tokens, lambda: steps.prefill([(0, 0, [3] * prefill_tokens)])),
            }
            for kind, (max_tokens, step) in kinds.items():
                # capacity per step kind, as a bucketed engine sizes it: the worst case of its batch
                group = ep_group(placement, max_tokens, c.num_experts_per_tok, ep_view)
                calls: list[int] = []
                t0 = time.perf_counter()
                with swapped(_annotated(ep_swaps(group), calls)):
                    step()
                run.seconds[kind] = time.perf_counter() - t0
                graph = steps.report()[-1]
                name = graph["model_graph"]
                run.graphs[name] = [x for gm in steps.backend(graph["graph"]).graphs for x in collectives(gm, name)]
                run.moe_calls[name] = len(calls)
    return run


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def summary(run: DryRun) -> str:
    """Per graph, one line per MoE layer: each collective's kind, group size and bytes per call."""
    coord = rank_coordinate(run.spec, run.rank)
    lines = [
        f"dry run: mesh {run.spec} (world {run.spec.world_size}), rank {run.rank} = {coord}; experts "
        f"{run.placement.n_logical} logical -> {run.placement.n_physical} physical, {run.placement.slots_per_rank} slots on this rank",
    ]
    for name, items in run.graphs.items():
        by_layer: dict[int | None, list[Collective]] = defaultdict(list)
        for x in items:
            by_layer[x.layer].append(x)
        total = sum(x.nbytes for x in items)
        lines.append(
            f"{name}: {len(items)} collectives in {run.moe_calls[name]} MoE layers, {_size(total)} sent per step "
            f"(traced in {run.seconds[name.split('-')[0]]:.1f}s)"
        )
        for layer in sorted(by_layer, key=lambda v: -1 if v is None else v):
            parts = ", ".join(
                f"{x.kind} over {x.group_size} ranks {list(x.shape)} {str(x.dtype).removeprefix('torch.')} = {_size(x.nbytes)}"
                for x in by_layer[layer]
            )
            lines.append(f"  {'outside MoE' if layer is None else f'layer {layer:2d}'}: {parts}")
    if run.spec.ep > 1:
        lines.append(RAGGED_PREFILL)
    if run.placements:
        lines.append(run.placements)
    lines.append(NOT_REAL)
    return "\n".join(lines)


def cli(model: str | None, mesh: str, rank: int, dump_dir: str | None) -> int:
    """``generate --dry-run``: ``model`` is a checkpoint directory or a config.json (only the config
    is read; default ``DEEPINFER_HF_MODEL_DIR``, else the packaged V4.1-Flash config)."""
    settings = EngineConfig.from_env()
    path = model or settings.hf_model_dir or DEFAULT_CONFIG
    if path == DEFAULT_CONFIG:
        print(f"[dry run] no --model: using the packaged V4.1-Flash config ({path.name})")
    c = load_config(path)
    spec = parse_mesh(mesh)
    rank_coordinate(spec, rank)  # a rank outside the mesh fails before anything is traced
    t0 = time.perf_counter()
    text = summary(dry_run(c, spec, rank, dump_dir, extra_experts=settings.extra_experts))
    print(text)
    if dump_dir is not None:
        (Path(dump_dir) / "collectives.txt").write_text(text + "\n")
        print(f"graphs and this summary written to {dump_dir}")
    print(f"dry run finished in {time.perf_counter() - t0:.1f}s")
    return 0
