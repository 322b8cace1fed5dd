"""``python -m deepinfer_fx.generate``: offline generation from the command line.

With no ``--model`` and no ``DEEPINFER_HF_MODEL_DIR`` it writes and runs the built-in tiny
demo model: a real tokenizer with RANDOM weights, so its text is gibberish.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .io.checkpoint import ENV_MODEL_DIR, CheckpointError
from .io.writer import write_random_checkpoint
from .settings import EngineConfig, setting
from .sharding.mesh import parse_mesh

DEMO_CONFIG = {
    "model_type": "deepseek_v4", "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64,
    "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4, 0], "index_n_heads": 16, "index_head_dim": 64, "index_topk": 8,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "moe_intermediate_size": 64, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 1, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
}
DEMO_DIR = Path(setting("DEEPINFER_DEMO_DIR") or Path.home() / ".cache" / "deepinfer_fx" / "demo-v4-tiny")


def demo_model_dir() -> Path:
    if not (DEMO_DIR / "model.safetensors.index.json").exists():
        write_random_checkpoint(DEMO_DIR, DEMO_CONFIG, seed=0)
    return DEMO_DIR


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_fx.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help=f"checkpoint directory or hub repo id (default: ${ENV_MODEL_DIR}, else the tiny demo)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", help="a text file with one prompt per line")
    s = ap.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--seed", type=int, default=0, help="engine seed; each request's stream derives from it")
    e = ap.add_argument_group("engine")
    e.add_argument("--mesh", default=None, help="e.g. ep8, ep2,dp4; more than one rank: launch under torchrun (cp meshes step eagerly for now, with the GPU kernels)")
    e.add_argument("--dry-run", action="store_true",
                   help="trace one rank's decode and prefill steps of --mesh on a fake process group with abstract "
                        "weights (no values are real), dump the graphs and print the collectives per MoE layer")
    e.add_argument("--rank", type=int, default=0, help="the world rank a --dry-run traces")
    e.add_argument("--plan", action="store_true",
                   help="print the memory one GPU of --mesh needs, by category, and whether the model fits (reads only the config)")
    e.add_argument("--gpu-memory-gb", type=float, default=141, help="a GPU's memory in GiB for --plan (default: an H200's 141)")
    mode = e.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="run the model functions uncompiled (no compile, no graphs)")
    mode.add_argument("--compile", action="store_true", help="compile the steps on the CPU too (default: on GPUs only)")
    e.add_argument("--no-cuda-graphs", action="store_true", help="compiled steps without graph capture")
    e.add_argument("--no-inductor", action="store_true", help="our passes on aot_eager instead of Inductor")
    e.add_argument("--dump-graphs", metavar="DIR", help="write every compiled graph, after each pass, with diffs and an index")
    e.add_argument("--disable-passes", metavar="NAMES", help="comma-separated graph passes to switch off (adds to DEEPINFER_DISABLE_PASSES)")
    e.add_argument("--no-overlap", action="store_true", help="run steps synchronously (no host/device overlap)")
    e.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    e.add_argument("--device", default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-fake-quant", action="store_true", help="skip the official fake-quant points")
    e.add_argument("--expert-format", choices=["auto", "fp8", "dequant"], default=None,
                   help="block-FP8 routed experts: keep fp8 or dequantise on load (default: DEEPINFER_EXPERT_FORMAT, auto = fp8 on CUDA)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.plan:
        from .engine.memory_plan import cli as plan

        try:
            return plan(args.model, args.mesh, args.gpu_memory_gb, dtype=args.dtype, eager=args.eager, expert_format=args.expert_format,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            ap.error(str(e))
    if args.dry_run:
        from .sharding.dryrun import cli as dry_run

        try:
            return dry_run(args.model, args.mesh or "1", args.rank, args.dump_graphs)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            ap.error(str(e))
    from .engine import LLM, SamplingParams  # after argparse: --help stays instant

    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            ap.error(f"--prompts-file: {e}")
    if not prompts:
        prompts = ["The weather today is"]
    try:
        if args.mesh:
            parse_mesh(args.mesh)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        ap.error(str(e))

    try:
        settings = EngineConfig.from_env()
    except ValueError as e:
        ap.error(str(e))
    path = args.model or settings.hf_model_dir
    if path is None:
        path = demo_model_dir()
        print(f"[demo] no checkpoint given: using the built-in tiny demo model at {path} (random weights: output is gibberish)")
    try:
        llm = LLM(
            path, dtype=args.dtype, device=args.device, eager=True if args.eager else (False if args.compile else None),
            overlap=not args.no_overlap, cuda_graphs=False if args.no_cuda_graphs else None,
            inductor=False if args.no_inductor else None, dump_graphs=args.dump_graphs, disable_passes=args.disable_passes,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, seed=args.seed, mesh=args.mesh,
            fake_quant=False if args.no_fake_quant else None, expert_format=args.expert_format,
        )
        outs = llm.generate(prompts, params, use_tqdm=True)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in outs:
        print(f"--- request {o.request_id} ({o.outputs[0].finish_reason})")
        print((o.prompt or "") + o.outputs[0].text)
    st = llm.last_stats
    plan = llm.plan
    print(
        f"prefill: {st.prefill_tokens} tokens, {st.prefill_tokens / max(st.prefill_time, 1e-9):.1f} tok/s; "
        f"decode: {st.decode_tokens} tokens, {st.decode_tokens / max(st.decode_time, 1e-9):.1f} tok/s; "
        f"{st.steps} steps in {st.wall:.2f}s"
    )
    print(
        f"cache: {llm.bytes_per_token():.0f} B/token of compressed state + {plan.fixed_bytes_per_slot / 2**20:.2f} MiB/sequence "
        f"fixed; the pool holds {plan.slots} sequences x {plan.max_len} tokens ({plan.tokens_capacity} tokens)"
    )
    if llm.runner.steps is not None:  # start-up cost: each graph compiles (and captures) on first use
        for r in llm.runner.steps.report():
            print(f"graph {r['graph']}: compile+first run {r['compile_s']:.1f}s, capture {r['capture_s']:.2f}s, "
                  f"{r['calls']} calls, pass rewrites {r['rewrites']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
