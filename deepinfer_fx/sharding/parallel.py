"""Expert parallelism wired into the model, and how the ranks of a world mesh share the work.

Who owns what, on a mesh ``dp{D},cp{C},ep{E}`` (world rank ``w = (d * C + c) * E + e``, see
``world.py``):

- **Requests: data-parallel attention over the whole world.** Every rank serves its own
  requests, disjoint from every other rank's, in its own state pool: embedding, attention, mHC,
  the shared expert, the head and sampling run on the rank's tokens only and need no collective.
  (With ``cp > 1`` the C ranks of a CP group are meant to share a request's long prefill; that is
  the context-parallel work, not this module.) Which rank takes a new request is the caller's
  choice and nothing in the model depends on it; ``LLM`` deals a call's requests round-robin
  (``sharding/lockstep.py``, ``engine/ranks.py``).
- **Experts: one full set per EP group.** The E ranks with the same ``(d, c)`` form an EP group
  (``world.moe_view``) and between them hold every routed expert at least once: the EPLB placement
  maps ``n_physical`` slots to logical experts and EP rank ``e`` holds slots ``[e * S, (e + 1) * S)``
  (``rules.expert_ids``). Every EP group holds the same placement, so ``dp`` (and ``cp``) count
  replicas of the whole expert set; weights never cross EP groups.
- **The MoE region exchanges tokens inside the EP group only**: ``moe.expert_parallel`` is swapped
  for ``ep.ep_routed_experts`` (dispatch, the rank's local experts, combine), which takes the
  model's global (logical) expert ids and maps them to slots and ranks itself. One placement
  serves every layer of the trunk (per-layer EPLB placements are not wired yet); a draft head
  with its own expert count has its own group over the same ranks, picked by slot count.
- **Lock step.** An all-to-all needs every member of its group, so every rank of an EP group runs
  every MoE layer once per step with the same capacity (token-expert pairs per destination), even
  a rank that has fewer tokens or none: the send buffers have a static shape, rows it does not
  fill weigh 0, and a rank without requests steps one padding request on its scratch slot
  (``idle_step``). The capacity is therefore agreed from the largest batch any rank of the group
  passes (``ep.worst_case_capacity`` never drops a pair); pairs past it are counted on the device
  and ``ep.check_overflow`` reports them.

Callers enter the swap around a step: ``with swapped(ep_swaps(group)): decode_logits(...)``.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..config import ModelConfig
from ..graphs.param_spec import ParamSpec, build_tree, iter_tree
from ..graphs.params import param_specs
from ..graphs.state import scratch_slot
from ..io.loader import ExpertIds
from ..settings import DEFAULTS
from .ep import EPGroup, ep_routed_experts
from .ep_ragged import ep_moe_ragged, ep_routed_experts_ragged, register_group
from .eplb import ExpertPlacement, default_placement, num_physical_experts
from .mesh import MeshSpec
from .rules import expert_ids
from .world import rank_coordinate

EP_PLACE = "moe.expert_parallel"  # the graphs/swap.py place this module fills


def static_shapes(x: torch.Tensor) -> bool:
    """Whether this call is traced (torch.compile, or a fake-tensor dry run): shapes there must not
    depend on the data, so EP sends its static capacity."""
    return torch.compiler.is_compiling() or isinstance(x, FakeTensor)


def ep_swaps(*groups: EPGroup, ragged_traced: bool = False) -> dict[str, Callable[..., torch.Tensor]]:
    """The replacement for ``moe.expert_parallel`` on this rank: the MoE's routed experts run over
    one of ``groups`` (the params it receives must be the rank's local slots, ``rank_params``).
    A draft head with its own expert count (V4.1's DSpark) has a group of its own; a call's
    group is the one whose slots per rank its expert tensors hold, a static shape, so the choice
    costs nothing in a compiled step. Eager steps send only the routed pairs (``ep_ragged.py``);
    compiled steps send the static capacity (``ep.py``), which CUDA graphs capture, or with
    ``ragged_traced`` (the engine's prefill steps on ep > 1) the routed pairs too, through the
    opaque ``deepinfer::ep_moe_ragged`` op (such a graph is not captured)."""
    by_slots = {g.slots_per_rank: g for g in groups}
    if len(by_slots) != len(groups):
        counts = ", ".join(f"{g.placement.n_logical} experts" for g in groups)
        raise ValueError(
            f"expert parallelism: the expert sets ({counts}) fill the same {groups[0].slots_per_rank} slots a rank "
            f"on ep{groups[0].size}, and the EP exchange tells a call's set by its slot count: change the mesh's "
            "ep degree or DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS so that they differ"
        )
    numbers = {s: register_group(g) for s, g in by_slots.items()} if ragged_traced else {}

    def dispatch(
        p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, real: torch.Tensor
    ) -> torch.Tensor:
        slots = p["w1"].shape[0]
        group = by_slots.get(slots)
        if group is None:
            raise ValueError(
                f"expert parallelism: a MoE call holds {slots} expert slots, and this rank's EP groups "
                f"hold {sorted(by_slots)}: its experts were not cut by a placement of this mesh (rank_params)"
            )
        # replica choice by row index: any replica gives the same output (they are copies)
        if not static_shapes(x):
            return ep_routed_experts_ragged(p, limit, x, idx, w, group, real=real)
        if numbers:
            return ep_moe_ragged(p, limit, x, idx, w, real, numbers[slots])
        return ep_routed_experts(p, limit, x, idx, w, group, real=real)

    return {EP_PLACE: dispatch}


def rank_expert_ids(spec: MeshSpec, rank: int, placement: ExpertPlacement | None = None) -> ExpertIds:
    """Stacked expert spec -> the logical experts world ``rank`` holds under ``placement`` (None: no
    redundant experts), in slot order: what ``load_model(..., experts=...)`` takes so that a rank
    reads only its experts, and what ``rank_params`` cuts a full tree with."""
    return partial(expert_ids, mesh=spec, coord=rank_coordinate(spec, rank), experts=placement)


@lru_cache(maxsize=8)
def start_placement(n_logical: int, ep: int, extra: int = DEFAULTS.extra_experts) -> ExpertPlacement:
    """The placement a run starts from, before any load is measured (uniform loads; ``extra``:
    the engine's ``extra_experts``). Deterministic, so every rank computes the same one without
    talking to the others."""
    return default_placement(n_logical, num_physical_experts(n_logical, ep, extra), ep)


def start_expert_ids(spec: MeshSpec, rank: int, extra: int = DEFAULTS.extra_experts) -> ExpertIds:
    """``rank_expert_ids`` under the start placement of each stacked tensor's own expert count:
    the trunk and a draft head with its own experts (V4.1's DSpark: 128) are placed separately."""

    def ids(s: ParamSpec) -> list[int]:
        return rank_expert_ids(spec, rank, start_placement(s.shape[0], spec.ep, extra))(s)

    return ids


def rank_params(params: dict, c: ModelConfig, experts: ExpertIds) -> dict:
    """A full parameter tree cut down to one rank's share, by the rule the loader uses (``experts``,
    from ``rank_expert_ids`` / ``start_expert_ids``): stacked expert tensors keep the rank's
    physical slots (replicas repeat an expert), everything else is shared with ``params`` (no
    copy). For in-memory models; checkpoints are read per rank directly."""
    flat = dict(iter_tree(params))
    for s in param_specs(c):
        if s.stacked and s.path in flat:
            full = flat[s.path]
            flat[s.path] = full[torch.tensor(experts(s), dtype=torch.long, device=full.device)]
    return build_tree(flat)


def idle_step(state: dict, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots, starts, lens)`` of one padding request (scratch slot, length 0): the decode /
    prefill step a rank without requests runs so that its EP group's all-to-alls still complete."""
    return (
        torch.tensor([scratch_slot(state)], device=device),
        torch.zeros(1, dtype=torch.long, device=device),
        torch.zeros(1, dtype=torch.long, device=device),
    )
