"""Offline inference, the way DeepInfer's example drives its engine.

    python examples/offline_inference.py --model /path/to/ckpt --ep 1 --max-tokens 64
    python examples/offline_inference.py            # the built-in tiny demo model (random weights)

Several ranks: ``torchrun --nproc-per-node 4 examples/offline_inference.py --ep 2 --cp 2`` (the
world is the product of the degrees; cp and ep must nest; steps compile on GPUs, except with cp > 1).
"""

from __future__ import annotations

import argparse

from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.sharding.mesh import mesh_from_degrees

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Explain mixture-of-experts models in one sentence:",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="demo", help="checkpoint directory, hub repo id, or 'demo' (default: %(default)s)"
    )
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default: %(default)s)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel degree (default: %(default)s)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel degree (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: %(default)s)")
    # sampled, not greedy, as DeepInfer's example runs; SamplingParams' own default is vLLM's 1.0
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="sampling temperature (default: %(default)s, as DeepInfer's example samples; SamplingParams "
        "defaults to 1.0 as in vLLM, python -m deepinfer_fx.generate to 0.0 = greedy)",
    )
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (default: %(default)s)")
    ap.add_argument("--eager", action="store_true", help="run the model functions uncompiled")
    ap.add_argument("--no-overlap", action="store_true", help="run steps synchronously")
    args = ap.parse_args()
    try:
        mesh = mesh_from_degrees(dp=args.dp, cp=args.cp, ep=args.ep)
    except ValueError as e:
        ap.error(str(e))

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
        llm = LLM(args.model, mesh=str(mesh), overlap=not args.no_overlap, eager=True if args.eager else None)
    except (ValueError, RuntimeError) as e:  # bad settings, or a mesh launched without torchrun
        raise SystemExit(f"error: {e}") from None
    for out in llm.generate(PROMPTS, params, use_tqdm=True):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    st = llm.last_stats
    print(
        f"prefill {st.prefill_tokens / max(st.prefill_time, 1e-9):.1f} tok/s, decode {st.decode_tokens / max(st.decode_time, 1e-9):.1f} tok/s"
    )


if __name__ == "__main__":
    main()
