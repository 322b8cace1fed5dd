"""The engine on multi-rank meshes against one process (issue 8), one JSON per mesh.

    torchrun --nproc-per-node 8 -m deepinfer_fx.bench.mesh --mesh ep8 dp2,ep4 cp2,ep4 --layers 4 --eplb

Every rank draws the same random model from one seed on its own device (P8 widths cut to
``--layers`` layers; ``--tiny``: the demo model's widths, for CPU runs) and hands it to
``LLM(model, mesh=...)``, which keeps the rank's expert slots by the loader's own rule
(``Ranks.shard`` -> ``start_expert_ids``). Drawing on the device takes seconds where writing and
reading a P8 checkpoint would take minutes of every lent machine; per-rank checkpoint reading
has its own tests (``tests/distributed/test_rank_loading.py``).

Rank 0 first runs the one-process reference on its own device (on GPUs: the single-GPU
baseline) while the other ranks wait; then, per mesh (all of one world size, so one launch runs
them all):
(a) ``--requests`` greedy requests (prompts of ``--prompt-lens`` tokens, fixed seed) in two
    ``generate`` calls, compared with the reference: max |logprob diff| over the top-5 entries
    up to each request's first differing token within ``--logprob-tol``, and tokens equal
    except near-tie flips (``mesh_checks.compare``; counted and listed in the JSON);
(d) with ``--eplb``, ``rebalance_experts()`` between the two calls (the EPLB shuffle mid-run),
    with the redundant experts the engine adds (``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS``,
    rounded up to a multiple of the EP degree; checked and reported);
(b, c) decode and prefill steps timed in lock step, with the EP all-to-all time per MoE layer
    (``bench/mesh_steps.py`` says what a step is and how the collectives are timed).
Steps are compiled on GPUs (the engine's ``StepGraphs``, CUDA graphs for decode; the ranks agree
on each turn's graphs; on cp meshes the prefill graphs run the static split, ``sharding/cp.py``)
and eager on the CPU (``--steps-mode`` overrides). The JSON's ``engine.steps`` says which ran, for
the mesh and for the reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ..api import random_model
from ..config import ModelConfig
from ..engine.llm import LLM
from ..engine.sampling import SamplingParams
from ..sharding.mesh import MeshSpec
from ..sharding.world import init_world
from .mesh_checks import compare, expert_counts, serve, steps_kind
from .mesh_setup import MULTICAST_OFF, free_memory, ints, make_prompts, model_config, rank_device, world_meshes
from .mesh_steps import measure
from .p8 import run_info, write_result

TOP_LOGPROBS = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m deepinfer_fx.bench.mesh", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--mesh", nargs="+", required=True, help="meshes of one world size, e.g. ep4 dp2,ep2 cp2,ep2")
    ap.add_argument("--layers", type=int, default=4, help="the first N layers of P8 (or of the demo model with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the demo model's widths (CPU runs) instead of P8's")
    ap.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="auto: bf16 on GPUs, fp32 on the CPU"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-lens", default="7,33,100,250", help="prompt lengths, cycled over the requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--budget", type=int, default=512, help="max_num_batched_tokens of the engines serving the requests"
    )
    ap.add_argument("--logprob-tol", type=float, default=None, help="default 1e-4 in fp32, 5e-2 in bf16")
    ap.add_argument("--eplb", action="store_true", help="rebalance the experts between the two halves of the requests")
    ap.add_argument("--decode-batches", default="8,64,256", help="requests per serving rank")
    ap.add_argument(
        "--prefill-tokens", default="4096,16384", help="chunk lengths, one chunk per serving rank (per CP group)"
    )
    ap.add_argument("--context", type=int, default=512, help="position of the timed decode steps")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument(
        "--steps-mode",
        choices=("auto", "eager", "compiled"),
        default="auto",
        help="auto: compiled on GPUs, eager on the CPU",
    )
    ap.add_argument("--out", default="bench/results/latest")
    return ap.parse_args(argv)


def timing_rows(llm: LLM, args: argparse.Namespace, host: dist.ProcessGroup | None) -> dict[tuple[str, int], dict]:
    """Every timed row on ``llm``; rank 0 prints each as it lands, so a run cut short by a
    time limit or a later failure still reports the rows it measured."""
    kw = {
        "context": args.context,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "seed": args.seed,
        "host": host,
    }
    todo = [("decode", b) for b in ints(args.decode_batches)] + [("prefill", t) for t in ints(args.prefill_tokens)]
    rows = {}
    for kind, size in todo:
        rows[kind, size] = measure(llm, kind, size, **kw)
        if dist.get_rank() == 0:
            where = "one gpu" if host is None else str(llm.ranks.spec)
            print(f"  [{where}] {kind} {size}: {rows[kind, size]}", flush=True)
    return rows


def mesh_result(
    spec: MeshSpec,
    args: argparse.Namespace,
    argv: list[str] | None,
    c: ModelConfig,
    dtype: torch.dtype,
    engine: dict,
    experts: dict,
    check: dict,
    shuffle: dict | None,
    mesh_rows: dict,
    one_gpu: dict,
) -> dict:
    """The JSON of one mesh: how it was run, the checks, and per row the mesh, one GPU and the
    per-GPU throughput ratio."""
    info = run_info(argv)
    info["command"] = " ".join(
        [
            "torchrun",
            "--nproc-per-node",
            str(spec.world_size),
            "-m",
            "deepinfer_fx.bench.mesh",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    rows = [
        {
            "kind": kind,
            "size": size,
            **({"context": args.context} if kind == "decode" else {}),
            "mesh": mesh_rows[kind, size],
            "one_gpu": one_gpu[kind, size],
            "per_gpu_vs_one_gpu": round(
                mesh_rows[kind, size]["tok_s_per_gpu"] / one_gpu[kind, size]["tok_s_per_gpu"], 3
            ),
        }
        for kind, size in mesh_rows
    ]
    # a shuffle that moved nothing would leave the EPLB check vacuous (on ep1 it may rightly move nothing)
    ok = check["ok"] and experts["rounded_to_ep"] and (shuffle is None or spec.ep == 1 or shuffle["slots_moved"] > 0)
    return {
        **info,
        "mesh": str(spec),
        "world_size": spec.world_size,
        "degrees": {"dp": spec.dp, "cp": spec.cp, "ep": spec.ep},
        "ok": ok,
        "model": {
            "widths": "demo" if args.tiny else "P8",
            "layers": c.num_hidden_layers,
            "compress_ratios": list(c.compress_ratios),
            "n_routed_experts": c.n_routed_experts,
            "top_k": c.num_experts_per_tok,
            "dtype": str(dtype).removeprefix("torch."),
            "seed": args.seed,
            "weights": "random",
        },
        "engine": engine,
        "env": {k: os.environ.get(k) for k in MULTICAST_OFF},
        "experts": experts,
        "correctness": {
            "requests": args.requests,
            "prompt_lens": ints(args.prompt_lens),
            "max_tokens": args.max_tokens,
            **check,
            "eplb": shuffle,
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = world_meshes(args.mesh)
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    device = rank_device()
    c = model_config(args.tiny, args.layers)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype != "auto"
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    tol = args.logprob_tol if args.logprob_tol is not None else (1e-4 if dtype == torch.float32 else 5e-2)
    lens, batches, chunks = ints(args.prompt_lens), ints(args.decode_batches), ints(args.prefill_tokens)
    # compiled prefill graphs must hold the largest timed chunk, so the token budget covers it
    engine = {
        "max_num_seqs": max(batches + [1]),
        "max_num_batched_tokens": max([args.budget] + chunks),
        "max_model_len": max(chunks + [args.context + 1, max(lens) + args.max_tokens]),
    }
    eager = {"auto": None, "eager": True, "compiled": False}[args.steps_mode]

    init_world(specs[0], device.type)  # the engine's own join (NCCL on GPU LOCAL_RANK, gloo on the CPU)
    rank = dist.get_rank()
    host = dist.new_group(backend="gloo")  # host barriers and reductions, whatever the device
    model = random_model(c, seed=args.seed, dtype=dtype, device=device)
    prompts = make_prompts(args.requests, lens, c.vocab_size, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)

    if rank == 0:  # the one-process reference, while the other ranks wait
        ref = LLM(model, eager=eager, **engine)
        want, _ = serve(ref, prompts, params, rebalance=False)
        ref_steps = steps_kind(ref)
        one_gpu = timing_rows(ref, args, None)
        del ref
        free_memory(device)
    dist.barrier(group=host)

    failed = []
    for spec in specs:
        llm = LLM(model, mesh=str(spec), eager=eager, **engine)
        experts = expert_counts(llm)
        mesh_steps = steps_kind(llm)
        got, shuffle = serve(llm, prompts, params, rebalance=args.eplb)
        mesh_rows = timing_rows(llm, args, host)
        del llm
        free_memory(device)
        if rank == 0:
            steps = {"mesh": mesh_steps, "one_gpu": ref_steps}
            result = mesh_result(
                spec,
                args,
                argv,
                c,
                dtype,
                {**engine, "steps": steps},
                experts,
                compare(got, want, tol),
                shuffle,
                mesh_rows,
                one_gpu,
            )
            tag = f"{'demo' if args.tiny else 'p8'}l{c.num_hidden_layers}" + ("_eplb" if args.eplb else "")
            path = write_result(f"mesh_{str(spec).replace(',', '_')}_{tag}", result, args.out)
            check = result["correctness"]
            print(
                f"[mesh {spec}] ok={result['ok']} tokens_equal={check['tokens_equal']} near_tie_flips={check['near_tie_flips']} "
                f"max_logprob_diff={check['max_logprob_diff']:.3g} eplb={shuffle} -> {path}",
                flush=True,
            )
            for r in result["rows"]:
                print(f"  {r['kind']:7s} {r['size']:6d}: mesh {r['mesh']} | one gpu {r['one_gpu']}", flush=True)
            failed += [] if result["ok"] else [str(spec)]
        dist.barrier(group=host)
    dist.destroy_process_group()
    if failed:
        print(
            f"mesh bench: outputs or expert placement differ from the one-process reference on {' '.join(failed)}; see the JSON",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
