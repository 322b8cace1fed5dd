"""EPLB at run time (``sharding/rebalance.py``) on 2 gloo ranks: the loads every EP call measures
add up to the routed pairs, a rebalance by those loads changes the placement and moves the
expert weights to exactly the new layout, and a tiny model keeps the one-process logits through
the shuffle mid-run (prefill before it, decode steps after it); experts held in fp8 move with
their block scales. In float64: in float32 one CI run failed at seed 1991544978 (45% of a rank's
logits off by up to 1.6e-3) that passes on the development machine, as 40 other seeds do; a routing
near-tie that the two CPUs' matmuls round apart was the guess. In float64 a CI run failed again
(seed 1242592194, 59% off by 1.7e-3) and a loaded development machine failed 1 of 30 runs: with 2
intra-op threads the same forward repeated in one process under load gave outputs up to 2e-3
apart (which op is not pinned yet), with 1 thread never (30 runs). So
each rank runs one thread: the property is sharded == one process for the same arithmetic."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import FP8_EXPERTS, tiny_v4

from deepinfer_fx.api import random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.batch import make_batch
from deepinfer_fx.graphs.model import forward_batch
from deepinfer_fx.graphs.param_spec import iter_tree
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.ep import check_overflow, ep_group
from deepinfer_fx.sharding.mesh import MeshSpec
from deepinfer_fx.sharding.parallel import ep_swaps, rank_expert_ids, rank_params
from deepinfer_fx.sharding.rebalance import rebalance

TOL = dict(rtol=1e-5, atol=1e-5)


def _worker(rank: int, init_file: str, seed: int, fp8: bool) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    torch.set_num_threads(1)  # deterministic reductions: see the module docstring
    try:
        c = config_from_dict(tiny_v4(**FP8_EXPERTS) if fp8 else tiny_v4()).replace(
            fake_quant=False, held_experts="fp8" if fp8 else None
        )
        full = random_model(c, seed=seed, dtype=torch.float64).params
        spec = MeshSpec(ep=2)
        start = eplb.default_placement(c.n_routed_experts, eplb.num_physical_experts(c.n_routed_experts, 2, 4), 2)
        group = ep_group(start, 3 * 48, c.num_experts_per_tok, dist.group.WORLD)
        params = rank_params(full, c, rank_expert_ids(spec, rank, start))
        rng = random.Random(seed + rank)  # each rank serves its own requests
        steps = [[[rng.randrange(3, c.vocab_size) for _ in range(rng.randint(20, 48))] for _ in range(3)]] + [
            [[rng.randrange(3, c.vocab_size)] for _ in range(3)]
        ] * 3
        ref_state, state = (init_state(c, 128, torch.float64, "cpu", mtp=False, slots=3) for _ in range(2))
        starts, pairs = [0, 0, 0], 0
        for i, step in enumerate(steps):
            batch = make_batch(step, [0, 1, 2], starts)
            want, _ = forward_batch(full, ref_state, c, batch)
            with swapped(ep_swaps(group)):
                got, _ = forward_batch(params, state, c, batch)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"seed={seed} rank={rank} step={i}: {m}")
            pairs += batch.token_ids.numel() * c.num_experts_per_tok * c.num_hidden_layers
            starts = [s + len(t) for s, t in zip(starts, step)]
            if i == 0:  # the shuffle, mid-run: after the prefill, before the decode steps
                total = group.loads.clone()
                dist.all_reduce(total)
                mine = torch.tensor([pairs])
                dist.all_reduce(mine)
                assert int(total.sum()) == int(mine), (
                    f"seed={seed}: measured loads {int(total.sum())} != routed pairs {int(mine)}"
                )
                check_overflow(group)
                new = rebalance(group, [lp["ffn"]["experts"] for lp in params["layers"]])
                assert new.placement != group.placement, f"seed={seed}: skewed loads left the placement alone"
                assert new.placement == eplb.plan_placement(total.double(), start.n_physical, 2, previous=start)
                assert int(new.loads.sum()) == 0
                moved = dict(iter_tree(rank_params(full, c, rank_expert_ids(spec, rank, new.placement))))
                local = {path: t for path, t in iter_tree(params) if path.startswith("layers.") and ".experts." in path}
                assert len(local) == c.num_hidden_layers * (6 if fp8 else 3)  # fp8: the scales move too
                for (
                    path,
                    t,
                ) in local.items():  # the trunk's placement; as floats: torch.equal takes no fp8, fp8 -> fp32 is exact
                    assert t.dtype == moved[path].dtype and torch.equal(t.float(), moved[path].float()), (
                        f"seed={seed} rank={rank}: {path} not in the new layout"
                    )
                group = new
    finally:
        dist.destroy_process_group()


# 1737447152: after the shuffle rank 1 received no rows at a decode step, and the ragged EP path
# (eager steps) read its peer's fp32 results as float64 (docs/decisions.md, ragged EP); pinned
@pytest.mark.parametrize(
    "fp8, seed",
    [(False, None), (True, None), (False, 1737447152)],
    ids=["dequantised", "fp8-experts", "dequantised-rank-receives-nothing"],
)
def test_rebalance_mid_run_keeps_outputs_and_moves_weights(tmp_path, fp8: bool, seed: int | None) -> None:
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), seed, fp8), nprocs=2, join=True)
