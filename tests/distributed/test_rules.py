"""World mesh, views and the logical-axis rules, on the fake process group (one process).

ep64 and friends are built for real here (DeviceMesh, sub-groups), but no collective runs: the
fake backend makes that possible in one CPU process, in milliseconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from deepinfer_fx.config import load_config
from deepinfer_fx.config import released_config
from deepinfer_fx.graphs.param_spec import ParamSpec
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.sharding import eplb, rules
from deepinfer_fx.sharding.mesh import MeshSpec, parse_mesh
from deepinfer_fx.sharding.world import (
    MESH_AXES,
    attention_view,
    build_mesh,
    fake_world,
    mesh_spec_of,
    moe_view,
    rank_coordinate,
)


@pytest.mark.parametrize(
    "text, world, rank",
    [
        ("ep64", 64, 37),
        ("dp2,ep32", 64, 45),
        ("dp2,cp4,ep8", 64, 29),
        ("ep8,dp8", 64, 63),
        ("dp2,ep4", 8, 6),
        ("1", 1, 0),
    ],
)
def test_mesh_axes_sizes_and_views(text: str, world: int, rank: int) -> None:
    spec = parse_mesh(text)
    assert spec.world_size == world
    with fake_world(world, rank):
        mesh = build_mesh(spec)
        assert mesh.mesh_dim_names == MESH_AXES == ("dp", "cp", "ep")
        assert mesh.shape == (spec.dp, spec.cp, spec.ep)
        assert mesh_spec_of(mesh) == spec
        coord = rank_coordinate(spec, rank)
        assert list(mesh.get_coordinate()) == [coord[a] for a in MESH_AXES]

        att = attention_view(mesh)
        assert att.mesh_dim_names == ("dp", "cp") and att.shape == (spec.dp, spec.cp)
        moe = moe_view(mesh)
        assert moe.mesh_dim_names == ("ep",) and moe.shape == (spec.ep,)
        # ep innermost: one EP group is `ep` consecutive world ranks, the group of this rank
        base = rank - coord["ep"]
        assert moe.mesh.tolist() == list(range(base, base + spec.ep))
        assert moe.get_local_rank() == coord["ep"]
    assert not dist.is_initialized()  # fake_world tears down


def test_rank_coordinate_enumerates_the_mesh() -> None:
    spec = parse_mesh("dp3,cp2,ep4")
    coords = [tuple(rank_coordinate(spec, r).values()) for r in range(spec.world_size)]
    assert coords == [(d, c, e) for d in range(3) for c in range(2) for e in range(4)]
    with pytest.raises(ValueError, match="outside mesh"):
        rank_coordinate(spec, 24)


def test_world_size_mismatch_names_both_numbers() -> None:
    with fake_world(4, 0):
        with pytest.raises(ValueError, match=r"world size 3 .* 4 ranks.*torchrun --nproc-per-node 3"):
            build_mesh(parse_mesh("ep3"))
        with pytest.raises(ValueError, match=r"world size 8 .* 4 ranks"):
            build_mesh(parse_mesh("dp2,ep4"))
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        build_mesh(parse_mesh("ep2"))  # no process group at all
    with fake_world(2, 1):
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_world(2, 0):
                pass


@pytest.mark.parametrize("name, ep_per_rank", [("deepseek_v4_flash", 5), ("deepseek_v41_flash", 7)])
def test_released_configs_on_ep64(name: str, ep_per_rank: int) -> None:
    """Experts on "ep" with 256+32 -> 320 (V4) / 384+32 -> 448 (V4.1) physical slots, i.e. 5 / 7
    per rank (288 and 416 are rounded UP to a multiple of 64); everything else replicated."""
    c = load_config(released_config(name))
    counts = eplb.expert_counts(c, 64, extra=32)
    assert counts.trunk_physical == 64 * ep_per_rank
    trunk = eplb.default_placement(c.n_routed_experts, counts.trunk_physical, 64)
    draft = eplb.default_placement(counts.draft_logical, counts.draft_physical, 64) if counts.draft_logical else None
    rank = 19
    with fake_world(64, rank):
        mesh = build_mesh(parse_mesh("ep64"))
        n_trunk = 0
        for s in param_specs(c):
            got = rules.placements(s, mesh)
            if not s.stacked:
                assert got == (Replicate(),) * 3, s.path
                assert rules.local_shape(s, mesh) == s.shape, s.path
                continue
            n_trunk += s.path.startswith("layers.")
            # the draft head's experts (MTP-1 or DSpark) have their own, separately rounded, count
            placement = draft if s.path.startswith("mtp.") else trunk
            assert got == (Replicate(), Replicate(), Shard(0)), s.path
            assert rules.local_shape(s, mesh, experts=placement) == (placement.slots_per_rank,) + s.shape[1:]
            assert rules.local_slice(s, mesh, experts=placement)[0] == slice(
                rank * placement.slots_per_rank, (rank + 1) * placement.slots_per_rank
            )
            ids = rules.expert_ids(s, mesh, experts=placement)
            assert ids == list(placement.phys_to_logical[rank * placement.slots_per_rank :][: placement.slots_per_rank])
        assert n_trunk == 3 * c.num_hidden_layers


@pytest.mark.parametrize("name", ["deepseek_v4_flash", "deepseek_v41_flash"])
def test_every_expert_loaded_once_per_slot_across_ranks(name: str) -> None:
    """Over all 64 ranks the loaded experts cover every logical expert; each rank reads only its
    slots (~1/64 of the experts), never the whole stack. Pure MeshSpec: no process group."""
    c = load_config(released_config(name))
    spec = MeshSpec(ep=64)
    w1 = next(s for s in param_specs(c) if s.stacked)
    n_phys = eplb.num_physical_experts(c.n_routed_experts, 64, 32)
    loads = torch.rand(c.n_routed_experts, generator=torch.Generator().manual_seed(5101)) ** 4
    placement = eplb.plan_placement(loads, n_phys, 64)
    per_rank = [rules.expert_ids(w1, spec, {"ep": r}, placement) for r in range(64)]
    assert all(len(ids) == n_phys // 64 for ids in per_rank)
    flat = [e for ids in per_rank for e in ids]
    assert sorted(set(flat)) == list(range(c.n_routed_experts)) and len(flat) == n_phys
    # without redundant experts: contiguous blocks of 256 / 64 = 4 (V4) or 384 / 64 = 6 (V4.1)
    k = c.n_routed_experts // 64
    assert rules.expert_ids(w1, spec, {"ep": 3}) == list(range(3 * k, 4 * k))


def test_placements_agree_with_dtensor() -> None:
    """A DTensor built from a rank's local shard with our placements has the global shape."""
    spec = ParamSpec(
        "layers.0.ffn.experts.w1", "layers.0.ffn.experts.{e}.w1.weight", (6, 4, 8), ("experts", "expert_mlp", "embed")
    )
    placement = eplb.plan_placement(torch.tensor([5.0, 1, 1, 1, 1, 1]), 8, 4)
    with fake_world(8, 5):
        mesh = build_mesh(parse_mesh("dp2,ep4"))
        local = torch.randn(
            rules.local_shape(spec, mesh, experts=placement), generator=torch.Generator().manual_seed(5102)
        )
        dt = DTensor.from_local(local, mesh, rules.placements(spec, mesh), run_check=False)
        assert tuple(dt.shape) == rules.global_shape(spec, placement) == (8, 4, 8)
        assert rules.local_slice(spec, mesh, experts=placement)[0] == slice(2, 4)  # ep coordinate of rank 5 is 1
        moe = moe_view(mesh)
        assert rules.placements(spec, moe) == (Shard(0),)
        gate = ParamSpec("layers.0.ffn.gate.weight", "layers.0.ffn.gate.weight", (6, 8), ("experts", "embed"))
        assert rules.placements(gate, mesh) == (Replicate(),) * 3  # the router stays replicated


def test_non_divisible_split_names_parameter_dim_and_sizes() -> None:
    c = load_config(released_config("deepseek_v4_flash"))
    w2 = next(s for s in param_specs(c) if s.path == "layers.5.ffn.experts.w2")
    with fake_world(3, 2):
        mesh = build_mesh(parse_mesh("ep3"))
        with pytest.raises(
            ValueError, match=r"layers\.5\.ffn\.experts\.w2: dim 0 \(experts\) has size 256, .*'ep' of size 3"
        ):
            rules.local_shape(w2, mesh)
        # redundant experts round 256 + 32 up to 288 = 3 x 96: divisible
        placement = eplb.default_placement(256, eplb.num_physical_experts(256, 3, 32), 3)
        assert rules.local_shape(w2, mesh, experts=placement) == (96, 4096, 2048)
        with pytest.raises(ValueError, match="placement is for ep3, the mesh has ep4"):
            rules.local_shape(w2, MeshSpec(ep=4), experts=placement)


def test_unknown_logical_axis_and_missing_mesh_axis() -> None:
    odd = ParamSpec("x", "x", (4, 4), ("mystery", None))
    with pytest.raises(KeyError, match="mystery"):
        rules.placements(odd, MeshSpec(ep=2))
    w = ParamSpec("w", "w.{e}", (4, 2), ("experts", None))
    with fake_world(4, 0):
        att = attention_view(build_mesh(parse_mesh("dp2,ep2")))
        with pytest.raises(ValueError, match="does not have"):
            rules.placements(w, att)
