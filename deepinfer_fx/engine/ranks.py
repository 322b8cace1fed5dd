"""An ``LLM`` on a multi-rank mesh: ``LLM(model=..., mesh="ep2")`` in every process of
``torchrun --nproc-per-node 2``, each process making the same calls (SPMD).

Each rank loads only its experts (``sharding.parallel.start_expert_ids``), holds them and every
other weight as DTensors on the world mesh (``LLM.mesh_params``; the steps take their local
views), serves its share of every ``generate`` call's requests (round-robin by index) in its own
cache pool, runs the MoE over its EP group (the ``moe.expert_parallel`` swap) and turns its engine
loop in lock step with the others (``sharding.lockstep``); every rank returns all outputs, in
prompt order. Requests keep the ids (and so the sampling seeds) they would have in one process,
so outputs match it. The engine's settings (``EngineConfig``) come in with ``join`` and are handed
to the mesh, the lock step, the placements, the EP group and EPLB from here.

With cp > 1 the ranks of a CP group serve the same requests: each prefill step's chunks are split
zigzag over the group (``sharding.cp``: statically over the bucket in compiled steps, per step on
the host in eager ones), attention gathers its rows over the group, and each row's logits come
from the rank that owns it, so every CP rank samples the same tokens from the same rows.

Compiled steps (the default on GPUs) run a decode and a prefill graph per turn; the ranks agree
each turn on which graphs run and at what bucket (``ModelRunner._plan``, ``LockStep.agree``), so
the all-to-alls inside them pair up. An EPLB shuffle drops the graphs (``StepGraphs.reset``): a
captured graph would replay the old placement tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..api import Model
from ..config import ModelConfig
from ..io.loader import ExpertIds
from ..settings import DEFAULTS, EngineConfig
from ..sharding.cp import ContextRank, cp_swaps
from ..sharding.ep import EPGroup, check_overflow, ep_group
from ..sharding.eplb import ExpertPlacement
from ..sharding.lockstep import LockStep, RankTimeout, is_peer_failure
from ..sharding.mesh import MeshSpec, parse_mesh
from ..sharding.parallel import ep_swaps, rank_params, start_expert_ids, start_placement
from ..sharding.placed import distribute_tree, local_tree
from ..sharding.rebalance import rebalance
from ..sharding.topology import topology_for
from ..sharding.world import init_world, moe_view, rank_coordinate


class EPSwaps(NamedTuple):
    """The expert-parallel swaps of a rank (``sharding.parallel.ep_swaps``): ``steps`` around every
    step (eager steps send the routed pairs, compiled ones the static capacity, which CUDA graphs
    capture); ``prefill`` over them in compiled prefill steps where the EP group has several ranks:
    the routed pairs through the opaque ragged op, in uncaptured graphs. At prefill the static
    capacity is the worst case, a whole bucket's pairs to every rank (sent, and run through the
    experts as zero-weight rows): ep times the work, where one graph launch saves little."""

    steps: dict[str, Callable]
    prefill: dict[str, Callable]


@dataclass
class Ranks:
    spec: MeshSpec
    settings: EngineConfig = DEFAULTS  # the engine's: timeouts, extra experts, capacity, topology
    rank: int = 0
    lockstep: LockStep | None = None  # None: one rank, nothing to agree on
    ep: EPGroup | None = None
    world: Any = None  # the world DeviceMesh
    heads_follow: bool = False  # the draft head's experts sit on the trunk's placement (its expert count)
    draft_ep: EPGroup | None = None  # a DSpark drafter's own EP group where its expert count differs

    @classmethod
    def join(
        cls, mesh: str | None, device: torch.device, settings: EngineConfig = DEFAULTS
    ) -> tuple["Ranks", torch.device]:
        """Parse ``mesh`` and, for more than one rank, join the torchrun world; returns the ranks
        and this rank's device (a GPU rank takes GPU ``LOCAL_RANK``)."""
        spec = parse_mesh(mesh) if mesh else MeshSpec()
        if spec.world_size == 1:
            return cls(spec, settings), device
        world = init_world(spec, device.type, settings.dist_timeout)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        coord = rank_coordinate(spec, dist.get_rank())
        lockstep = LockStep(
            server=coord["dp"] * spec.ep + coord["ep"], servers=spec.dp * spec.ep, timeout=settings.dist_timeout
        )
        return cls(spec, settings, lockstep.rank, lockstep, world=world), device

    @property
    def multi(self) -> bool:
        return self.lockstep is not None

    def turn(self, step: Callable[[], Any]) -> Any:
        """Run one engine turn (``step``). On a multi-rank mesh, a collective inside it that fails
        for want of a peer (an EP all-to-all or CP gather that timed out after
        ``DEEPINFER_DIST_TIMEOUT``, or whose peer closed the connection) becomes the lock-step's
        ``RankTimeout`` naming the ranks that did not answer; the agreements convert their own."""
        if not self.multi:
            return step()
        try:
            return step()
        except RankTimeout:
            raise
        except RuntimeError as e:
            if not is_peer_failure(e):
                raise
            raise (
                self.lockstep.failure(e, f"in a collective of the step after lock-step turn {self.lockstep.turn}") or e
            ) from None

    def experts(self) -> ExpertIds | None:
        """What the loader reads for this rank (None: every expert)."""
        return start_expert_ids(self.spec, self.rank, self.settings.extra_experts) if self.multi else None

    def shard(self, model: Model) -> Model:
        """This rank's share of an in-memory model."""
        if not self.multi:
            return model
        return Model(model.config, rank_params(model.params, model.config, self.experts()), model.path)

    def start_placement(self, n_logical: int) -> ExpertPlacement:
        """The EPLB placement of ``n_logical`` stacked experts before any load is measured."""
        return start_placement(n_logical, self.spec.ep, self.settings.extra_experts)

    def place(self, model: Model) -> tuple[Model, dict | None]:
        """This rank's loaded share as DTensors on the world mesh (``sharding/placed.py``: the
        placements the rules give) and the model the steps run on, over their ``to_local()`` views
        (same storage); on one rank the model as it is and no DTensors."""
        if not self.multi:
            return model, None
        placed = distribute_tree(model.params, model.config, self.world, lambda s: self.start_placement(s.shape[0]))
        return Model(model.config, local_tree(placed), model.path), placed

    def start_ep(self, c: ModelConfig, max_tokens: int, max_seqs: int, device: torch.device) -> EPSwaps:
        """The EP groups of this rank's MoE and the swaps that put them in force. ``max_tokens`` is
        the most tokens one forward packs on any rank (the scheduler's budget): the capacity is
        its worst case, so no pair is ever dropped, unless ``DEEPINFER_EP_CAPACITY_FACTOR`` asks
        for less (``check_overflow`` then reports drops). A DSpark drafter with its own expert
        count (V4.1: 128 of top-3 beside the trunk's 384 of top-6) gets a group of its own over
        the same ranks, sized for ``max_seqs`` draft blocks; an MTP-1 block routes over the
        trunk's count, so the trunk's group serves it."""
        if not self.multi:
            return EPSwaps({}, {})
        self.ep = self._group(c.n_routed_experts, max_tokens, c.num_experts_per_tok, device)
        self.heads_follow = not c.dspark_stages or c.dspark_n_routed_experts == c.n_routed_experts
        if not self.heads_follow:
            rows = max_seqs * c.dspark_block_size
            self.draft_ep = self._group(c.dspark_n_routed_experts, rows, c.dspark_num_experts_per_tok, device)
        return self._swaps()

    def _group(self, n_experts: int, max_tokens: int, top_k: int, device: torch.device) -> EPGroup:
        return ep_group(
            self.start_placement(n_experts),
            max_tokens,
            top_k,
            moe_view(self.world),
            device=device,
            capacity_factor=self.settings.ep_capacity_factor,
            rows_agreed=True,  # static calls come from compiled steps, at the buckets the ranks agreed
        )

    def _swaps(self) -> EPSwaps:
        groups = [g for g in (self.ep, self.draft_ep) if g is not None]
        return EPSwaps(ep_swaps(*groups), ep_swaps(*groups, ragged_traced=True) if self.spec.ep > 1 else {})

    def rebalance(self, params: dict) -> EPSwaps | None:
        """EPLB between steps: re-place the routed experts of every layer by the loads measured
        since the last call, moving ``params``' expert slots in place (a draft head's too where it
        shares the trunk's placement: its MTP-1 drafts run on the same EP group; a DSpark drafter
        with its own group keeps its start placement); the new swaps to use (None on one rank or
        an EP group of one, dp and cp meshes: every expert is local there, so there is nothing to
        balance, and new swaps would only make the steps compile again)."""
        if self.ep is None or self.spec.ep == 1:
            return None
        topology = topology_for(self.settings.topology_file, self.spec.ep)
        blocks = [*params["layers"], *(params.get("mtp", []) if self.heads_follow else [])]
        self.ep = rebalance(self.ep, [b["ffn"]["experts"] for b in blocks], topology)
        return self._swaps()

    def cp_split(self) -> tuple[dict[str, Callable], ContextRank | None]:
        """With cp > 1: the swap that gathers rows over this rank's CP group and this rank's place
        in it (which cuts a step's chunks to its share); else nothing."""
        if not self.multi or self.spec.cp == 1:
            return {}, None
        cp_rank = rank_coordinate(self.spec, self.rank)["cp"]
        return cp_swaps(self.world.get_group("cp")), ContextRank(cp_rank, self.spec.cp)

    def mine(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share of one call's requests."""
        return list(items) if not self.multi else [x for i, x in enumerate(items) if self.lockstep.owns(i)]

    def gather(self, keyed: list[tuple[int, Any]]) -> list[Any]:
        """Every rank's ``(request id, output)`` pairs -> all outputs ordered by request id, on
        every rank; raises if any rank's EP dispatch dropped a pair (read here, where the host
        has waited for the results anyway)."""
        for group in (self.ep, self.draft_ep):
            if group is not None:
                check_overflow(group)
        if self.multi:  # a CP group's ranks hold the same outputs: its first rank speaks for it
            keyed = self.lockstep.gather(keyed if rank_coordinate(self.spec, self.rank)["cp"] == 0 else [])
        return [out for _, out in sorted(keyed, key=lambda kv: kv[0])]
