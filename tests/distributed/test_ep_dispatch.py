"""Expert-parallel dispatch/combine (``sharding/ep.py``): on 2 and 4 gloo ranks the EP result equals
the single-process ``routed_experts`` over all experts, a too-small capacity is counted and
reported (never silent), the worst-case capacity never drops, and the code has no host sync."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.fx.experimental.proxy_tensor import make_fx

from deepinfer_fx.engine.ranks import Ranks
from deepinfer_fx.graphs.moe import routed_experts, swiglu_act
from deepinfer_fx.settings import EngineConfig
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding import ep as ep_mod
from deepinfer_fx.sharding import parallel
from deepinfer_fx.sharding.ep import check_overflow, ep_group, ep_routed_experts
from deepinfer_fx.sharding.mesh import MeshSpec
from deepinfer_fx.sharding.world import build_mesh, fake_world, moe_view

E, K, D, I, LIMIT, MAX_T = 12, 3, 16, 24, 7.0, 20
EXTRA = eplb.EXTRA_EXPERTS_ENV


def _experts(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(E, I, D, generator=g) * D**-0.5,
        "w3": torch.randn(E, I, D, generator=g) * D**-0.5,
        "w2": torch.randn(E, D, I, generator=g) * I**-0.5,
    }


def _batch(seed: int, t: int, hot: int | None = None) -> tuple[torch.Tensor, ...]:
    """x, distinct expert ids per token, weights, positions. With ``hot``, ~90 % of the tokens
    pick that expert (it is forced into their top-k)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, E, generator=g)
    if hot is not None:
        scores[torch.rand(t, generator=g) < 0.9, hot] = 2.0
    idx = scores.topk(K, dim=1).indices
    return (
        torch.randn(t, D, generator=g),
        idx,
        torch.rand(t, K, generator=g) + 0.1,
        torch.randint(0, 10_000, (t,), generator=g),
    )


def _placement(seed: int, ep: int, extra: int) -> eplb.ExpertPlacement:
    loads = torch.rand(E, generator=torch.Generator().manual_seed(seed)) ** 4 * 100
    pl = eplb.plan_placement(loads, eplb.num_physical_experts(E, ep, extra), ep)
    assert pl.n_physical > E and max(map(len, pl.logical_to_phys)) > 1  # really redundant experts
    return pl


def _local(logical: dict[str, torch.Tensor], pl: eplb.ExpertPlacement, rank: int) -> dict[str, torch.Tensor]:
    s = pl.slots_per_rank
    return {n: eplb.physical_experts(v, pl)[rank * s : (rank + 1) * s] for n, v in logical.items()}


def _kept(idx: torch.Tensor, pos: torch.Tensor, pl: eplb.ExpertPlacement, capacity: int) -> torch.Tensor:
    """The documented drop policy, on the host: per destination rank the first ``capacity`` pairs
    in token-major order are sent, later ones dropped. -> [T, k] 0/1 mask."""
    dest = (eplb.route_to_physical(idx, pl, pos) // pl.slots_per_rank).tolist()
    seen = [0] * pl.ep_degree
    kept = torch.zeros(idx.shape)
    for t, row in enumerate(dest):
        for j, r in enumerate(row):
            kept[t, j] = float(seen[r] < capacity)
            seen[r] += 1
    return kept


def _all_to_one_rank(seed: int, pl: eplb.ExpertPlacement, dest: int, t: int) -> tuple[torch.Tensor, ...]:
    """A batch whose every pair lands on rank ``dest``: random tokens over the experts with a
    replica there, kept only when the position-chosen replicas all sit on ``dest``."""
    g = torch.Generator().manual_seed(seed)
    there = [e for e in range(E) if any(pl.rank_of_phys[p] == dest for p in pl.logical_to_phys[e])]
    rows, poss = [], []
    while len(rows) < t:
        row = torch.tensor(there)[torch.randperm(len(there), generator=g)[:K]]
        pos = torch.randint(0, 10_000, (1,), generator=g)
        if all(pl.rank_of_phys[p] == dest for p in eplb.route_to_physical(row[None], pl, pos)[0].tolist()):
            rows.append(row)
            poss.append(pos)
    return torch.randn(t, D, generator=g), torch.stack(rows), torch.rand(t, K, generator=g) + 0.1, torch.cat(poss)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _reference(logical: dict[str, torch.Tensor], x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Single-process routed_experts over all experts. An empty batch's answer is written out: the
    reference itself is not asked about T = 0 (its body is being rewritten; EP never calls it so)."""
    return routed_experts(logical, LIMIT, x, idx, w) if len(x) else torch.zeros(0, D)


def _host_syncs(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes of a fake-mode trace that read device data on the host (``.item``/``.tolist``/``int``
    become ``_local_scalar_dense``) or whose shape depends on data (nonzero, boolean masks,
    unique, bincount get unbacked symbolic sizes)."""
    bad = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        tensors = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
        if n.target is torch.ops.aten._local_scalar_dense.default or any(
            not all(isinstance(d, int) for d in v.shape) for v in tensors
        ):
            bad.append(n.name)
    return bad


def _worker(rank: int, world: int, init_file: str, seed: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        logical = _experts(seed)
        pl = _placement(seed + 1, world, extra=5)
        p_local = _local(logical, pl, rank)
        # 2 ranks: the default process group; 4 ranks: the ep view of the world mesh
        where = dist.group.WORLD if world == 2 else moe_view(build_mesh(MeshSpec(ep=world)))
        fresh = lambda capacity=None: ep_group(pl, MAX_T, K, where, capacity)  # noqa: E731
        mine = seed + 100 * (rank + 1)

        # 1. uniform routing, a different token count on every rank; deterministic across runs
        t = int(torch.randint(1, MAX_T + 1, (1,), generator=torch.Generator().manual_seed(mine)))
        x, idx, w, pos = _batch(mine + 1, t)
        grp = fresh()
        got = ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos)
        assert got.dtype == torch.float32 and got.shape == (t, D)
        _close(got, routed_experts(logical, LIMIT, x, idx, w))
        assert torch.equal(got, ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos))
        assert int(grp.overflow) == 0

        # 2. skewed routing onto one hot (replicated) expert; rank 1 has no tokens at all
        hot = max(range(E), key=lambda e: len(pl.logical_to_phys[e]))
        x, idx, w, pos = _batch(mine + 2, 0 if rank == 1 else MAX_T, hot=hot)
        grp = fresh()
        got = ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos)
        _close(got, _reference(logical, x, idx, w))
        check_overflow(grp)

        # 3. too small a capacity: exactly the pairs past it are dropped and counted, the rest is
        # exact; the rank with no tokens drops nothing and does not raise
        cap = 2
        grp = fresh(cap)
        got = ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos)
        kept = _kept(idx, pos, pl, cap)
        _close(got, _reference(logical, x, idx, w * kept))
        assert int(grp.overflow) == int((1 - kept).sum())
        if rank == 1:
            check_overflow(grp)
        else:
            assert int(grp.overflow) > 0
            with pytest.raises(
                RuntimeError,
                match=rf"dropped {int(grp.overflow)} token-expert.*capacity={cap}.*Raise DEEPINFER_EP_CAPACITY_FACTOR",
            ):
                check_overflow(grp)

        # 4. every pair of a full batch goes to one rank: the worst-case default holds all of them,
        # one pair less drops exactly the last pair
        x, idx, w, pos = _all_to_one_rank(mine + 3, pl, (rank + 1) % world, MAX_T)
        grp = fresh()
        assert grp.capacity == MAX_T * K
        _close(ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos), routed_experts(logical, LIMIT, x, idx, w))
        check_overflow(grp)
        grp = fresh(MAX_T * K - 1)
        got = ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos)
        assert int(grp.overflow) == 1
        last = torch.ones(MAX_T, K)
        last[-1, -1] = 0
        _close(got, routed_experts(logical, LIMIT, x, idx, w * last))

        # 6. a compiled bucket's padding: twice MAX_T rows of which the real ones fit the capacity;
        # padding rows send nothing (no overflow, no load) and come back as zeros
        x, idx, w, pos = _all_to_one_rank(mine + 5, pl, (rank + 1) % world, 2 * MAX_T)
        real = torch.zeros(2 * MAX_T, dtype=torch.bool)
        real[torch.randperm(2 * MAX_T, generator=torch.Generator().manual_seed(mine + 6))[:MAX_T]] = True
        grp = fresh()
        got = ep_routed_experts(p_local, LIMIT, x, idx, w, grp, pos, real=real)
        check_overflow(grp)
        _close(got, routed_experts(logical, LIMIT, x, idx, w * real[:, None]))
        assert torch.equal(got[~real], torch.zeros_like(got[~real]))
        assert int(grp.loads.sum()) == MAX_T * K

        # 5. (4 ranks) EP over a sub-group: dp2 x ep2, each EP group its own pair of ranks
        if world == 4:
            sub = moe_view(build_mesh(MeshSpec(dp=2, ep=2)))
            pl2 = _placement(seed + 2, 2, extra=3)
            x, idx, w, pos = _batch(mine + 4, MAX_T - rank)
            grp = ep_group(pl2, MAX_T, K, sub)
            assert (grp.rank, grp.size) == (rank % 2, 2)
            got = ep_routed_experts(_local(logical, pl2, grp.rank), LIMIT, x, idx, w, grp, pos)
            _close(got, routed_experts(logical, LIMIT, x, idx, w))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, seed", [(2, 8601), (4, 8701)])
def test_ep_matches_single_process(tmp_path, world: int, seed: int) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), seed), nprocs=world, join=True)


def test_ep1_runs_without_a_process_group() -> None:
    logical, pl = _experts(8801), _placement(8802, 1, extra=4)
    grp = ep_group(pl, MAX_T, K)
    assert grp.process_group is None and grp.capacity == MAX_T * K
    for t, seed in ((MAX_T, 8803), (7, 8804), (0, 8805)):
        x, idx, w, pos = _batch(seed, t, hot=3)
        _close(ep_routed_experts(_local(logical, pl, 0), LIMIT, x, idx, w, grp, pos), _reference(logical, x, idx, w))
    check_overflow(grp)
    with pytest.raises(ValueError, match="placement is for ep4"):
        ep_group(_placement(8806, 4, extra=4), MAX_T, K)
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        ep_group(pl, MAX_T, K, capacity=0)


def _dense_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A sync-free stand-in for the local expert math (one expert per row, as EP calls it), so the
    trace below checks ep.py's own dispatch and combine whatever routed_experts' body is today."""
    s = idx[:, 0]
    gate = torch.einsum("nd,nid->ni", x, p["w1"][s])
    up = torch.einsum("nd,nid->ni", x, p["w3"][s])
    return torch.einsum("ni,ndi->nd", swiglu_act(gate, up, limit) * w, p["w2"][s])


def test_dispatch_and_combine_have_no_host_sync(monkeypatch) -> None:
    """A fake-mode trace of ep1 and ep4 has no host sync (``_host_syncs``); the traced ep1 graph
    replays fresh inputs exactly as eager does, overflow count included."""
    monkeypatch.setattr(ep_mod, "routed_experts", _dense_experts)
    # the check has teeth: each kind of sync is caught, a static sort/cumsum is not
    syncing = (
        lambda v: v[v > 0],
        lambda v: v * v.sum().item(),
        lambda v: v * v.long().tolist()[0],
        torch.nonzero,
        torch.unique,
    )
    for f in syncing:
        assert _host_syncs(make_fx(f, tracing_mode="fake")(torch.randn(6)))
    assert not _host_syncs(make_fx(lambda v: v.sort().values.cumsum(0), tracing_mode="fake")(torch.randn(6)))

    logical, pl = _experts(8901), _placement(8902, 1, extra=4)
    p = _local(logical, pl, 0)

    def step(
        p: dict, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grp = ep_group(pl, MAX_T, K, capacity=9)
        return ep_routed_experts(p, LIMIT, x, idx, w, grp, pos), grp.overflow

    traced = make_fx(step, tracing_mode="fake")(p, *_batch(8903, MAX_T))
    assert _host_syncs(traced) == []
    x, idx, w, pos = _batch(8904, MAX_T, hot=5)
    (got, dropped), (want, want_dropped) = traced(p, x, idx, w, pos), step(p, x, idx, w, pos)
    assert torch.equal(got, want) and int(dropped) == int(want_dropped) > 0
    _close(got, routed_experts(logical, LIMIT, x, idx, w * _kept(idx, pos, pl, 9)))

    pl4 = _placement(8905, 4, extra=4)
    with fake_world(4, rank=2):
        grp = ep_group(pl4, MAX_T, K, dist.group.WORLD)
        rank2 = lambda x, idx, w, pos: ep_routed_experts(_local(logical, pl4, 2), LIMIT, x, idx, w, grp, pos)  # noqa: E731
        traced = make_fx(rank2, tracing_mode="fake", _allow_non_fake_inputs=True)(*_batch(8906, MAX_T))
    assert _host_syncs(traced) == []
    assert sum("alltoall" in str(n.target) for n in traced.graph.nodes) == 3
    # a group sized for a large token budget sends it whole, unless the ranks' row counts are
    # agreed (the engine's compiled buckets): then a call sends its own worst case, 4 x rows x k
    for agreed, rows in ((False, 4 * 1000 * K), (True, 4 * MAX_T * K)):
        with fake_world(4, rank=2):
            grp = ep_group(pl4, 1000, K, dist.group.WORLD, rows_agreed=agreed)
            traced = make_fx(rank2, tracing_mode="fake", _allow_non_fake_inputs=True)(*_batch(8907, MAX_T))
        sent = [n.args[1].meta["val"].shape[0] for n in traced.graph.nodes if "alltoall" in str(n.target)]
        assert sent == [rows] * 3, (agreed, sent)


def test_capacity_factor_setting(monkeypatch) -> None:
    """DEEPINFER_EP_CAPACITY_FACTOR: a multiple of the average pairs per destination, capped at the
    worst case; unset or 0 is the worst case; a bad value is a one-line error naming the variable.
    The engine reads it once and its ranks hand it to ``ep_group``; the library ignores the environment."""
    pl = eplb.default_placement(E, eplb.num_physical_experts(E, 4, 0), 4)
    monkeypatch.setenv("DEEPINFER_EP_CAPACITY_FACTOR", "1.5")
    with fake_world(4, 0):
        world = build_mesh(MeshSpec(ep=4))
        pg = moe_view(world)
        assert ep_group(pl, 100, K, pg).capacity == 100 * K  # the argument's default, not the environment
        assert ep_group(pl, 100, K, pg, capacity_factor=1.5).capacity == 113  # ceil(1.5 * 300 / 4)
        assert ep_group(pl, 100, K, pg, capacity_factor=9).capacity == 100 * K  # never above the worst case
        for value, want in (("1.5", 113), ("", 100 * K)):
            settings = EngineConfig.from_env({"DEEPINFER_EP_CAPACITY_FACTOR": value, EXTRA: "0"})
            ranks = Ranks(MeshSpec(ep=4), settings, lockstep=object(), world=world)  # a lock step: several ranks
            ranks.start_ep(
                SimpleNamespace(n_routed_experts=E, num_experts_per_tok=K, dspark_stages=0), 100, 4, torch.device("cpu")
            )
            assert ranks.ep.capacity == want and ranks.draft_ep is None
    with pytest.raises(ValueError, match="DEEPINFER_EP_CAPACITY_FACTOR='-1' is invalid"):
        EngineConfig.from_env({"DEEPINFER_EP_CAPACITY_FACTOR": "-1"})


def test_a_dspark_drafter_gets_its_own_group() -> None:
    """A drafter with its own expert count (V4.1's DSpark) gets an EP group of its own over the
    same ranks, its capacity sized for the engine's draft blocks (``max_seqs`` x block rows, its
    top-k); the dispatch picks a call's group by the slots its expert tensors hold, and refuses
    sets it cannot tell apart or tensors no group placed."""
    c = SimpleNamespace(
        n_routed_experts=E,
        num_experts_per_tok=K,
        dspark_stages=2,
        dspark_n_routed_experts=E // 2,
        dspark_num_experts_per_tok=2,
        dspark_block_size=5,
    )
    with fake_world(4, 0):
        world = build_mesh(MeshSpec(ep=4))
        ranks = Ranks(MeshSpec(ep=4), EngineConfig.from_env({EXTRA: "0"}), lockstep=object(), world=world)
        swaps = ranks.start_ep(c, 100, 4, torch.device("cpu"))
        assert (ranks.ep.slots_per_rank, ranks.ep.capacity) == (E // 4, 100 * K)
        assert (ranks.draft_ep.slots_per_rank, ranks.draft_ep.capacity) == (
            2,
            4 * 5 * 2,
        )  # 6 experts round up to 8 slots
        assert not ranks.heads_follow
        dispatch = next(iter(swaps.steps.values()))
        x, idx, w = torch.randn(3, D), torch.zeros(3, K, dtype=torch.long), torch.ones(3, K)
        with pytest.raises(
            ValueError, match=r"a MoE call holds 5 expert slots, and this rank's EP groups hold \[2, 3\]"
        ):
            dispatch({"w1": torch.zeros(5, I, D)}, LIMIT, x, idx, w, torch.ones(3, dtype=torch.bool))
        same = ep_group(ranks.ep.placement, 10, K, moe_view(world))
        with pytest.raises(ValueError, match=r"\(12 experts, 12 experts\) fill the same 3 slots a rank on ep4"):
            parallel.ep_swaps(ranks.ep, same)
