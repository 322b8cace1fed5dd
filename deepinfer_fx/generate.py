"""``python -m deepinfer_fx.generate``: greedy generation from the command line.

This is the foundation's minimal driver (one sequence, eager, greedy); the engine issue grows it
into the full CLI. With no ``--model`` and no ``DEEPINFER_HF_MODEL_DIR`` it writes and runs the
built-in tiny demo model: a real tokenizer with RANDOM weights, so its text is gibberish.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .api import load_model
from .graphs.model import forward
from .graphs.state import init_state
from .io.checkpoint import ENV_MODEL_DIR, CheckpointError
from .io.tokenizer import decode, encode, load_tokenizer
from .io.writer import write_random_checkpoint

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
DEMO_DIR = Path(os.environ.get("DEEPINFER_DEMO_DIR", Path.home() / ".cache" / "deepinfer_fx" / "demo-v4-tiny"))


def demo_model_dir() -> Path:
    if not (DEMO_DIR / "model.safetensors.index.json").exists():
        write_random_checkpoint(DEMO_DIR, DEMO_CONFIG, seed=0)
    return DEMO_DIR


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_tokens: int, eos: tuple[int, ...]) -> tuple[list[int], float, float]:
    """Prefill the prompt in one pass, then decode one token per step. -> (ids, prefill s, decode s)."""
    c, params = model
    dev = params["norm"].device
    state = init_state(c, len(prompt_ids) + max_tokens, params["norm"].dtype, dev, mtp=False)
    t0 = time.perf_counter()
    logits, _ = forward(params, state, c, torch.tensor(prompt_ids, device=dev), 0)
    nxt = int(logits[-1].argmax())
    t1 = time.perf_counter()
    out = [nxt]
    pos = len(prompt_ids)
    while len(out) < max_tokens and nxt not in eos:
        logits, _ = forward(params, state, c, torch.tensor([nxt], device=dev), pos)
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        pos += 1
    return out, t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_fx.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help=f"checkpoint directory or hub repo id (default: ${ENV_MODEL_DIR}, else the tiny demo)")
    ap.add_argument("--prompt", default="The weather today is")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-fake-quant", action="store_true", help="skip the official fake-quant points")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")

    path = args.model or os.environ.get(ENV_MODEL_DIR)
    if path is None:
        path = demo_model_dir()
        print(f"[demo] no checkpoint given: using the built-in tiny demo model at {path} (random weights: output is gibberish)")
    try:
        model = load_model(path, dtype=getattr(torch, args.dtype), device=args.device, fake_quant=False if args.no_fake_quant else None)
        tok = load_tokenizer(model.path)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = encode(tok, args.prompt)
    if len(ids) + args.max_tokens > model.config.max_position_embeddings:
        print(f"error: prompt ({len(ids)} tokens) + max tokens exceeds the model's limit "
              f"({model.config.max_position_embeddings}); shorten the prompt or lower --max-tokens", file=sys.stderr)
        return 2
    out, t_prefill, t_decode = greedy(model, ids, args.max_tokens, model.config.eos_token_ids)
    print(args.prompt + decode(tok, out))
    print(f"prefill: {len(ids)} tokens in {t_prefill:.3f}s ({len(ids) / t_prefill:.1f} tok/s); "
          f"decode: {len(out)} tokens in {t_decode:.3f}s ({len(out) / max(t_decode, 1e-9):.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
