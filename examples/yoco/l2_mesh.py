"""``l2.py --mesh epN``: the same teacher-forced runs on N expert-parallel ranks.

One process per rank (torch.multiprocessing; gloo on the CPU, nccl with one GPU a rank), each
holding its share of the trunk's routed experts (``sharding.parallel.rank_params`` under the
engine's start placement) and running the trunk's MoE over the EP group (the
``moe.expert_parallel`` swap), as ``LLM(mesh="epN")`` does. Every rank teacher-forces its own
random prompt (seed + rank) in the same number and shape of steps, so the all-to-alls pair up.
Per rank: compact against exact on the mesh, and exact on the mesh against exact in one process
(the same rank's full tree, every expert local): the arithmetic's noise reference. Rank 0
gathers the rows. Each rank loads the whole checkpoint (the one-process reference needs it),
so the model must fit one device.

The DSpark drafter has its own expert count, which the trunk's EP group does not place (nor
does the engine's), so each rank keeps the drafter's experts whole and drafts locally.
"""

from __future__ import annotations

import json
import os
import tempfile
from argparse import Namespace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from l2_runs import forced_ids, has_dspark, rank_result, teacher_forced

from deepinfer_fx.api import Model, load_model
from deepinfer_fx.graphs.param_spec import ParamSpec
from deepinfer_fx.sharding.ep import check_overflow, ep_group
from deepinfer_fx.sharding.mesh import MeshSpec, parse_mesh
from deepinfer_fx.sharding.parallel import ep_swaps, rank_expert_ids, rank_params, start_placement


def mesh_spec(text: str | None, device: str) -> MeshSpec:
    """``--mesh``, refused unless this script can run it (never silently run as one process)."""
    try:
        spec = parse_mesh(text or "1")
    except ValueError as e:
        raise SystemExit(f"--mesh: {e}") from None
    if spec.cp > 1:
        raise SystemExit(
            f"--mesh {text}: compact prefill with context parallelism is not built (hidden_streams refuses it); use epN"
        )
    if spec.dp > 1:
        raise SystemExit(f"--mesh {text}: l2 runs one EP group (epN); dp replicas of it would measure nothing new")
    if spec.ep > 1 and device.startswith("cuda") and torch.cuda.device_count() < spec.ep:
        raise SystemExit(f"--mesh {text}: needs {spec.ep} GPUs (one a rank), this host has {torch.cuda.device_count()}")
    return spec


def run_mesh(args: Namespace, spec: MeshSpec) -> list[dict]:
    """Spawn ``spec.ep`` ranks; returns each rank's result, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, spec, tmp), nprocs=spec.ep, join=True)
        with open(os.path.join(tmp, "ranks.json")) as f:
            return json.load(f)


def _rank(rank: int, args: Namespace, spec: MeshSpec, tmp: str) -> None:
    cuda = args.device.startswith("cuda")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=spec.ep,
        timeout=timedelta(seconds=600),
    )
    # with 2 intra-op threads the same CPU forward was seen to differ from itself under load
    # (tests/distributed/test_eplb_runtime.py): one thread, so mesh vs one process is arithmetic only
    torch.set_num_threads(1)
    try:
        mine = measure_rank(args, spec, rank, device)
        got = [None] * spec.ep if rank == 0 else None
        dist.gather_object(mine, got, dst=0)
        if rank == 0:
            with open(os.path.join(tmp, "ranks.json"), "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


def measure_rank(args: Namespace, spec: MeshSpec, rank: int, device: torch.device) -> dict:
    """This rank's exact and compact runs on the mesh, and its exact run in one process."""
    full = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    c = full.config
    dspark = has_dspark(full) and not args.no_dspark
    placement = start_placement(c.n_routed_experts, spec.ep)
    trunk = rank_expert_ids(spec, rank, placement)

    def experts(s: ParamSpec) -> list[int]:  # the drafter's stacks stay whole (module docstring)
        return list(range(s.shape[0])) if s.path.startswith("mtp.") else trunk(s)

    local = Model(c, rank_params(full.params, c, experts), full.path)
    n = args.prompt_len
    chunk = args.chunk or n
    # capacity_factor 0: the worst case, so no token-expert pair is dropped (check_overflow below)
    group = ep_group(placement, chunk, c.num_experts_per_tok, dist.group.WORLD, device=device, capacity_factor=0)
    swaps = ep_swaps(group)
    ids = forced_ids(c.vocab_size, n, args.decode, args.seed + rank, device)
    exact = teacher_forced(local, ids, n, None, chunk, dspark, swaps)
    compact = teacher_forced(local, ids, n, args.keep, chunk, dspark, swaps)
    check_overflow(group)
    alone = teacher_forced(full, ids, n, None, chunk, dspark)
    return rank_result(rank, args.seed + rank, dspark, compact, exact, alone, ids[n:])
