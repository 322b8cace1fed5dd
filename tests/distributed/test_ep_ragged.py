"""EP dispatch sized by what is sent (``sharding/ep_ragged.py``): on 2 and 4 gloo ranks the
result equals the single-process ``routed_experts`` and the static-capacity path, with skewed
routing, a rank that routes nothing, a rank that receives nothing and a bucket's padding rows;
it never drops a pair whatever the group's capacity; eager steps take it, traced ones do not."""

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
from deepinfer_fx.sharding.ep import check_overflow, ep_group, ep_routed_experts
from deepinfer_fx.sharding.ep_ragged import ep_routed_experts_ragged
from deepinfer_fx.sharding.mesh import MeshSpec
from deepinfer_fx.sharding.parallel import static_shapes
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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, seed", [(2, 9101), (4, 9201)])
def test_ragged_ep_matches_single_process_and_the_static_path(tmp_path, world: int, seed: int) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), seed), nprocs=world, join=True)


def test_ep1_ragged_runs_without_a_process_group() -> None:
    logical, pl = _experts(9301), _placement(9302, 1, extra=4)
    for t, seed in ((MAX_T, 9303), (7, 9304), (0, 9305)):
        x, idx, w, pos = _batch(seed, t, hot=3)
        got = ep_routed_experts_ragged(_local(logical, pl, 0), LIMIT, x, idx, w, ep_group(pl, MAX_T, K), pos)
        _close(got, _reference(logical, x, idx, w))


def test_traced_steps_take_the_static_path_and_eager_ones_the_ragged() -> None:
    def which(x: torch.Tensor) -> torch.Tensor:
        return x + (1 if static_shapes(x) else 0)

    assert not static_shapes(torch.zeros(2))
    assert int(torch.compile(which, backend="eager", fullgraph=True)(torch.zeros(1))) == 1
    with FakeTensorMode():
        assert static_shapes(torch.zeros(2))
