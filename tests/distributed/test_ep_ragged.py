"""EP dispatch sized by what is sent (``sharding/ep_ragged.py``): on 2 and 4 gloo ranks the
result equals the single-process ``routed_experts`` and the static-capacity path, with skewed
routing, a rank that routes nothing, a rank that receives nothing and a bucket's padding rows;
so it does in float64 after an EPLB rebalance (where a rank that received nothing once read its
peers' fp32 results as float64); it never drops a pair whatever the group's capacity; eager
steps take it, traced ones only through the opaque op of compiled prefill steps (same bits)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_ep_dispatch import (
    E,
    K,
    LIMIT,
    MAX_T,
    _all_to_one_rank,
    _batch,
    _close,
    _experts,
    _local,
    _placement,
    _reference,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from deepinfer_fx.graphs.moe import routed_experts
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.ep import check_overflow, ep_group, ep_routed_experts
from deepinfer_fx.sharding.ep_ragged import ep_routed_experts_ragged
from deepinfer_fx.sharding.mesh import MeshSpec
from deepinfer_fx.sharding.parallel import EP_PLACE, ep_swaps, static_shapes
from deepinfer_fx.sharding.rebalance import rebalance
from deepinfer_fx.sharding.world import build_mesh, moe_view


def _both(p_local, x, idx, w, fresh, pos, real=None) -> torch.Tensor:
    """The ragged result, checked against the static path's and for its loads; never an overflow."""
    ragged, static = fresh(1), fresh()  # the ragged path ignores the capacity: 1 would drop nearly every pair
    got = ep_routed_experts_ragged(p_local, LIMIT, x, idx, w, ragged, pos, real=real)
    _close(got, ep_routed_experts(p_local, LIMIT, x, idx, w, static, pos, real=real))
    assert int(ragged.overflow) == 0 and torch.equal(ragged.loads, static.loads)
    check_overflow(static)
    return got


def _worker(rank: int, world: int, init_file: str, seed: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    torch.set_num_threads(1)  # equality across processes: one intra-op thread a rank (docs/decisions.md)
    try:
        logical = _experts(seed)
        pl = _placement(seed + 1, world, extra=5)
        p_local = _local(logical, pl, rank)
        where = dist.group.WORLD if world == 2 else moe_view(build_mesh(MeshSpec(ep=world)))
        fresh = lambda capacity=None: ep_group(pl, MAX_T, K, where, capacity)  # noqa: E731
        mine = seed + 100 * (rank + 1)

        # 1. uniform routing, a different token count on every rank; the same bits run after run
        t = int(torch.randint(1, MAX_T + 1, (1,), generator=torch.Generator().manual_seed(mine)))
        x, idx, w, pos = _batch(mine + 1, t)
        got = _both(p_local, x, idx, w, fresh, pos)
        assert got.shape == (t, logical["w2"].shape[1])
        _close(got, routed_experts(logical, LIMIT, x, idx, w))
        assert torch.equal(got, ep_routed_experts_ragged(p_local, LIMIT, x, idx, w, fresh(), pos))

        # 2. skewed onto one hot (replicated) expert; rank 1 routes nothing
        hot = max(range(E), key=lambda e: len(pl.logical_to_phys[e]))
        x, idx, w, pos = _batch(mine + 2, 0 if rank == 1 else MAX_T, hot=hot)
        _close(_both(p_local, x, idx, w, fresh, pos), _reference(logical, x, idx, w))

        # 3. every rank sends everything to rank 0: the others receive nothing at all
        x, idx, w, pos = _all_to_one_rank(mine + 3, pl, 0, MAX_T)
        _close(_both(p_local, x, idx, w, fresh, pos), routed_experts(logical, LIMIT, x, idx, w))

        # 4. a bucket's padding rows send nothing, count no load and come back as zeros
        x, idx, w, pos = _batch(mine + 4, 2 * MAX_T)
        real = torch.zeros(2 * MAX_T, dtype=torch.bool)
        real[torch.randperm(2 * MAX_T, generator=torch.Generator().manual_seed(mine + 5))[:MAX_T]] = True
        got = _both(p_local, x, idx, w, fresh, pos, real)
        _close(got, routed_experts(logical, LIMIT, x, idx, w * real[:, None]))
        assert torch.equal(got[~real], torch.zeros_like(got[~real]))

        # 5. (4 ranks) over a sub-group: dp2 x ep2
        if world == 4:
            sub = moe_view(build_mesh(MeshSpec(dp=2, ep=2)))
            pl2 = _placement(seed + 2, 2, extra=3)
            x, idx, w, pos = _batch(mine + 6, MAX_T - rank)
            grp = ep_group(pl2, MAX_T, K, sub)
            got = ep_routed_experts_ragged(_local(logical, pl2, grp.rank), LIMIT, x, idx, w, grp, pos)
            _close(got, routed_experts(logical, LIMIT, x, idx, w))

        # 6. compiled (a prefill step's swap): one opaque op, the eager ragged path's bits, its loads counted
        x, idx, w, _ = _batch(mine + 7, MAX_T - rank)
        real = torch.ones(x.shape[0], dtype=torch.bool)
        traced, eager, graphs = fresh(), fresh(), []
        dispatch = ep_swaps(traced, ragged_traced=True)[EP_PLACE]
        keep = lambda gm, _: graphs.append(gm) or gm.forward  # noqa: E731
        got = torch.compile(lambda *a: dispatch(p_local, LIMIT, *a), backend=keep, fullgraph=True)(x, idx, w, real)
        assert torch.equal(got, ep_routed_experts_ragged(p_local, LIMIT, x, idx, w, eager, real=real))
        assert torch.equal(traced.loads, eager.loads) and int(traced.loads.sum()) == x.shape[0] * K
        targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        assert targets == ["deepinfer.ep_moe_ragged"], targets  # the op alone: no all-to-all, no graph break
    finally:
        dist.destroy_process_group()


def _rebalanced_worker(rank: int, init_file: str, seed: int) -> None:
    """2 ranks, float64 activations (as tests/distributed/test_eplb_runtime.py runs the model)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    torch.set_num_threads(1)  # equality across processes: one intra-op thread a rank (docs/decisions.md)
    try:
        logical = {n: v.double() for n, v in _experts(seed).items()}
        start = eplb.default_placement(E, eplb.num_physical_experts(E, 2, 4), 2)
        group = ep_group(start, MAX_T, K, dist.group.WORLD)
        p_local = _local(logical, start, rank)
        mine = seed + 100 * (rank + 1)
        # loads skewed onto expert 3, measured by the ragged path, re-place the experts: 3 gets a replica a rank
        x, idx, w, pos = _batch(mine, MAX_T, hot=3)
        ep_routed_experts_ragged(p_local, LIMIT, x.double(), idx, w, group, pos)
        group = rebalance(group, [p_local])
        pl = group.placement
        assert pl != start and sorted(pl.rank_of_phys[p] for p in pl.logical_to_phys[3]) == [0, 1]
        assert all(torch.equal(v, _local(logical, pl, rank)[n]) for n, v in p_local.items())
        fresh = lambda capacity=None: ep_group(pl, MAX_T, K, dist.group.WORLD, capacity)  # noqa: E731

        # 1. skewed onto the replicated expert, through the group rebalance returned
        x, idx, w, pos = _batch(mine + 1, MAX_T, hot=3)
        got = ep_routed_experts_ragged(p_local, LIMIT, x.double(), idx, w, group, pos)
        _close(got, _both(p_local, x.double(), idx, w, fresh, pos))
        _close(got, routed_experts(logical, LIMIT, x.double(), idx, w))

        # 2. every pair to rank 0: rank 1 receives nothing, yet its peers' fp32 results come back right
        x, idx, w, pos = _all_to_one_rank(mine + 2, pl, 0, MAX_T)
        _close(_both(p_local, x.double(), idx, w, fresh, pos), routed_experts(logical, LIMIT, x.double(), idx, w))

        # 3. rank 1 routes nothing as well: it sends and receives nothing, and returns no rows in fp32
        x, idx, w, pos = _all_to_one_rank(mine + 3, pl, 0, MAX_T) if rank == 0 else _batch(mine + 3, 0)
        _close(_both(p_local, x.double(), idx, w, fresh, pos), _reference(logical, x.double(), idx, w))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, seed", [(2, 9101), (4, 9201)])
def test_ragged_ep_matches_single_process_and_the_static_path(tmp_path, world: int, seed: int) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), seed), nprocs=world, join=True)


def test_ragged_ep_after_a_rebalance_in_float64(tmp_path) -> None:
    mp.spawn(_rebalanced_worker, args=(str(tmp_path / "rendezvous"), 9401), nprocs=2, join=True)


def test_ep1_ragged_runs_without_a_process_group() -> None:
    logical, pl = _experts(9301), _placement(9302, 1, extra=4)
    for t, seed, dtype in ((MAX_T, 9303, torch.float32), (7, 9304, torch.float32), (0, 9305, torch.float64)):
        x, idx, w, pos = _batch(seed, t, hot=3)
        p = {n: v.to(dtype) for n, v in _local(logical, pl, 0).items()}
        got = ep_routed_experts_ragged(p, LIMIT, x.to(dtype), idx, w, ep_group(pl, MAX_T, K), pos)
        _close(got, _reference(logical, x, idx, w))  # fp32 whatever x's dtype, no rows included


def test_traced_steps_take_the_static_path_and_eager_ones_the_ragged() -> None:
    def which(x: torch.Tensor) -> torch.Tensor:
        return x + (1 if static_shapes(x) else 0)

    assert not static_shapes(torch.zeros(2))
    assert int(torch.compile(which, backend="eager", fullgraph=True)(torch.zeros(1))) == 1
    with FakeTensorMode():
        assert static_shapes(torch.zeros(2))
