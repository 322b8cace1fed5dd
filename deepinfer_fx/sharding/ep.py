"""Expert parallelism: dispatch token-expert pairs to the ranks holding their experts, run them
there, and combine the results back, with a static capacity per destination rank.

Every step has a static shape and no host synchronisation (no ``.item()``, ``nonzero``, boolean
masks, ``unique``), so the same code runs eagerly, under torch.compile and inside CUDA graphs:

1. each (token, k) pair picks a physical slot (``eplb.pick_replicas``: by token position, so the
   choice never depends on batch composition) and so a destination rank ``slot // S``;
2. a stable sort by destination gives each pair its place in that destination's rows; the first
   ``capacity`` pairs per destination (in token-major pair order) fit, later ones are dropped;
3. the send buffers ``[ep, capacity, D]`` (rows) and ``[ep, capacity, 2]`` (local slot, weight
   bits) are *gathered* from the pairs, so empty rows hold zeros and weight 0: they contribute
   exactly 0 whatever expert slot 0 computes;
4. ``all_to_all_single`` out, ``routed_experts`` on the received rows (k = 1), all-to-all back;
5. each pair reads its result row (a dropped pair reads a zero row) and a token's k results are
   summed in k order: no atomics, so the result is deterministic.

A dropped pair is never silent: it is counted on the device into ``EPGroup.overflow``, and
``check_overflow`` (host side, where the engine synchronises anyway) raises with the numbers.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..graphs.moe import routed_experts
from ..settings import DEFAULTS
from .eplb import ExpertPlacement, pick_replicas


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields have no boolean equality
class EPGroup:
    """This rank's EP group. ``capacity`` counts token-expert pairs that one rank may send to one
    destination rank per call, at most (a call of T tokens sends at most its worst case, T * k);
    it must be the same on every rank (all-to-all splits are equal)."""

    placement: ExpertPlacement
    capacity: int
    rank: int
    size: int
    process_group: dist.ProcessGroup | None  # None only when size == 1: no collectives at all
    replica_slots: torch.Tensor  # [n_logical, max_replicas] physical slots (eplb.replica_table)
    replica_counts: torch.Tensor  # [n_logical]
    overflow: torch.Tensor  # int64 scalar: pairs this rank dropped since the group was made
    loads: torch.Tensor  # int64 [n_logical]: pairs this rank routed to each logical expert (EPLB input)
    # every rank calls with the same row count (the engine's compiled steps run agreed buckets), so a
    # call's capacity may be capped at its own worst case, rows * k, and still agree across the group
    rows_agreed: bool = False
    # [rows, calls] of the ragged path (ep_ragged.py) on this rank: host counts, for the mesh bench
    ragged_sent: list[int] = dataclasses.field(default_factory=lambda: [0, 0])

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank


def worst_case_capacity(max_tokens: int, top_k: int) -> int:
    """Every pair of a full batch going to one rank: a capacity that can never drop a pair."""
    return max(1, max_tokens * top_k)


def capacity_for(max_tokens: int, top_k: int, size: int, factor: float) -> int:
    """Pairs one rank may send to one destination: ``factor`` times the average share
    (``max_tokens * top_k / size``), never above the worst case; ``factor`` 0 is the worst case.
    A factor trades all-to-all bytes for the risk of overflow, which ``check_overflow`` reports."""
    worst = worst_case_capacity(max_tokens, top_k)
    if factor <= 0:
        return worst
    return max(1, min(worst, math.ceil(factor * max_tokens * top_k / size)))


def ep_group(
    placement: ExpertPlacement,
    max_tokens: int,
    top_k: int,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    capacity: int | None = None,
    device: torch.device | str = "cpu",
    capacity_factor: float = DEFAULTS.ep_capacity_factor,
    rows_agreed: bool = False,
) -> EPGroup:
    """The EP group of this rank over ``group`` (a process group or the 1-D ``ep`` view of the world
    mesh, ``world.moe_view``). ``max_tokens`` is the largest batch any rank passes in one call
    (the token bucket); capacity defaults to ``capacity_for(capacity_factor)`` (the engine passes
    ``DEEPINFER_EP_CAPACITY_FACTOR``; 0 is the worst case, which never drops). ``rows_agreed``:
    every rank calls with the same row count (the engine's compiled steps, whose buckets the ranks
    agree), so each call sends at most its own worst case; on one rank that holds anyway."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"ep_group: needs the 1-D ep view of the mesh (world.moe_view), got a {group.ndim}-D mesh")
        rank, size, pg = group.get_local_rank(), group.size(), group.get_group()
    elif group is not None:
        rank, size, pg = dist.get_rank(group), dist.get_world_size(group), group
    else:
        rank, size, pg = 0, 1, None
    if size != placement.ep_degree:
        raise ValueError(
            f"ep_group: the group has {size} ranks but the expert placement is for ep{placement.ep_degree}"
        )
    if size > 1 and pg is None:
        raise ValueError(f"ep_group: ep{size} needs a process group")
    if capacity is None:
        capacity = capacity_for(max_tokens, top_k, size, capacity_factor)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(
            f"ep_group: capacity must be a positive integer (token-expert pairs per destination rank), got {capacity!r}"
        )
    slots, counts = placement.replica_table(device)
    overflow = torch.zeros((), dtype=torch.int64, device=device)
    loads = torch.zeros(placement.n_logical, dtype=torch.int64, device=device)
    return EPGroup(placement, capacity, rank, size, pg, slots, counts, overflow, loads, rows_agreed=rows_agreed)


def check_overflow(group: EPGroup) -> None:
    """Raise if any pair was dropped. Reads the device counter, so call it where the host already
    waits on the device (after a step's results are copied back), not inside a captured step."""
    dropped = int(group.overflow)
    if dropped:
        raise RuntimeError(
            f"EP dispatch on rank {group.rank} of ep{group.size} dropped {dropped} token-expert pair(s): more than "
            f"capacity={group.capacity} pairs went to one destination rank in a call, so those tokens lost "
            f"expert outputs. Raise DEEPINFER_EP_CAPACITY_FACTOR (or ep_group(..., capacity=N)); unset or 0 "
            f"uses the worst case max_tokens * top_k, which never drops."
        )


def _exchange(t: torch.Tensor, group: EPGroup) -> torch.Tensor:
    """All-to-all of equal chunks along dim 0 (chunk r goes to rank r); identity on ep1."""
    if group.size == 1:
        return t
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group.process_group)
    return out


def _pad(t: torch.Tensor) -> torch.Tensor:
    """``t`` plus one zero row at index ``len(t)``: the target of empty and dropped entries, so
    gathers need no masks and a rank with zero tokens still has a row to read."""
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])


def ep_routed_experts(
    p_local: dict[str, torch.Tensor],
    limit: float,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    group: EPGroup,
    positions: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """``routed_experts`` with the experts spread over the EP group: ``p_local`` holds this rank's
    physical slots ``[rank*S, (rank+1)*S)``, ``idx`` logical expert ids. ``positions`` ([T] token
    positions) choose among an expert's replicas; they default to the row index. ``real`` ([T]
    bool, default all): rows that are tokens; a padding row's pairs are neither sent nor counted
    as load, and its output is zero, so a compiled bucket's padding costs no capacity."""
    t, k = idx.shape
    d, cap, size, s = x.shape[1], group.capacity, group.size, group.slots_per_rank
    if group.rows_agreed or size == 1:  # a decode bucket sends its own worst case, not the token budget's
        cap = min(cap, worst_case_capacity(t, k))
    if p_local["w1"].shape[0] != s:
        raise ValueError(f"ep_routed_experts: p_local holds {p_local['w1'].shape[0]} expert slots, this rank owns {s}")
    if positions is None:
        positions = torch.arange(t, device=x.device)
    if real is None:
        real = torch.ones(t, dtype=torch.bool, device=x.device)
    real_pairs = real[:, None].expand(t, k).reshape(-1)
    group.loads.scatter_add_(0, idx.reshape(-1), real_pairs.long())  # measured for EPLB
    phys = pick_replicas(idx, group.replica_slots, group.replica_counts, positions).reshape(-1)
    dest, slot = torch.where(real_pairs, phys // s, size), phys % s  # padding pairs: destination `size`, nowhere
    n = t * k

    # place of each pair among its destination's pairs, in pair order (stable sort keeps it);
    # the padding pairs sort after every real one
    order = torch.argsort(dest, stable=True)
    counts_all = torch.zeros(size + 1, dtype=torch.long, device=x.device).scatter_add_(0, dest, torch.ones_like(dest))
    starts_all = torch.cumsum(counts_all, 0) - counts_all
    counts, starts = counts_all[:size], starts_all[:size]
    place = torch.empty_like(dest).scatter_(0, order, torch.arange(n, device=x.device) - starts_all[dest[order]])
    place = torch.where(real_pairs, place, cap)  # a padding pair reads the zero row, like a dropped one
    group.overflow.add_((counts - cap).clamp(min=0).sum())

    # send row (r, c) carries the pair at sorted position starts[r] + c, or the pad pair n
    c = torch.arange(cap, device=x.device)
    sorted_at = (starts[:, None] + c).clamp(max=n)
    src = torch.where(c < counts[:, None], _pad(order)[sorted_at], n).reshape(-1)
    send_x = _pad(x)[src // k]  # pair n // k = token t: the pad row
    # one int32 metadata exchange: the weight travels as its fp32 bits, exactly
    send_meta = torch.stack([_pad(slot.int())[src], _pad(w.reshape(-1).float())[src].view(torch.int32)], dim=-1)

    recv_x, recv_meta = _exchange(send_x, group), _exchange(send_meta, group)
    y = routed_experts(
        p_local, limit, recv_x, recv_meta[:, :1].long(), recv_meta[:, 1:].contiguous().view(torch.float32)
    )
    back = _exchange(y, group)

    # each pair reads its result row; a dropped pair reads the pad row (zeros)
    row = torch.where(place < cap, dest * cap + place, size * cap)
    per_pair = _pad(back)[row].view(t, k, d)
    out = per_pair[:, 0]
    for j in range(1, k):  # a fixed summation order, the same on every rank and every run
        out = out + per_pair[:, j]
    return out
