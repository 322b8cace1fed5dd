"""An EP rank loads only its own experts from the checkpoint, through the rules table and the
EPLB placement, and gets exactly the slices of the full model it owns (experts held in fp8: their
block scales too)."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from tiny import FP8_EXPERTS, tiny_v4

import deepinfer_fx
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.sharding.eplb import default_placement, num_physical_experts, plan_placement
from deepinfer_fx.sharding.mesh import parse_mesh
from deepinfer_fx.sharding.rules import expert_ids


@pytest.mark.parametrize("expert_format", ["dequant", "fp8"])
def test_rank_loads_only_its_experts(tmp_path, expert_format: str) -> None:
    seed = random.SystemRandom().randrange(2**31)
    deepinfer_fx.write_random_checkpoint(
        tmp_path, tiny_v4(**FP8_EXPERTS) if expert_format == "fp8" else tiny_v4(), seed=seed
    )
    full = deepinfer_fx.load_model(tmp_path, dtype=torch.float32, expert_format=expert_format)
    mesh = parse_mesh("ep4")
    n_logical = full.config.n_routed_experts
    loads = torch.rand(n_logical, generator=torch.Generator().manual_seed(seed)) ** 4
    n_phys = num_physical_experts(n_logical, 4, extra=4)
    for placement in (default_placement(n_logical, n_phys, 4), plan_placement(loads, n_phys, 4)):
        held = []
        for rank in range(4):
            pick = partial(expert_ids, mesh=mesh, coord={"ep": rank}, experts=placement)
            part = deepinfer_fx.load_model(tmp_path, dtype=torch.float32, experts=pick, expert_format=expert_format)
            ids = pick(next(s for s in param_specs(full.config) if s.stacked))
            held += ids
            for layer in range(full.config.num_hidden_layers):
                experts = part.params["layers"][layer]["ffn"]["experts"]
                assert len(experts) == (6 if expert_format == "fp8" else 3), f"seed={seed}: {sorted(experts)}"
                for name, got in experts.items():
                    want = full.params["layers"][layer]["ffn"]["experts"][name][ids]
                    # compared as floats: torch.equal takes no fp8 tensors, and fp8 -> fp32 is exact
                    assert (
                        got.shape[0] == n_phys // 4
                        and got.dtype == want.dtype
                        and torch.equal(got.float(), want.float())
                    ), f"seed={seed} rank {rank} layer {layer} {name}"
            # everything that is not an expert is the same on every rank
            assert torch.equal(part.params["layers"][1]["attn"]["wq_a"], full.params["layers"][1]["attn"]["wq_a"])
        assert sorted(set(held)) == list(range(n_logical)), f"seed={seed}: an expert is on no rank"
