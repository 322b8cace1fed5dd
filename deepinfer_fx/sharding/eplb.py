"""EPLB: redundant experts, their placement on EP ranks, and the run-time shuffle.

Vocabulary. *Logical* experts are the model's (256 for V4-Flash, 384 for V4.1-Flash, 128 for the
V4.1 DSpark drafter). *Physical* experts are the slots of the stacked expert tensors the ranks hold:
``n_physical = ceil((n_logical + extra) / ep) * ep``, so every rank holds the same number of
slots (``Shard(0)`` of the stacked tensor on the ``ep`` axis) and hot experts get extra replicas.
Rank ``r`` owns the contiguous slots ``[r * S, (r + 1) * S)`` with ``S = n_physical / ep``; that
is what makes the physical tensor an ordinary DTensor shard (``rules.local_slice``).

A placement is pure data (``ExpertPlacement``); the router picks a replica per token with
``route_to_physical`` (token position modulo the replica count: deterministic, so a run is
reproducible, and correct whichever replica is hit because replicas are copies). Moving to a new
placement is a list of slot copies (``shuffle``) applied by ``apply_shuffle``; outputs do not
change, which ``tests/distributed/test_expert_shuffle.py`` pins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..settings import DEFAULTS
from .topology import Topology

EXTRA_EXPERTS_ENV = "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"  # EngineConfig.extra_experts


def num_physical_experts(n_routed: int, ep_degree: int, extra: int = DEFAULTS.extra_experts) -> int:
    """Routed + extra rounded UP to a multiple of the EP degree: ``extra`` is a lower bound, so
    256 + 32 on ep64 gives 320 (5 per rank), not 288. The engine passes its ``extra_experts``."""
    for name, v, low in (("n_routed", n_routed, 1), ("ep_degree", ep_degree, 1), ("extra", extra, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"num_physical_experts: {name} must be an integer >= {low}, got {v!r}")
    return math.ceil((n_routed + extra) / ep_degree) * ep_degree


@dataclass(frozen=True)
class ExpertCounts:
    """Logical and physical experts of the trunk and the draft head, rounded separately: the
    drafter's MoE is its own set of stacked tensors (and V4.1's has its own expert count)."""

    trunk_logical: int
    trunk_physical: int
    draft_logical: int  # 0: no draft head
    draft_physical: int


def draft_routed_experts(c: ModelConfig) -> int:
    if c.is_v41 and c.dspark_stages:
        return c.dspark_n_routed_experts  # V4.1's DSpark has its own 128 experts
    if c.dspark_stages or c.num_nextn_predict_layers:
        return c.n_routed_experts  # MTP-1 and V4-0731's DSpark use the trunk's expert count
    return 0


def expert_counts(c: ModelConfig, ep_degree: int, extra: int = DEFAULTS.extra_experts) -> ExpertCounts:
    draft = draft_routed_experts(c)
    return ExpertCounts(
        c.n_routed_experts,
        num_physical_experts(c.n_routed_experts, ep_degree, extra),
        draft,
        num_physical_experts(draft, ep_degree, extra) if draft else 0,
    )


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot holds. Tuples, not lists: a placement is a value
    that can be compared, hashed and shared between threads without copying."""

    phys_to_logical: tuple[int, ...]  # [n_physical]
    logical_to_phys: tuple[tuple[int, ...], ...]  # [n_logical][replicas], ascending slots
    rank_of_phys: tuple[int, ...]  # [n_physical]; slot p is on EP rank p // slots_per_rank

    def __post_init__(self) -> None:
        n = len(self.phys_to_logical)
        if not n or len(self.rank_of_phys) != n:
            raise ValueError("placement: needs at least one slot and a rank for every slot")
        if n % self.ep_degree:
            raise ValueError("placement: every rank must hold the same number of slots")
        if any(r != p // self.slots_per_rank for p, r in enumerate(self.rank_of_phys)):
            raise ValueError("placement: slots must be rank-major (rank r owns [r*S, (r+1)*S))")
        for e, slots in enumerate(self.logical_to_phys):
            if not slots or any(self.phys_to_logical[p] != e for p in slots):
                raise ValueError(f"placement: logical expert {e} has no replica or a wrong slot list {slots}")
        if sum(map(len, self.logical_to_phys)) != n:
            raise ValueError("placement: phys_to_logical holds an expert id outside logical_to_phys")

    @property
    def n_physical(self) -> int:
        return len(self.phys_to_logical)

    @property
    def n_logical(self) -> int:
        return len(self.logical_to_phys)

    @property
    def ep_degree(self) -> int:
        return max(self.rank_of_phys) + 1

    @property
    def slots_per_rank(self) -> int:
        return self.n_physical // self.ep_degree

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """Per-rank load if each expert's tokens split evenly over its replicas (float64)."""
        per_replica = loads.double() / torch.tensor([len(s) for s in self.logical_to_phys], dtype=torch.float64)
        slot_load = per_replica[torch.tensor(self.phys_to_logical)]
        return slot_load.view(self.ep_degree, self.slots_per_rank).sum(1)

    def replica_table(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``[n_logical, max_replicas]`` slot table (padded with the first replica) and counts."""
        width = max(map(len, self.logical_to_phys))
        rows = [list(s) + [s[0]] * (width - len(s)) for s in self.logical_to_phys]
        counts = [len(s) for s in self.logical_to_phys]
        return torch.tensor(rows, device=device), torch.tensor(counts, device=device)


Placement = ExpertPlacement  # the name the sharding issue uses; distinct from DTensor's Placement


def _from_rank_lists(per_rank: list[list[int]], n_logical: int, previous: ExpertPlacement | None) -> ExpertPlacement:
    """Number slots rank-major. Within a rank, an expert that already sat in one of this rank's
    slots under ``previous`` keeps that slot, so a re-plan copies only what really moved."""
    s = len(per_rank[0])
    phys: list[int] = []
    for r, experts in enumerate(per_rank):
        todo = sorted(experts)
        row: list[int | None] = [None] * s
        if previous is not None and previous.slots_per_rank == s:
            for j in range(s):
                e = previous.phys_to_logical[r * s + j]
                if e in todo:
                    row[j] = e
                    todo.remove(e)
        fill = iter(todo)
        phys += [e if e is not None else next(fill) for e in row]
    l2p: list[list[int]] = [[] for _ in range(n_logical)]
    for p, e in enumerate(phys):
        l2p[e].append(p)
    return ExpertPlacement(tuple(phys), tuple(map(tuple, l2p)), tuple(p // s for p in range(len(phys))))


def plan_placement(
    loads: torch.Tensor,
    n_physical: int,
    ep_degree: int,
    topology: Topology | None = None,
    previous: ExpertPlacement | None = None,
) -> ExpertPlacement:
    """Place ``n_physical`` replicas of ``len(loads)`` logical experts on ``ep_degree`` ranks.

    1. Every logical expert gets one replica; each extra replica goes to the expert with the
       highest load per replica (greedy), at most ``ep_degree`` replicas while any expert is below
       that (two copies on one rank take load off nobody).
    2. Replicas are packed largest-first, each onto the rank that (a) does not hold that expert,
       (b) is on a host without that expert (``topology``: spread copies across hosts), and
       (c) has the least load, among ranks with a free slot. Ties go to the lower rank.
    Deterministic: same loads, same placement.
    """
    if loads.dim() != 1 or loads.numel() == 0 or not bool(torch.isfinite(loads).all()) or bool((loads < 0).any()):
        raise ValueError(
            f"plan_placement: loads must be a non-empty 1-D tensor of finite values >= 0, got shape {tuple(loads.shape)}"
        )
    n_logical = loads.numel()
    if n_physical < n_logical or ep_degree < 1 or n_physical % ep_degree:
        raise ValueError(
            f"plan_placement: need n_physical ({n_physical}) >= n_logical ({n_logical}) and a multiple of the EP degree ({ep_degree})"
        )
    topology = topology or Topology.default(ep_degree)
    topology.check_covers(ep_degree)
    load = loads.double().tolist()

    reps = [1] * n_logical
    for _ in range(n_physical - n_logical):
        pool = [e for e in range(n_logical) if reps[e] < ep_degree] or range(n_logical)
        hot = max(pool, key=lambda e: (load[e] / reps[e], -e))
        reps[hot] += 1

    items = sorted(
        ((load[e] / reps[e], e) for e in range(n_logical) for _ in range(reps[e])), key=lambda t: (-t[0], t[1])
    )
    cap = n_physical // ep_degree
    per_rank: list[list[int]] = [[] for _ in range(ep_degree)]
    rank_load = [0.0] * ep_degree
    on_host: dict[tuple[int, int], int] = {}  # (host, expert) -> replicas there
    for w, e in items:
        free = [r for r in range(ep_degree) if len(per_rank[r]) < cap]
        r = min(free, key=lambda r: (e in per_rank[r], on_host.get((topology.host_of(r), e), 0), rank_load[r], r))
        per_rank[r].append(e)
        rank_load[r] += w
        on_host[(topology.host_of(r), e)] = on_host.get((topology.host_of(r), e), 0) + 1
    return _from_rank_lists(per_rank, n_logical, previous)


def default_placement(
    n_logical: int, n_physical: int, ep_degree: int, topology: Topology | None = None
) -> ExpertPlacement:
    """The placement before any load was measured: uniform loads."""
    return plan_placement(torch.ones(n_logical), n_physical, ep_degree, topology)


def physical_experts(logical: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """``[n_logical, ...]`` stacked expert weights -> ``[n_physical, ...]`` under ``placement``."""
    if logical.shape[0] != placement.n_logical:
        raise ValueError(f"physical_experts: tensor has {logical.shape[0]} experts, placement {placement.n_logical}")
    return logical[torch.tensor(placement.phys_to_logical, device=logical.device)]


def shuffle(old: ExpertPlacement, new: ExpertPlacement, topology: Topology | None = None) -> list[tuple[int, int]]:
    """(src slot, dst slot) copies that turn tensors laid out by ``old`` into ``new``'s layout.
    Slots whose expert does not change are left out; a source on the destination's rank is
    preferred (a local copy), then one on its host (NVLink), then the lowest slot."""
    if (old.n_physical, old.n_logical, old.ep_degree) != (new.n_physical, new.n_logical, new.ep_degree):
        raise ValueError(
            f"shuffle: placements differ in shape: old {old.n_logical}->{old.n_physical} on ep{old.ep_degree}, "
            f"new {new.n_logical}->{new.n_physical} on ep{new.ep_degree}"
        )
    topology = topology or Topology.default(new.ep_degree)
    moves = []
    for dst, e in enumerate(new.phys_to_logical):
        if old.phys_to_logical[dst] == e:
            continue
        r = new.rank_of_phys[dst]
        src = min(
            old.logical_to_phys[e],
            key=lambda s: (old.rank_of_phys[s] != r, topology.host_of(old.rank_of_phys[s]) != topology.host_of(r), s),
        )
        moves.append((src, dst))
    return moves


def apply_shuffle(experts: torch.Tensor, moves: list[tuple[int, int]]) -> torch.Tensor:
    """A new ``[n_physical, ...]`` tensor with the moves applied. Out of place on purpose: every
    move reads the OLD layout, and a slot can be both a source and a destination."""
    out = experts.clone()
    if moves:
        src, dst = (torch.tensor(v, device=experts.device) for v in zip(*moves))
        out[dst] = experts[src]
    return out


def route_to_physical(
    logical_idx: torch.Tensor, placement: ExpertPlacement, token_positions: torch.Tensor
) -> torch.Tensor:
    """``[T, k]`` logical expert ids -> physical slots: replica ``position % replicas``. The
    choice depends only on the token's position, never on batch composition, so results are
    reproducible; any replica gives the same output because replicas are copies."""
    table, counts = placement.replica_table(logical_idx.device)
    return pick_replicas(logical_idx, table, counts, token_positions)


def pick_replicas(
    logical_idx: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, token_positions: torch.Tensor
) -> torch.Tensor:
    """``route_to_physical``'s rule over a ``replica_table`` built once: callers that run under a
    captured graph (``ep.ep_routed_experts``) keep the table on the device instead of rebuilding
    it from Python lists every step."""
    replica = token_positions.long().reshape(-1, 1) % counts[logical_idx]
    return table[logical_idx, replica]
