"""The long-context case (16,389 in, 4,096 out, nextn=0: no drafter) on a one-layer tiny model, CPU.
About 30-50 s on the shared 2-core machine (the prefill ~20 s, the 4,096 decode steps the rest)."""

from __future__ import annotations

import math

from deepinfer_fx.engine import LLM
from deepinfer_fx.eval.long_context import (
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    TINY_LONG,
    run_case,
)
from deepinfer_fx.io.writer import write_random_checkpoint


def test_long_context_case(tmp_path):
    path = write_random_checkpoint(tmp_path / "tiny-long", TINY_LONG, seed=0, mtp=False)
    llm = LLM(
        model=str(path),
        eager=True,
        max_model_len=INPUT_TOKENS + OUTPUT_TOKENS,
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        num_threads=1,
    )
    r = run_case(llm)
    assert (r["input_tokens"], r["output_tokens"], r["nextn"]) == (16_389, 4_096, 0)
    assert r["finish_reason"] == "length" and r["all_logprobs_finite"] and math.isfinite(r["decode_ppl"])
