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

A rank that stalls or dies must not hang the others: every agreement waits at most
``DEEPINFER_DIST_TIMEOUT`` seconds (the group's timeout; gloo then raises), and ``failure``
turns that error, or one from a collective inside a step (``Ranks.turn``), into a
``RankTimeout`` naming the ranks that did not answer, the lock-step turn and the timeout. Which
ranks: the ranks that fail post their name to the job's rendezvous store (a roll call, only
after a failure, so no turn pays for it) and wait a few seconds for the others; whoever has not
posted is the stalled or dead one. Every rank makes the same agreements in the same order, so
the turn count (``turn``, the agreements made so far) names the same moment on every rank.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..settings import DEFAULTS
from .world import TIMEOUT_VAR

ROLL_CALL_S = 3.0  # how long a failing rank waits for the others to post: they fail within ms of it


class RankTimeout(RuntimeError):
    """A peer rank stopped answering a collective; the message names it, the turn and the timeout."""


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed for want of a peer (timed out, connection
    closed) rather than a bug in this rank: c10d's own error types, or gloo's transport errors,
    which reach Python as plain RuntimeErrors naming gloo's source."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and "gloo" in str(e).lower()


class LockStep:
    """The host-side agreement of one world of engine loops."""

    def __init__(
        self, server: int | None = None, servers: int | None = None, timeout: float = DEFAULTS.dist_timeout
    ) -> None:
        """``server`` / ``servers``: which request share this rank serves, of how many (default:
        its rank, of the world; the ranks of a CP group serve one share together). ``timeout``:
        seconds an agreement waits for the other ranks (the engine passes ``DEEPINFER_DIST_TIMEOUT``)."""
        if not dist.is_initialized():
            raise RuntimeError("LockStep needs the world's process group (init_world) first")
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.server = self.rank if server is None else server
        self.servers = self.size if servers is None else servers
        self.timeout = float(timeout)
        # host flags on a CPU group of their own: no device sync, no interleaving with the EP group
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        self.turn = 0  # agreements made so far (the same sequence on every rank)

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        t = torch.tensor([int(flag)])
        self._agreement("whether any rank has work", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group))
        return bool(t.item())

    def agree(self, values: list[int]) -> list[int]:
        """The element-wise max of ``values`` over every rank (compiled steps: the graph sizes
        of a turn, so that every rank runs the same graphs and their collectives match)."""
        t = torch.tensor(values, dtype=torch.int64)
        self._agreement(
            "the sizes of this turn's graphs", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        )
        return t.tolist()

    def _agreement(self, what: str, collective: Callable[[], Any]) -> None:
        self.turn += 1
        try:
            collective()
        except RuntimeError as e:  # on this group every error is a peer's: the tensors are ours
            raise self.failure(e, f"at lock-step turn {self.turn} (agreeing on {what})") or e from None

    def failure(self, error: BaseException, where: str) -> RankTimeout | None:
        """The error to raise for a collective that failed with ``error`` ``where`` (a phrase):
        a ``RankTimeout`` naming the ranks that did not answer the roll call, or None when every
        rank answered (then no rank stalled and the original error is the one to see)."""
        missing = self._roll_call()
        if missing == []:
            return None
        who = (
            "a peer rank (the rendezvous store could not say which)"
            if missing is None
            else ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
        )
        detail = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        return RankTimeout(
            f"rank {self.rank} of {self.size}: {who} did not answer {where}; collectives wait "
            f"{TIMEOUT_VAR}={self.timeout:g} s for a peer, and this one failed [{type(error).__name__}: {detail}]. "
            f"The job cannot go on without {'it' if missing is None or len(missing) == 1 else 'them'}, so it stops here: "
            f"look at that rank's own output (it died or hangs), or raise {TIMEOUT_VAR} if it is only slow (a long compile, say)."
        )

    def _roll_call(self) -> list[int] | None:
        """The ranks that have not posted to the roll call within ``ROLL_CALL_S`` of this rank
        (which posts itself): each rank that fails posts, the stalled or dead ones never do.
        None when the store is out of reach (outside torchrun, rank 0 hosts it and may be the
        dead one)."""
        try:
            store = dist.PrefixStore(
                f"deepinfer/lockstep/{self.group.group_name}/roll/", dist.distributed_c10d._get_default_store()
            )
            store.set(str(self.rank), str(self.turn))
            deadline = time.monotonic() + min(ROLL_CALL_S, self.timeout)
            while True:
                missing = [r for r in range(self.size) if not store.check([str(r)])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - any store failure leaves the question open, not the job hanging
            return None

    def owns(self, index: int) -> bool:
        """Whether request ``index`` (of one ``generate`` call) is served by this rank."""
        return index % self.servers == self.server

    def gather(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items``, concatenated in rank order, on every rank."""
        parts: list[list[Any] | None] = [None] * self.size
        self._agreement("every rank's outputs", lambda: dist.all_gather_object(parts, items, group=self.group))
        return [x for part in parts for x in part or []]
