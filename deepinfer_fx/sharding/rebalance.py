"""EPLB at run time: measured expert loads -> a new placement -> expert slots moved between the
ranks of an EP group, between steps.

Every ``ep_routed_experts`` call adds the pairs it routed to each logical expert to the group's
device counter (no host sync). ``rebalance`` runs where the host already waits (between
``generate`` calls, or every N steps of a long run): it sums the counters over the EP group,
plans the placement those loads ask for (``eplb.plan_placement`` is deterministic, so every
rank plans the same one without further talk), moves only the slots whose expert changes (a
local copy when the rank already holds the expert, else point-to-point from the old holder the
shuffle picked: the nearest one) and returns the group under the new placement with fresh
counters. Replicas are copies, so outputs do not change; only where the work lands does.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .ep import EPGroup
from .eplb import plan_placement, shuffle
from .topology import Topology


def rebalance(group: EPGroup, experts: list[dict[str, torch.Tensor]], topology: Topology | None = None) -> EPGroup:
    """Re-place the experts of ``group`` by its measured loads. ``experts``: every MoE layer's
    local expert tensors (``{"w1", "w3", "w2"}`` stacked by slot, plus ``w1_scale``... for experts
    held in fp8: every tensor of the dict moves), rewritten in place in the new
    layout (one placement serves every layer; the tensors keep their storage). Returns the new group (the old one must not be
    used again: its tables describe the old layout)."""
    loads = group.loads.clone()
    if group.process_group is not None:
        dist.all_reduce(loads, group=group.process_group)
    old = group.placement
    new = plan_placement(loads.double().cpu(), old.n_physical, old.ep_degree, topology, previous=old)
    moves = shuffle(old, new, topology)
    if moves:
        for tensors in experts:
            for name in tensors:
                tensors[name].copy_(move_slots(tensors[name], moves, group))  # same storage: DTensors over it stay true
    slots, counts = new.replica_table(group.loads.device)
    return dataclasses.replace(
        group, placement=new, replica_slots=slots, replica_counts=counts, loads=torch.zeros_like(group.loads)
    )


def move_slots(local: torch.Tensor, moves: list[tuple[int, int]], group: EPGroup) -> torch.Tensor:
    """This rank's ``[S, ...]`` slots after the (src slot, dst slot) ``moves`` (global slot ids,
    read from the OLD layout): copies within the rank, sends and receives across it."""
    s, me = group.slots_per_rank, group.rank
    out = local.clone()
    ops = []
    for src, dst in moves:
        src_rank, dst_rank = src // s, dst // s
        if dst_rank == me and src_rank == me:
            out[dst % s] = local[src % s]
        elif dst_rank == me:
            ops.append(
                dist.P2POp(
                    dist.irecv,
                    out[dst % s],
                    dist.get_global_rank(group.process_group, src_rank),
                    group.process_group,
                    tag=dst,
                )
            )
        elif src_rank == me:
            ops.append(
                dist.P2POp(
                    dist.isend,
                    local[src % s].contiguous(),
                    dist.get_global_rank(group.process_group, dst_rank),
                    group.process_group,
                    tag=dst,
                )
            )
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out
