"""Pins the expert shuffle: moving replicas at run time changes where weights live, never what the
MoE computes."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_v4

from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.moe import route, routed_experts, swiglu
from deepinfer_fx.graphs.norm import linear
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.topology import Topology


def _loads(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) ** 5 * 100


def _weights(n: int, seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "n_logical, ep, extra, seeds, keep_slots",
    [
        (256, 64, 32, (7101, 7102), False),
        (256, 64, 32, (7103, 7104), True),
        (16, 4, 4, (7105, 7106), True),
        (10, 3, 7, (7107, 7108), False),
    ],
)
def test_moves_turn_old_layout_into_new(
    n_logical: int, ep: int, extra: int, seeds: tuple[int, int], keep_slots: bool
) -> None:
    n_phys = eplb.num_physical_experts(n_logical, ep, extra)
    old = eplb.plan_placement(_loads(n_logical, seeds[0]), n_phys, ep)
    new = eplb.plan_placement(_loads(n_logical, seeds[1]), n_phys, ep, previous=old if keep_slots else None)
    logical = _weights(n_logical, seeds[0] + 50, 3, 5)
    moves = eplb.shuffle(old, new)
    got = eplb.apply_shuffle(eplb.physical_experts(logical, old), moves)
    assert torch.equal(got, eplb.physical_experts(logical, new))
    # only slots whose expert changes are written, each once
    dsts = [d for _, d in moves]
    assert len(set(dsts)) == len(dsts)
    assert set(dsts) == {p for p in range(n_phys) if old.phys_to_logical[p] != new.phys_to_logical[p]}
    assert all(old.phys_to_logical[s] == new.phys_to_logical[d] for s, d in moves)


def test_previous_placement_keeps_slots_and_cuts_copies() -> None:
    old = eplb.plan_placement(_loads(256, 7201), 320, 64)
    loads = _loads(256, 7202)
    fresh = eplb.plan_placement(loads, 320, 64)
    kept = eplb.plan_placement(loads, 320, 64, previous=old)
    # same experts on each rank either way; only the order of slots within a rank differs
    for r in range(64):
        assert sorted(fresh.phys_to_logical[r * 5 : (r + 1) * 5]) == sorted(kept.phys_to_logical[r * 5 : (r + 1) * 5])
    assert len(eplb.shuffle(old, kept)) <= len(eplb.shuffle(old, fresh))
    assert eplb.shuffle(old, old) == []


def test_sources_prefer_the_same_rank_then_host() -> None:
    """Expert 0 has replicas on rank 0 and rank 3 (host 1). A slot on rank 2 (host 1) that needs
    expert 0 copies from rank 3 over NVLink, not from rank 0 across the network."""
    topo = Topology(hosts=2, gpus_per_host=2)
    mk = lambda rows: eplb._from_rank_lists(rows, 5, None)  # noqa: E731
    old = mk([[0, 1], [2, 1], [3, 4], [0, 2]])
    new = mk([[0, 1], [2, 1], [0, 4], [3, 2]])
    moves = eplb.shuffle(old, new, topo)
    by_dst = {d: s for s, d in moves}
    assert old.rank_of_phys[by_dst[new.logical_to_phys[0][1]]] == 3
    x = _weights(5, 7301, 4)
    assert torch.equal(eplb.apply_shuffle(eplb.physical_experts(x, old), moves), eplb.physical_experts(x, new))


def test_route_to_physical_is_deterministic_and_valid() -> None:
    pl = eplb.plan_placement(_loads(16, 7401), 24, 4)
    g = torch.Generator().manual_seed(7402)
    idx = torch.randint(0, 16, (50, 3), generator=g)
    pos = torch.randint(0, 10_000, (50,), generator=g)
    phys = eplb.route_to_physical(idx, pl, pos)
    assert phys.shape == idx.shape and torch.equal(phys, eplb.route_to_physical(idx, pl, pos))
    table = torch.tensor(pl.phys_to_logical)
    assert torch.equal(table[phys], idx)  # every pick holds the expert the router asked for
    # tokens spread over the replicas of a replicated expert
    hot = max(range(16), key=lambda e: len(pl.logical_to_phys[e]))
    many = eplb.route_to_physical(torch.full((40, 1), hot), pl, torch.arange(40))
    assert set(many.flatten().tolist()) == set(pl.logical_to_phys[hot])


def _moe_by_slot(
    w: dict[str, torch.Tensor], x: torch.Tensor, phys: torch.Tensor, gate: torch.Tensor, limit: float
) -> torch.Tensor:
    """routed_experts' math per (token, slot), summed over the k slots in slot order, so the result
    depends only on the weights each slot reads: equal copies give bitwise-equal outputs."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(phys.shape[1]):
        for t in range(x.shape[0]):
            p = int(phys[t, j])
            h = swiglu(x[t : t + 1], w["w1"][p], w["w3"][p], limit) * gate[t, j]
            out[t] += linear(h.to(x.dtype), w["w2"][p]).float()[0]
    return out


def test_mid_run_shuffle_leaves_moe_outputs_unchanged() -> None:
    c = config_from_dict(tiny_v4(n_routed_experts=16, num_experts_per_tok=3, num_hash_layers=0))
    ep, n_phys = 4, eplb.num_physical_experts(16, 4, 6)
    g = torch.Generator().manual_seed(7501)
    d, i = c.hidden_size, c.moe_intermediate_size
    logical = {
        "w1": torch.randn(16, i, d, generator=g) * d**-0.5,
        "w3": torch.randn(16, i, d, generator=g) * d**-0.5,
        "w2": torch.randn(16, d, i, generator=g) * i**-0.5,
    }
    gate = {"weight": torch.randn(16, d, generator=g) * d**-0.5, "bias": 0.1 * torch.randn(16, generator=g)}
    x = torch.randn(24, d, generator=g)
    positions = torch.arange(100, 124)
    idx, w = route({"gate": gate}, c, x, torch.zeros(24, dtype=torch.long))
    reference = routed_experts(logical, c.swiglu_limit, x, idx, w)  # no EPLB at all

    # step 1 under the placement from start-up loads; then loads are measured, a new placement is
    # planned and the weights are shuffled in place of the old ones; step 2 reruns the same tokens
    old = eplb.plan_placement(_loads(16, 7502), n_phys, ep)
    new = eplb.plan_placement(_loads(16, 7503), n_phys, ep, previous=old)
    assert new != old
    phys_old = {k: eplb.physical_experts(v, old) for k, v in logical.items()}
    moves = eplb.shuffle(old, new)
    phys_new = {k: eplb.apply_shuffle(v, moves) for k, v in phys_old.items()}

    slots_old = eplb.route_to_physical(idx, old, positions)
    slots_new = eplb.route_to_physical(idx, new, positions)
    assert not torch.equal(slots_old, slots_new)  # the tokens really hit other slots after the shuffle
    before = _moe_by_slot(phys_old, x, slots_old, w, c.swiglu_limit)
    after = _moe_by_slot(phys_new, x, slots_new, w, c.swiglu_limit)
    assert torch.equal(before, after)
    # and the model's own routed_experts over physical experts agrees with the logical reference
    for p, slots in ((phys_old, slots_old), (phys_new, slots_new)):
        torch.testing.assert_close(routed_experts(p, c.swiglu_limit, x, slots, w), reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(before, reference, rtol=1e-6, atol=1e-6)
