"""Expert parallelism sized by what is sent: the ranks exchange per-destination pair counts
first, then move only the routed pairs (each destination's rows padded to ``GRANULE``), run the
experts and send the results back by the same splits.

Where ``sharding/ep.py`` sends ``capacity`` rows to every destination whatever the routing (a
static shape, so it compiles and is captured), this path reads the counts on the host: its
shapes depend on the data, so it runs in uncaptured steps. Eager steps call it directly;
compiled prefill steps call it as one opaque op, ``deepinfer::ep_moe_ragged``, whose result has
the static shape ``[T, D]`` (``parallel.ep_swaps`` picks which). It never drops a pair. Results
match ``ep_routed_experts``'s: the same replica choice, the same per-row expert math, a token's k
results summed in k order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..graphs.moe import routed_experts
from .ep import EPGroup, _pad
from .eplb import pick_replicas

# Rows per destination are padded to a multiple of this, so that the receive buffers and the expert
# kernels' row counts take few distinct sizes (a padding row has weight 0 and adds exactly 0).
GRANULE = 16
# What every form of the moe.routed_experts place returns whatever x's dtype (the reference, the
# kernels' ops, the batch-invariant one): fp32. A rank's results go back in its local dtype and the
# receive buffer takes it too, unchecked across ranks, so an empty result must be fp32 as well
# (one made in x's float64 read its peers' fp32 bits as float64: docs/decisions.md, ragged EP).
RESULT_DTYPE = torch.float32


def _exchange_counts(counts: torch.Tensor, group: EPGroup) -> torch.Tensor:
    if group.size == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group.process_group)
    return out


def _exchange_rows(t: torch.Tensor, send: list[int], recv: list[int], group: EPGroup) -> torch.Tensor:
    """All-to-all of ``send[r]`` rows to rank r, ``recv[r]`` rows from it; identity on ep1."""
    if group.size == 1:
        return t
    out = t.new_empty((sum(recv), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), recv, send, group=group.process_group)
    return out


def ep_routed_experts_ragged(
    p_local: dict[str, torch.Tensor],
    limit: float,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    group: EPGroup,
    positions: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ep.ep_routed_experts`` (same arguments) with all-to-alls of the routed pairs only."""
    t, k = idx.shape
    d, size, s = x.shape[1], group.size, group.slots_per_rank
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

    order = torch.argsort(dest, stable=True)  # pairs by destination, token-major within one
    counts_all = torch.zeros(size + 1, dtype=torch.long, device=x.device).scatter_add_(0, dest, torch.ones_like(dest))
    counts, starts_all = counts_all[:size], torch.cumsum(counts_all, 0) - counts_all
    padded = (counts + GRANULE - 1) // GRANULE * GRANULE
    recv_padded = _exchange_counts(padded, group)
    send_list, recv_list = padded.tolist(), recv_padded.tolist()  # the one host sync: the splits

    # padded send row (r, c) carries the pair at sorted position starts[r] + c, or the pad pair n
    starts = starts_all[:size]
    padded_starts = torch.cumsum(padded, 0) - padded
    rows = int(sum(send_list))
    group.ragged_sent[0] += rows
    group.ragged_sent[1] += 1
    row_dest = torch.repeat_interleave(torch.arange(size, device=x.device), padded, output_size=rows)
    c = torch.arange(rows, device=x.device) - padded_starts[row_dest]
    src = torch.where(c < counts[row_dest], _pad(order)[(starts[row_dest] + c).clamp(max=n)], n)
    send_x = _pad(x)[src // k]  # pair n // k = token t: the pad row
    send_meta = torch.stack([_pad(slot.int())[src], _pad(w.reshape(-1).float())[src].view(torch.int32)], dim=-1)

    recv_x = _exchange_rows(send_x, send_list, recv_list, group)
    recv_meta = _exchange_rows(send_meta, send_list, recv_list, group)
    if recv_x.shape[0]:
        weights = recv_meta[:, 1:].contiguous().view(torch.float32)
        y = routed_experts(p_local, limit, recv_x, recv_meta[:, :1].long(), weights)
    else:  # nothing routed to this rank's experts: no rows, in the dtype routed_experts returns
        y = x.new_zeros((0, d), dtype=RESULT_DTYPE)
    back = _exchange_rows(y, recv_list, send_list, group)

    # each real pair reads its result row: its destination's first padded row plus its place there
    place = torch.empty_like(dest).scatter_(0, order, torch.arange(n, device=x.device) - starts_all[dest[order]])
    row = torch.where(real_pairs, padded_starts[dest.clamp(max=size - 1)] + place, rows)
    per_pair = _pad(back)[row].view(t, k, d)
    out = per_pair[:, 0]
    for j in range(1, k):  # the fixed summation order of the static path
        out = out + per_pair[:, j]
    return out


# The EP groups compiled steps name by number (an op's arguments are tensors and scalars); a group
# stays registered for the process (one per start or EPLB rebalance), so a number never changes owner.
_GROUPS: dict[int, EPGroup] = {}


def register_group(group: EPGroup) -> int:
    """The number ``ep_moe_ragged`` knows ``group`` by (registered outside any trace)."""
    _GROUPS.setdefault(id(group), group)
    return id(group)


@torch.library.custom_op("deepinfer::ep_moe_ragged", mutates_args=())
def _ep_moe_ragged(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    real: torch.Tensor,
    weights: list[torch.Tensor],
    names: str,
    limit: float,
    group: int,
) -> torch.Tensor:
    """``ep_routed_experts_ragged`` over the registered ``group``; ``weights`` the rank's local
    expert tensors, named by the comma-separated ``names``. Opaque to the compiler: inside it the
    counts are read on the host and the splits follow them, so a graph holding it is not captured."""
    out = ep_routed_experts_ragged(dict(zip(names.split(","), weights)), limit, x, idx, w, _GROUPS[group], real=real)
    return out.contiguous()


@_ep_moe_ragged.register_fake
def _(x, idx, w, real, weights, names, limit, group):
    return x.new_empty((x.shape[0], x.shape[1]), dtype=RESULT_DTYPE)


def ep_moe_ragged(
    p_local: dict[str, torch.Tensor],
    limit: float,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    real: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """The traced form of ``ep_routed_experts_ragged``: the op over the group numbered ``group``."""
    return torch.ops.deepinfer.ep_moe_ragged(x, idx, w, real, list(p_local.values()), ",".join(p_local), limit, group)
