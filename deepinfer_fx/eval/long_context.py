"""The long-context case: 16,389 prompt tokens, then 4,096 greedy output tokens, in one request.

The case runs at the nextn of the engine it is given (its ``speculative_config``; DeepInfer's
runs nextn=5 with its drafter) and its result says which. On the CPU it runs on
``TINY_LONG``: one HCA layer (ratio 128) at the tiny widths with 2 Sinkhorn iterations, chosen
because a 4,096-step decode is host-bound there (a 1-layer CSA model's 16k prefill alone took
~150 s on the shared CI machine; this one's whole case 30-50 s). The GPU bench runs it at P8 widths
(``deepinfer_fx/bench/long_context.py``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from .workloads import TINY

INPUT_TOKENS = 16_389
OUTPUT_TOKENS = 4_096

TINY_LONG = {
    **TINY,
    "num_hidden_layers": 1,
    "compress_ratios": [128],
    "num_hash_layers": 0,
    "hc_sinkhorn_iters": 2,
    "max_position_embeddings": 32_768,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}


def long_prompt(vocab: int, length: int = INPUT_TOKENS) -> list[int]:
    # deterministic ids above the special tokens; a period that no window or compression block divides
    return [3 + (i * 7919) % (vocab - 3) for i in range(length)]


def run_case(llm: Any, input_tokens: int = INPUT_TOKENS, output_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    """Run the case once on ``llm``; the numbers a test checks and a bench records."""
    from ..engine import SamplingParams

    prompt = long_prompt(llm.model.config.vocab_size, input_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True, logprobs=0)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0].outputs[0]
    wall = time.perf_counter() - start
    stats = llm.last_stats
    spec = llm.speculative
    lps = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    decode_s = max(wall - stats.prefill_time, 1e-9)
    return {
        "input_tokens": input_tokens,
        "output_tokens": len(out.token_ids),
        "nextn": 0 if spec is None else spec.num_speculative_tokens,
        "drafter": None if spec is None else spec.method,
        "finish_reason": out.finish_reason,
        "wall_s": round(wall, 3),
        "prefill_s": round(stats.prefill_time, 3),
        "decode_tok_per_s": round((len(out.token_ids) - 1) / decode_s, 2),
        "decode_ppl": math.exp(-math.fsum(lps) / len(lps)) if lps else math.nan,
        "all_logprobs_finite": all(math.isfinite(v) for v in lps),
    }
