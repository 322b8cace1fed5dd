"""Whole tiny models on meshes (1), (ep2), (ep4), (dp2,ep2): data-parallel attention (each rank
steps only its own requests) with the MoE region swapped for the EP dispatch/combine gives the
logits of one process holding everything, within 1e-5 (fp32, fake-quant off), for a prefill of
requests of different lengths and then decode steps in which requests drop out, so ranks step
different batch sizes and some step none (they run a padding request and still join every
all-to-all). A spawn costs ~20 s here, so one spawned job runs every check of its world size;
one more (ep2) runs a model whose routed experts and dense projections are held in fp8 with their
block scales."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import FP8_EXPERTS, tiny_v4, tiny_v41

from deepinfer_fx.api import Model, random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.steps import decode_logits, prefill_logits
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.ep import EPGroup, check_overflow, ep_group
from deepinfer_fx.sharding.mesh import MeshSpec, parse_mesh
from deepinfer_fx.sharding.parallel import ep_swaps, idle_step, rank_expert_ids, rank_params
from deepinfer_fx.sharding.world import build_mesh, moe_view

CONFIGS = {"v4": tiny_v4, "v41": tiny_v41, "v4-fp8": lambda: tiny_v4(**FP8_EXPERTS)}
MAX_LEN, DECODES, EXTRA = 40, 3, 3


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    steps: list[dict[int, int]]  # per decode step: request -> its input token (requests drop out)


def _workload(seed: int, n_requests: int, vocab: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))] for _ in range(n_requests)]
    stop = [rng.randint(0, DECODES) for _ in range(n_requests)]
    steps = [{i: rng.randrange(3, vocab) for i in range(n_requests) if j < stop[i]} for j in range(DECODES)]
    return Workload(prompts, steps)


def _model(which: str, seed: int) -> Model:
    c = config_from_dict(CONFIGS[which]()).replace(fake_quant=False)
    fp8 = "fp8" if c.expert_dtype == "fp8" else None  # experts and dense projections held as stored
    return random_model(c.replace(held_experts=fp8, held_dense=fp8), seed=seed)


@torch.no_grad()
def _serve(
    model: Model, work: Workload, mine: list[int], group: EPGroup | None = None
) -> dict[tuple[int, int], torch.Tensor]:
    """Prefill and decode the requests ``mine`` (in this process's own state pool) and return
    ``{(request, step): logits}``, step -1 being the prompt's rows. With ``group`` the MoE runs
    over the EP group; a step with none of ``mine`` runs a padding request."""
    c, params = model
    state = init_state(c, MAX_LEN, torch.float32, mtp=False, slots=max(1, len(mine)))
    slot = {r: s for s, r in enumerate(mine)}
    out: dict[tuple[int, int], torch.Tensor] = {}
    swaps = ep_swaps(group) if group is not None else {}

    length = max([len(work.prompts[r]) for r in mine], default=1)
    ids = torch.zeros(max(1, len(mine)), length, dtype=torch.long)
    slots, starts, lens = idle_step(state)
    if mine:
        for s, r in enumerate(mine):
            ids[s, : len(work.prompts[r])] = torch.tensor(work.prompts[r])
        slots, starts = torch.tensor([slot[r] for r in mine]), torch.zeros(len(mine), dtype=torch.long)
        lens = torch.tensor([len(work.prompts[r]) for r in mine])
    with swapped(swaps):
        logits = prefill_logits(params, state, c, ids.reshape(-1), slots, starts, lens, torch.arange(ids.numel()))
    for s, r in enumerate(mine):
        out[r, -1] = logits[s * length : s * length + len(work.prompts[r])]

    next_token = torch.zeros(state["slots"] + 1, dtype=torch.long)
    for j, step in enumerate(work.steps):
        live = [r for r in mine if r in step]
        slots, starts, lens = idle_step(state)
        if live:
            slots = torch.tensor([slot[r] for r in live])
            starts = torch.tensor([len(work.prompts[r]) + j for r in live])
            lens = torch.ones(len(live), dtype=torch.long)
            next_token[slots] = torch.tensor([step[r] for r in live])
        with swapped(swaps):
            logits = decode_logits(params, state, c, next_token, slots, starts, lens)
        for i, r in enumerate(live):
            out[r, j] = logits[i]
    return out


def _placement(seed: int, n_logical: int, ep: int) -> eplb.ExpertPlacement:
    loads = torch.rand(n_logical, generator=torch.Generator().manual_seed(seed)) ** 4
    return eplb.plan_placement(loads, eplb.num_physical_experts(n_logical, ep, EXTRA), ep)


def _check_mesh(model: Model, work: Workload, want: dict, spec: MeshSpec, rank: int, seed: int, where: str) -> EPGroup:
    """Serve this rank's share of ``work`` on ``spec`` and compare with the one-process logits."""
    c, params = model
    pl = _placement(seed + spec.ep, c.n_routed_experts, spec.ep)
    mine = [r for r in range(len(work.prompts)) if r % spec.world_size == rank]
    # one capacity for the whole EP group: the largest packed batch any rank passes
    max_tokens = len(work.prompts) * max(map(len, work.prompts))
    grp = ep_group(pl, max_tokens, c.num_experts_per_tok, moe_view(build_mesh(spec)) if spec.world_size > 1 else None)
    got = _serve(Model(c, rank_params(params, c, rank_expert_ids(spec, rank, pl))), work, mine, grp)
    assert set(got) == {k for k in want if k[0] in mine}, where
    for key, value in got.items():
        # fp32 sums in another order (other row counts per rank): 1.33e-5 seen on a logit near 0 (V4.1, ep4)
        torch.testing.assert_close(
            value, want[key], rtol=1e-5, atol=3e-5, msg=lambda m: f"{where} request/step {key}: {m}"
        )
    check_overflow(grp)
    return grp


def _worker(rank: int, world: int, init_file: str, seed: int, meshes: tuple[str, ...], models: tuple[str, ...]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        for k, which in enumerate(models):
            model = _model(which, seed + k)
            # v4: more requests than ranks; v41: fewer, so a rank starts idle
            work = _workload(
                seed + 10 + k, 2 * world + 1 if which.startswith("v4") else world - 1, model.config.vocab_size
            )
            want = _serve(model, work, list(range(len(work.prompts))))
            for mesh in meshes:
                spec = parse_mesh(mesh)
                _check_mesh(model, work, want, spec, rank, seed, f"seed={seed} {which} mesh={mesh} rank={rank}")
        if world == 2 and "v4" in models:
            # eager steps send only the routed pairs (sharding/ep_ragged.py): a capacity of 1, which
            # the static path would overflow, drops nothing and changes nothing
            model = _model("v4", seed)
            c = model.config
            work = _workload(seed + 20, 4, c.vocab_size)
            want = _serve(model, work, list(range(4)))
            pl = _placement(seed, c.n_routed_experts, 2)
            grp = ep_group(pl, 1, c.num_experts_per_tok, dist.group.WORLD, capacity=1)
            got = _serve(
                Model(c, rank_params(model.params, c, rank_expert_ids(MeshSpec(ep=2), rank, pl))),
                work,
                [rank, rank + 2],
                grp,
            )
            check_overflow(grp)
            assert got and int(grp.loads.sum()) > 0, f"seed={seed} rank={rank}"
            for key, logits in got.items():
                torch.testing.assert_close(logits, want[key], rtol=1e-5, atol=1e-5, msg=f"seed={seed} {key}")
    finally:
        dist.destroy_process_group()


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


@pytest.mark.parametrize(
    "world, meshes, models",
    [
        (2, ("ep2",), ("v4", "v41")),
        (4, ("ep4", "dp2,ep2"), ("v4", "v41")),
        (2, ("ep2",), ("v4-fp8",)),
    ],
    ids=["ep2", "ep4", "ep2-fp8-held"],
)
def test_mesh_logits_equal_one_process(tmp_path, world: int, meshes: tuple[str, ...], models: tuple[str, ...]) -> None:
    seed = _seed()
    print(f"seed={seed}")
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), seed, meshes, models), nprocs=world, join=True)


@pytest.mark.parametrize("which", list(CONFIGS))
def test_one_rank_mesh_with_redundant_experts(which: str) -> None:
    """Mesh (1): the swap runs the EP code with no process group over physical slots (extra
    replicas included) and changes nothing."""
    seed = _seed()
    model = _model(which, seed)
    work = _workload(seed + 1, 3, model.config.vocab_size)
    want = _serve(model, work, [0, 1, 2])
    grp = _check_mesh(model, work, want, MeshSpec(), 0, seed, f"seed={seed} {which} mesh=1")
    assert grp.process_group is None and grp.placement.n_physical > model.config.n_routed_experts
