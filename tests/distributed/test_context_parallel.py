"""Context parallelism (``sharding/cp.py``): prefill chunks split zigzag over a CP group give
the single-process logits for every rank's rows, leave every rank with the single-process state
(so the seams between pieces are right), and decode steps after them agree too; V4 and V4.1,
on meshes (cp2) and (cp2,ep2) (the MoE then runs over the EP group with each rank's experts)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_fx.api import random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.batch import make_batch
from deepinfer_fx.graphs.model import forward_batch
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.cp import cp_swaps, split_batch, zigzag_rows
from deepinfer_fx.sharding.ep import check_overflow, ep_group
from deepinfer_fx.sharding.mesh import parse_mesh
from deepinfer_fx.sharding.parallel import ep_swaps, rank_expert_ids, rank_params
from deepinfer_fx.sharding.world import build_mesh, moe_view, rank_coordinate
from tiny import tiny_v4, tiny_v41

TOL = dict(rtol=1e-5, atol=1e-5)


def test_zigzag_rows_partition_each_chunk_and_balance_the_causal_work() -> None:
    for length in (1, 7, 64, 101):
        for size in (1, 2, 4):
            parts = [zigzag_rows(length, r, size) for r in range(size)]
            assert sorted(sum(parts, [])) == list(range(length))
            if length >= 8 * size:  # causal work ~ sum of positions: within one piece of even
                work = [sum(p) for p in parts]
                assert max(work) - min(work) <= length * (length // (2 * size) + 1) / (2 * size)


def _config(which: str):
    return config_from_dict(tiny_v4() if which == "v4" else tiny_v41()).replace(fake_quant=False)


def _steps(seed: int, vocab: int) -> list[list[list[int]]]:
    """Two prefill chunks per request (three requests, uneven lengths), then three decode steps."""
    rng = random.Random(seed)
    lengths = [[rng.randint(9, 40) for _ in range(3)], [rng.randint(2, 30) for _ in range(3)]] + [[1, 1, 1]] * 3
    return [[[rng.randrange(3, vocab) for _ in range(n)] for n in step] for step in lengths]


def _check(rank: int, mesh: str, which: str, seed: int) -> None:
    """This rank's share of three requests (its EP coordinate picks the request set; the CP
    group shares it) against one process holding everything."""
    c = _config(which)
    spec = parse_mesh(mesh)
    coord = rank_coordinate(spec, rank)
    params = random_model(c, seed=seed).params
    ref_params, swaps = params, {}
    if spec.world_size > 1:
        world = build_mesh(spec)
        if spec.cp > 1:
            swaps.update(cp_swaps(world.get_group("cp")))
        if spec.ep > 1:
            loads = torch.rand(c.n_routed_experts, generator=torch.Generator().manual_seed(seed)) ** 4
            pl = eplb.plan_placement(loads, eplb.num_physical_experts(c.n_routed_experts, spec.ep, 3), spec.ep)
            group = ep_group(pl, 3 * 64, c.num_experts_per_tok, moe_view(world))
            swaps.update(ep_swaps(group))
            params = rank_params(params, c, rank_expert_ids(spec, rank, pl))
    ref_state, cp_state = (init_state(c, 256, torch.float32, "cpu", mtp=False, slots=3) for _ in range(2))
    starts = [0, 0, 0]
    for i, step in enumerate(_steps(seed + 7 * coord["ep"], c.vocab_size)):
        full = make_batch(step, [0, 1, 2], starts)
        ref, _ = forward_batch(ref_params, ref_state, c, full)
        if i < 2:  # prefill chunks: split over the CP group
            batch = split_batch(full, coord["cp"], spec.cp)
            want = ref[batch.split.rows]
        else:  # decode: every CP rank runs the step alike
            batch, want = full, ref
        with swapped(swaps):
            got, _ = forward_batch(params, cp_state, c, batch)
        where = f"{which} mesh={mesh} seed={seed} rank={rank} step={i}"
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{where}: {m}")
        starts = [s + len(t) for s, t in zip(starts, step)]
    for path, a, b in _leaves(ref_state, cp_state):
        torch.testing.assert_close(
            a[:3], b[:3], **TOL, msg=lambda m: f"{which} mesh={mesh} seed={seed} rank={rank} state {path}: {m}"
        )
    if spec.ep > 1:
        check_overflow(group)


def _leaves(a, b, path=""):
    if isinstance(a, dict):
        for k in a:
            yield from _leaves(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _leaves(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor) and a.dim() > 0:
        yield path, a, b


def _worker(rank: int, size: int, init_file: str, mesh: str, seeds: list[int]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=size, timeout=timedelta(seconds=120)
    )
    try:
        for seed in seeds:
            for which in ("v4", "v41"):
                _check(rank, mesh, which, seed)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh, seeds", [("cp2", 2), ("cp2,ep2", 1)])
def test_cp_prefill_then_decode_equals_one_process(tmp_path, mesh: str, seeds: int) -> None:
    size = parse_mesh(mesh).world_size
    drawn = [random.SystemRandom().randrange(2**31) for _ in range(seeds)]
    mp.spawn(_worker, args=(size, str(tmp_path / "rendezvous"), mesh, drawn), nprocs=size, join=True)


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_a_cp_group_of_one_is_the_plain_forward(which: str) -> None:
    """The split machinery without a process group: one rank owns every row (reordered)."""
    _check(0, "1", which, random.SystemRandom().randrange(2**31))
