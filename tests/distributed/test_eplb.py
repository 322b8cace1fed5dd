"""EPLB: the redundant-expert count rule, placement invariants, balance, and the topology."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer_fx.config import load_config
from deepinfer_fx.config import released_config
from deepinfer_fx.sharding import eplb
from deepinfer_fx.engine import ranks as ranks_module
from deepinfer_fx.engine.ranks import Ranks
from deepinfer_fx.settings import EngineConfig
from deepinfer_fx.sharding.mesh import MeshSpec
from deepinfer_fx.sharding.topology import TOPOLOGY_ENV, Topology, load_topology, topology_for

ENV = eplb.EXTRA_EXPERTS_ENV


# --- how many physical experts -------------------------------------------------------------------


@pytest.mark.parametrize("ep", [1, 3, 8, 64])
@pytest.mark.parametrize("extra", [0, 5, 32])
@pytest.mark.parametrize("n_routed", [256, 384, 128])
def test_round_up_rule(n_routed: int, ep: int, extra: int) -> None:
    n = eplb.num_physical_experts(n_routed, ep, extra)
    assert n % ep == 0 and n_routed + extra <= n < n_routed + extra + ep  # extra is a lower bound


@pytest.mark.parametrize(
    "n_routed, ep, extra, expect",
    [
        (256, 64, 32, 320),
        (384, 64, 32, 448),
        (128, 64, 32, 192),
        (256, 1, 0, 256),
        (256, 3, 5, 261),
        (256, 8, 5, 264),
        (256, 3, 0, 258),
    ],
)
def test_round_up_values(n_routed: int, ep: int, extra: int, expect: int) -> None:
    assert eplb.num_physical_experts(n_routed, ep, extra) == expect


def test_the_setting_is_handed_down_by_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library takes ``extra`` as an argument (default 32) and never reads the environment;
    the engine reads the variable once into its config and its ranks place experts with it."""
    monkeypatch.setenv(ENV, "5")
    assert eplb.num_physical_experts(256, 64) == 320 and eplb.num_physical_experts(256, 8, 0) == 256
    for value, want in (("5", 264), ("0", 256), ("", 288)):
        ranks = Ranks(MeshSpec(ep=8), EngineConfig.from_env({ENV: value}))
        assert ranks.start_placement(256).n_physical == want
    for bad in ("abc", "-1", "2.5"):
        with pytest.raises(ValueError, match=ENV):
            EngineConfig.from_env({ENV: bad})


def test_bad_arguments() -> None:
    for args in ((0, 8, 1), (256, 0, 1), (256, 8, -1)):
        with pytest.raises(ValueError):
            eplb.num_physical_experts(*args)


@pytest.mark.parametrize("ep", [1, 3, 8, 64])
@pytest.mark.parametrize("extra", [0, 5, 32])
def test_trunk_and_draft_counts_round_separately(ep: int, extra: int) -> None:
    up = lambda n: math.ceil((n + extra) / ep) * ep  # noqa: E731
    v41 = eplb.expert_counts(load_config(released_config("deepseek_v41_flash")), ep, extra)
    assert (v41.trunk_logical, v41.draft_logical) == (384, 128)  # DSpark's own experts
    assert (v41.trunk_physical, v41.draft_physical) == (up(384), up(128))
    for name in ("deepseek_v4_flash", "deepseek_v4_flash_0731_dspark"):  # MTP-1 / DSpark on the trunk's 256
        v4 = eplb.expert_counts(load_config(released_config(name)), ep, extra)
        assert (v4.trunk_physical, v4.draft_physical) == (up(256), up(256))


# --- placement ------------------------------------------------------------------------------------


def _skewed(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) ** 6 * 1000 + torch.rand(n, generator=g)  # a few very hot experts


def _naive(n_logical: int, n_physical: int, ep: int) -> eplb.ExpertPlacement:
    """Round-robin, load-blind: slot p holds expert p % n_logical."""
    per_rank = n_physical // ep
    rows = [[p % n_logical for p in range(r * per_rank, (r + 1) * per_rank)] for r in range(ep)]
    return eplb._from_rank_lists(rows, n_logical, None)


@pytest.mark.parametrize(
    "n_logical, ep, extra, seed",
    [(256, 64, 32, 6101), (384, 64, 32, 6102), (128, 8, 5, 6103), (16, 4, 4, 6104), (8, 3, 0, 6105), (6, 2, 40, 6106)],
)
def test_placement_invariants(n_logical: int, ep: int, extra: int, seed: int) -> None:
    loads = _skewed(n_logical, seed)
    n_phys = eplb.num_physical_experts(n_logical, ep, extra)
    pl = eplb.plan_placement(loads, n_phys, ep)
    assert pl.n_physical == n_phys and pl.n_logical == n_logical and pl.ep_degree == ep
    # every logical expert present; slot lists agree with the phys->logical map
    assert sorted(set(pl.phys_to_logical)) == list(range(n_logical))
    assert all(pl.phys_to_logical[p] == e for e, slots in enumerate(pl.logical_to_phys) for p in slots)
    # equal slots per rank, rank-major (a plain Shard(0) of the physical tensor)
    assert [pl.rank_of_phys.count(r) for r in range(ep)] == [n_phys // ep] * ep
    assert list(pl.rank_of_phys) == sorted(pl.rank_of_phys)
    reps = [len(s) for s in pl.logical_to_phys]
    load = loads.double().tolist()
    for e, slots in enumerate(pl.logical_to_phys):  # replicas on different ranks while that is possible
        if max(reps) <= ep:
            assert len({pl.rank_of_phys[p] for p in slots}) == len(slots)
    # hottest first: the last replica of a went to a when it had the highest load per replica
    if max(reps) <= ep:
        for a in range(n_logical):
            for b in range(n_logical):
                if reps[a] > 1:
                    assert load[a] / (reps[a] - 1) >= load[b] / reps[b] - 1e-9
    # deterministic
    assert eplb.plan_placement(loads.clone(), n_phys, ep) == pl


@pytest.mark.parametrize("seed", [6201, 6202, 6203])
def test_balance_beats_round_robin_on_skewed_loads(seed: int) -> None:
    loads = _skewed(256, seed)
    n_phys = eplb.num_physical_experts(256, 64, 32)
    ours = eplb.plan_placement(loads, n_phys, 64).rank_loads(loads)
    naive = _naive(256, n_phys, 64).rank_loads(loads)
    ideal = loads.double().sum() / 64
    assert ours.sum().item() == pytest.approx(loads.double().sum().item())
    assert ours.max() < 0.7 * naive.max()
    assert ours.max() / ideal < 1.15, (ours.max() / ideal).item()


def test_uniform_loads_give_an_even_spread() -> None:
    pl = eplb.default_placement(256, 320, 64)
    assert sorted(len(s) for s in pl.logical_to_phys) == [1] * 192 + [2] * 64  # 320 - 256 = 64 extra replicas
    rl = pl.rank_loads(torch.ones(256))
    assert rl.max() - rl.min() <= 0.5 + 1e-9


def test_replicas_spread_across_hosts() -> None:
    """Two hosts of 4: each of the two hottest experts gets one replica on each host."""
    loads = torch.tensor([100.0, 90.0] + [1.0] * 12)
    topo = Topology(hosts=2, gpus_per_host=4)
    pl = eplb.plan_placement(loads, 16, 8, topo)
    for e in (0, 1):
        assert sorted(topo.host_of(pl.rank_of_phys[p]) for p in pl.logical_to_phys[e]) == [0, 1]


def test_placement_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="multiple of the EP degree"):
        eplb.plan_placement(torch.ones(8), 10, 4)
    with pytest.raises(ValueError, match="n_logical"):
        eplb.plan_placement(torch.ones(8), 4, 4)
    with pytest.raises(ValueError, match="finite"):
        eplb.plan_placement(torch.tensor([1.0, -1.0]), 2, 1)
    with pytest.raises(ValueError, match="EP degree is 16"):
        eplb.plan_placement(torch.ones(16), 16, 16, Topology(hosts=1, gpus_per_host=8))


# --- topology -------------------------------------------------------------------------------------


def test_topology_default_json_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Topology.default() == Topology(hosts=1, gpus_per_host=8)
    assert Topology.default(64) == Topology(hosts=8, gpus_per_host=8)
    assert Topology.default(2) == Topology(hosts=1, gpus_per_host=2)
    t = Topology(hosts=2, gpus_per_host=4, nvlink_gbps=400, network_gbps=25)
    assert (t.host_of(5), list(t.ranks_of_host(1))) == (1, [4, 5, 6, 7])
    assert (t.bandwidth(0, 3), t.bandwidth(0, 4)) == (400, 25)
    f = tmp_path / "topo.json"
    f.write_text(json.dumps(t.to_dict()))
    assert load_topology(f) == t
    assert topology_for(EngineConfig.from_env({TOPOLOGY_ENV: str(f)}).topology_file) == t
    assert topology_for(EngineConfig.from_env({}).topology_file, 16) == Topology(hosts=2, gpus_per_host=8)
    # the engine's EPLB plans with the file its settings name
    seen = []
    monkeypatch.setattr(ranks_module, "rebalance", lambda group, experts, topology: seen.append(topology) or group)
    ranks = Ranks(MeshSpec(ep=8), EngineConfig.from_env({TOPOLOGY_ENV: str(f)}), ep=SimpleNamespace(slots_per_rank=5))
    ranks.rebalance({"layers": []})
    assert seen == [t]
    # an EP group of one (dp, cp meshes) has nothing to balance: no new swaps, no recompilation
    assert Ranks(MeshSpec(dp=2), EngineConfig.from_env({}), ep=object()).rebalance({"layers": []}) is None
    assert seen == [t]
    f.write_text(json.dumps({"hosts": 2, "gpu_per_host": 4}))
    with pytest.raises(ValueError, match="unknown field"):
        load_topology(f)
    f.write_text(json.dumps({"hosts": 0}))
    with pytest.raises(ValueError, match="'hosts' must be a positive integer"):
        load_topology(f)
