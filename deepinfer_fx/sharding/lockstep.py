"""Keeping the ranks of a multi-rank engine in step (``LLM(mesh=...)`` under torchrun).

Every rank runs its own engine loop over its own requests (data-parallel attention, see
``parallel.py``), but the MoE region of a step is an all-to-all over the EP group, which needs
every member. So the loops agree, once per turn, on two host-side facts over a gloo group of
the whole world (host flags, whatever the device):

- ``any(busy)``: whether any rank still has work; the loops stop together;
- ``any(launching)``: whether any rank launches a step this turn; a rank with nothing to
  launch then runs an idle step (one padding request) so the others' all-to-alls complete.

Each turn launches at most one forward per rank (eager steps), so agreeing per turn keeps the
collectives of every rank in the same order. Compiled steps split a turn into a decode graph
and a prefill graph, each of a bucketed size; there the ranks also ``agree`` on which graphs run
and on their sizes (the max over ranks), and a rank with less work pads its graphs.

Requests go to ranks (to CP groups, with cp > 1) round-robin by their index in a ``generate``
call (``owns``), and the outputs are gathered back in that order on every rank (``gather``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class LockStep:
    """The host-side agreement of one world of engine loops."""

    def __init__(self, server: int | None = None, servers: int | None = None) -> None:
        """``server`` / ``servers``: which request share this rank serves, of how many (default:
        its rank, of the world; the ranks of a CP group serve one share together)."""
        if not dist.is_initialized():
            raise RuntimeError("LockStep needs the world's process group (init_world) first")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.server = self.rank if server is None else server
        self.servers = self.size if servers is None else servers
        # host flags on a CPU group of their own: no device sync, no interleaving with the EP group
        self.group = dist.new_group(backend="gloo")

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def agree(self, values: list[int]) -> list[int]:
        """The element-wise max of ``values`` over every rank (compiled steps: the graph sizes
        of a turn, so that every rank runs the same graphs and their collectives match)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def owns(self, index: int) -> bool:
        """Whether request ``index`` (of one ``generate`` call) is served by this rank."""
        return index % self.servers == self.server

    def gather(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items``, concatenated in rank order, on every rank."""
        parts: list[list[Any] | None] = [None] * self.size
        dist.all_gather_object(parts, items, group=self.group)
        return [x for part in parts for x in part or []]
