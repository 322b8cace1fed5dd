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
    except near-tie flips (``compare``; counted and listed in the JSON);
(d) with ``--eplb``, ``rebalance_experts()`` between the two calls (the EPLB shuffle mid-run),
    with the redundant experts the engine adds (``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS``,
    rounded up to a multiple of the EP degree; checked and reported);
(b, c) decode and prefill steps timed in lock step, with the EP all-to-all time per MoE layer
    (``bench/mesh_steps.py`` says what a step is and how the collectives are timed).
Steps are compiled on GPUs (the engine's ``StepGraphs``, CUDA graphs for decode; the ranks agree
on each turn's graphs) and eager on the CPU (``--steps-mode`` overrides); cp meshes step eagerly
for now. The JSON's ``engine.steps`` says which ran, for the mesh and for the reference.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..api import random_model
from ..config import ModelConfig, config_from_dict
from ..demo import DEMO_CONFIG
from ..engine.llm import LLM
from ..engine.sampling import SamplingParams
from ..settings import setting
from ..sharding.eplb import EXTRA_EXPERTS_ENV, ExpertPlacement
from ..sharding.mesh import MeshSpec, parse_mesh
from ..sharding.world import init_world
from .mesh_steps import measure
from .p8 import P8, p8_config, run_info, write_result

# the device README: NVLink multicast stays off on the lent machines
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TOP_LOGPROBS = 5


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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
        help="auto: compiled on GPUs, eager on the CPU; cp meshes step eagerly either way for now",
    )
    ap.add_argument("--out", default="bench/results/latest")
    return ap.parse_args(argv)


def world_meshes(texts: list[str]) -> list[MeshSpec]:
    """The meshes asked for, checked against the launched world; one-line errors."""
    try:
        specs = [parse_mesh(t) for t in texts]
    except ValueError as e:
        raise SystemExit(f"mesh bench: {e}") from None
    sizes = sorted({s.world_size for s in specs})
    if sizes[0] == 1:
        raise SystemExit("mesh bench: every mesh needs 2+ ranks (the one-process reference runs on rank 0 by itself)")
    if len(sizes) > 1:
        raise SystemExit(
            f"mesh bench: meshes {' '.join(texts)} need different world sizes {sizes}; launch once per world size"
        )
    n = sizes[0]
    launched = os.environ.get("WORLD_SIZE")
    if launched is None:
        raise SystemExit(
            f"mesh bench: mesh {specs[0]} needs {n} processes; launch with torchrun --nproc-per-node {n} -m deepinfer_fx.bench.mesh ..."
        )
    if int(launched) != n:
        raise SystemExit(
            f"mesh bench: mesh {specs[0]} needs {n} ranks but torchrun started {launched}; use --nproc-per-node {n}"
        )
    return specs


def rank_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise SystemExit(
            f"mesh bench: local rank {local} has no GPU ({torch.cuda.device_count()} visible); lower --nproc-per-node"
        )
    return torch.device("cuda", local)


def model_config(tiny: bool, layers: int) -> ModelConfig:
    base = {k: v for k, v in DEMO_CONFIG.items() if k not in ("quantization_config", "expert_dtype")} if tiny else P8
    most = base["num_hidden_layers"]
    if not 1 <= layers <= most:
        raise SystemExit(
            f"mesh bench: --layers must lie in [1, {most}] for the {'demo' if tiny else 'P8'} widths, got {layers}"
        )
    cut = {
        "num_hidden_layers": layers,
        "compress_ratios": base["compress_ratios"][:layers],
        "num_hash_layers": min(base["num_hash_layers"], layers),
        "num_nextn_predict_layers": 0,
    }
    return (
        p8_config(**cut)
        if not tiny
        else config_from_dict({**base, **cut}, where="demo widths").replace(fake_quant=False)
    )


def make_prompts(n: int, lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lens[i % len(lens)])] for i in range(n)]


def _imbalance(placement: ExpertPlacement, loads: torch.Tensor) -> float:
    """Busiest EP rank's share of the measured loads over the mean rank's, under ``placement``."""
    per_rank = placement.rank_loads(loads.cpu())
    return round(float(per_rank.max() / per_rank.mean()), 4)


def serve(llm: LLM, prompts: list[list[int]], params: SamplingParams, rebalance: bool) -> tuple[list, dict | None]:
    """(token ids, logprobs) per request, served in two ``generate`` calls; with ``rebalance``
    the experts are re-placed between them (every rank calls this alike)."""
    half = len(prompts) // 2
    outs = llm.generate(prompts[:half], params)
    shuffle = None
    if rebalance:
        ep = llm.ranks.ep
        loads = ep.loads.clone()
        dist.all_reduce(loads, group=ep.process_group)  # what rebalance plans from: the EP group's sum
        before = ep.placement
        llm.rebalance_experts()
        after = llm.ranks.ep.placement
        shuffle = {
            "slots_moved": sum(a != b for a, b in zip(before.phys_to_logical, after.phys_to_logical)),
            "rank_load_imbalance_before": _imbalance(before, loads),
            "rank_load_imbalance_after": _imbalance(after, loads),
        }
    outs += llm.generate(prompts[half:], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], shuffle


def compare(got: list, want: list, tol: float) -> dict[str, Any]:
    """Greedy outputs against the reference, as vLLM's ``check_logprobs_close`` judges them:
    logprobs are compared on the entries both hold up to and including each request's first
    differing token (after it the contexts differ); a differing token passes only as a near-tie
    flip, where each run holds the other's token among its top entries and the reference's two
    candidates lie within ``tol`` of each other (a random-weight model has many such ties, and
    bf16 on a different batch split breaks them either way)."""
    mismatched, diff = [], 0.0
    for i, ((ids, lps), (ref_ids, ref_lps)) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
        for a, b in zip(lps[: first + 1], ref_lps[: first + 1]):
            diff = max([diff] + [abs(a[k] - b[k]) for k in a.keys() & b.keys()])
        if ids != ref_ids:
            tie = first < min(len(ids), len(ref_ids)) and _near_tie(
                lps[first], ref_lps[first], ids[first], ref_ids[first], tol
            )
            mismatched.append({"request": i, "first_differing_token": first, "near_tie": tie})
    ties = sum(m["near_tie"] for m in mismatched)
    return {
        "tokens_equal": not mismatched,
        "near_tie_flips": ties,
        "mismatched": mismatched,
        "max_logprob_diff": diff,
        "logprob_tol": tol,
        "ok": ties == len(mismatched) and len(got) == len(want) and diff <= tol,
    }


def _near_tie(lp: dict, ref_lp: dict, tok: int, ref_tok: int, tol: float) -> bool:
    return tok in ref_lp and ref_tok in lp and ref_lp[ref_tok] - ref_lp[tok] <= tol and lp[tok] - lp[ref_tok] <= tol


def expert_counts(llm: LLM) -> dict[str, Any]:
    p, extra = llm.ranks.ep.placement, setting(EXTRA_EXPERTS_ENV)
    return {
        "n_logical": p.n_logical,
        "extra_asked": extra,
        "n_physical": p.n_physical,
        "ep": p.ep_degree,
        "slots_per_rank": p.slots_per_rank,
        "rounded_to_ep": p.n_physical % p.ep_degree == 0
        and p.n_logical + extra <= p.n_physical < p.n_logical + extra + p.ep_degree,
    }


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
    todo = [("decode", b) for b in _ints(args.decode_batches)] + [("prefill", t) for t in _ints(args.prefill_tokens)]
    rows = {}
    for kind, size in todo:
        rows[kind, size] = measure(llm, kind, size, **kw)
        if dist.get_rank() == 0:
            where = "one gpu" if host is None else str(llm.ranks.spec)
            print(f"  [{where}] {kind} {size}: {rows[kind, size]}", flush=True)
    return rows


def steps_kind(llm: LLM) -> str:
    """How the engine steps: "compiled", "eager+kernels" (cp meshes: eager with the kernel
    swaps in force) or "eager" (the reference math)."""
    if llm.options.steps.compiled:
        return "compiled"
    return "eager+kernels" if "attention.mqa_with_sink" in llm.runner.swaps else "eager"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
            "prompt_lens": _ints(args.prompt_lens),
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
    lens, batches, chunks = _ints(args.prompt_lens), _ints(args.decode_batches), _ints(args.prefill_tokens)
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
        _free(device)
    dist.barrier(group=host)

    failed = []
    for spec in specs:
        llm = LLM(model, mesh=str(spec), eager=True if spec.cp > 1 and eager is False else eager, **engine)
        experts = expert_counts(llm)
        mesh_steps = steps_kind(llm)
        got, shuffle = serve(llm, prompts, params, rebalance=args.eplb)
        mesh_rows = timing_rows(llm, args, host)
        del llm
        _free(device)
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
