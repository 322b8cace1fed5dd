"""Context parallelism (``sharding/cp.py``): prefill chunks split zigzag over a CP group give
the single-process logits for every rank's rows, leave every rank with the single-process state
(so the seams between pieces are right), and decode steps after them agree too; V4 and V4.1,
on meshes (cp2) and (cp2,ep2) (the MoE then runs over the EP group with each rank's experts).
The static split of compiled steps (``split_bucket``): the same, over padded buckets, compiled."""

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
from deepinfer_fx.engine.steps import bucket_batch, decode_logits, prefill_logits
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.passes.compiler import compile_graph, make_backend
from deepinfer_fx.sharding import eplb
from deepinfer_fx.sharding.cp import ContextRank, cp_swaps, split_batch, split_bucket, zigzag_rows
from deepinfer_fx.sharding.dryrun import collectives
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


def test_static_split_partitions_the_bucket_and_gathers_it_back() -> None:
    """``split_bucket``: rank r holds pieces r and ``2 size - 1 - r`` of every padded chunk, the
    ranks' rows in rank order gathered through ``source`` are the bucket's rows in order, and
    only rows past a chunk's length are padding queries (position -1)."""
    for size, n_chunks, length in ((1, 2, 16), (2, 3, 16), (4, 2, 32), (3, 1, 12)):
        lens = torch.tensor([length, 5, 1, 0][:n_chunks])
        full = bucket_batch(torch.zeros(n_chunks * length, dtype=torch.long), torch.arange(n_chunks), 0 * lens, lens)
        shares = [split_bucket(full, r, size) for r in range(size)]
        piece = length // (2 * size)
        gathered = torch.cat([b.split.rows for b in shares])
        for r, b in enumerate(shares):
            mine = [*range(r * piece, (r + 1) * piece), *range((2 * size - 1 - r) * piece, (2 * size - r) * piece)]
            want = torch.tensor([c * length + j for c in range(n_chunks) for j in mine])
            assert torch.equal(b.split.rows, want), (size, r)
            (q,) = b.split.queries
            real = torch.tensor([[j < n for j in mine] for n in lens.tolist()])
            assert torch.equal(q.positions >= 0, real) and torch.equal(b.real_rows, real.reshape(-1)), (size, r)
            assert torch.equal(b.split.source[b.split.rows] - r * b.split.width, torch.arange(b.split.width))
        assert torch.equal(gathered[shares[0].split.source], torch.arange(n_chunks * length)), size


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


def _bucket_steps(seed: int, vocab: int) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """Two prefill steps of one bucket (3 chunks padded to 16 rows; no length a multiple of 4 but
    one full chunk; the second step continues every sequence) as ``prefill_logits``' inputs
    (every row's logits), and the sequences' ends."""
    rng = random.Random(seed)
    lengths = [[rng.choice([9, 13, 6]), rng.choice([5, 2]), 16], [rng.choice([13, 7]), rng.choice([3, 1]), 11]]
    steps, starts = [], torch.zeros(3, dtype=torch.long)
    for lens in map(torch.tensor, lengths):
        ids = torch.zeros(3, 16, dtype=torch.long)
        for j, n in enumerate(lens.tolist()):
            ids[j, :n] = torch.tensor([rng.randrange(3, vocab) for _ in range(n)])
        steps.append((ids.reshape(-1), torch.arange(3), starts, lens, torch.arange(48)))
        starts = starts + lens
    return steps, starts


def _real(lens: torch.Tensor) -> torch.Tensor:
    """The rows of a ``[3, 16]`` bucket that are some chunk's token."""
    return (torch.arange(16) < lens[:, None]).reshape(-1)


def _check_bucket(rank: int, size: int, which: str, seed: int, compiled: bool) -> list[str]:
    """Two prefill steps of one bucket through ``prefill_logits`` with this rank's static share
    (``ContextRank.bucket``), the CP gather and the EP dispatch over the same ranks in force
    (compiled: one graph, traced once, serving both), then a decode step whole, against one
    process: every real row's logits and the state equal. Returns the collectives the prefill
    graph holds (compiled)."""
    c = _config(which)
    params = random_model(c, seed=seed).params
    placement = eplb.default_placement(c.n_routed_experts, c.n_routed_experts, size)
    group = ep_group(placement, 48, c.num_experts_per_tok, dist.group.WORLD)
    swaps = {**cp_swaps(dist.group.WORLD), **ep_swaps(group)}
    mine = rank_params(params, c, rank_expert_ids(parse_mesh(f"ep{size}"), rank, placement))
    ref_state, cp_state = (init_state(c, 64, torch.float32, "cpu", mtp=False, slots=3) for _ in range(2))
    backend = make_backend("cpu", name="prefill-cp") if compiled else None

    def prefill(p, state, *inputs):
        return prefill_logits(p, state, c, *inputs, split=ContextRank(rank, size).bucket)

    fn = compile_graph(prefill, backend) if compiled else prefill
    steps, ends = _bucket_steps(seed, c.vocab_size)
    for i, inputs in enumerate(steps):
        want = prefill_logits(params, ref_state, c, *inputs)
        with swapped(swaps):
            got = fn(mine, cp_state, *inputs)
        real, where = _real(inputs[3]), f"{which} compiled={compiled} seed={seed} rank={rank} step={i}"
        torch.testing.assert_close(got[real], want[real], **TOL, msg=lambda m: f"{where}: {m}")
    next_token, one = torch.tensor([5, 6, 7, 0]), torch.ones(3, dtype=torch.long)
    want = decode_logits(params, ref_state, c, next_token, torch.arange(3), ends, one)
    with swapped(swaps):
        got = decode_logits(mine, cp_state, c, next_token, torch.arange(3), ends, one)
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{which} seed={seed} rank={rank} decode: {m}")
    for path, a, b in _leaves(ref_state, cp_state):
        torch.testing.assert_close(a[:3], b[:3], **TOL, msg=lambda m: f"{which} seed={seed} rank={rank} {path}: {m}")
    check_overflow(group)
    return [] if backend is None else sorted({x.kind for gm in backend.graphs for x in collectives(gm, "prefill")})


def _bucket_worker(rank: int, size: int, init_file: str, seed: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=size, timeout=timedelta(seconds=300)
    )
    try:
        torch.set_num_threads(1)
        # compiling costs ~40 s a model here: V4 compiled, V4.1's static split eagerly
        got = _check_bucket(rank, size, "v4", seed, compiled=True)
        assert got == ["all_gather_into_tensor", "all_to_all_single"], f"rank={rank}: {got}"
        _check_bucket(rank, size, "v41", seed, compiled=False)
    finally:
        dist.destroy_process_group()


def test_compiled_static_split_with_ep_equals_one_process(tmp_path) -> None:
    """Two ranks forming the CP group and, with the same ranks, an EP group (what a cp2,ep2 mesh
    runs, on two processes): the compiled prefill graph holds the all-gather and the all-to-all."""
    seed = random.SystemRandom().randrange(2**31)
    mp.spawn(_bucket_worker, args=(2, str(tmp_path / "rendezvous"), seed), nprocs=2, join=True)


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_a_static_split_over_one_rank_is_the_plain_prefill(which: str) -> None:
    """``split_bucket`` without a process group: one rank owns every row."""
    c, seed = _config(which), random.SystemRandom().randrange(2**31)
    params = random_model(c, seed=seed).params
    ref_state, cp_state = (init_state(c, 64, torch.float32, "cpu", mtp=False, slots=3) for _ in range(2))
    for inputs in _bucket_steps(seed, c.vocab_size)[0]:
        want = prefill_logits(params, ref_state, c, *inputs)
        got = prefill_logits(params, cp_state, c, *inputs, split=ContextRank(0, 1).bucket)
        real = _real(inputs[3])
        torch.testing.assert_close(got[real], want[real], **TOL, msg=lambda m: f"{which} seed={seed}: {m}")
    for path, a, b in _leaves(ref_state, cp_state):
        torch.testing.assert_close(a[:3], b[:3], **TOL, msg=lambda m: f"{which} seed={seed} state {path}: {m}")
