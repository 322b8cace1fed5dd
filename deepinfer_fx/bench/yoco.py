"""V4.1 compact prefill (spec §8.2) against exact prefill on one GPU: tokens/s and their ratio,
and the L2 drift of the last rows' logprobs, per prompt length.

    python -m deepinfer_fx.bench.yoco --config v41 --lens 4096,16384,32768
    python -m deepinfer_fx.bench.yoco --config path/to/config.json --keep 140 --out yoco_v41

``--config``: a bench config name of ``deepinfer_fx.bench.configs`` (``v41``: V4.1-Flash widths,
10 layers, decoder = layers 5-9, half of them) or a V4.1 ``config.json``. Random bf16 weights,
fake-quant off (as the other benches). Each length runs one chunk of that many tokens through
``StepGraphs`` (Inductor, captured), exact and compact, on the same state slot; the logits of
the chunk's last row come from both, and the drift is their logprobs' largest difference
(random weights at real widths; ``examples/yoco/l2.py`` gives drift per position with a noise
floor on a checkpoint).
"""

from __future__ import annotations

import argparse

import torch

from ..api import random_model
from ..config import ModelConfig, load_config
from ..engine.graph_runner import StepGraphs
from ..graphs.state import init_state
from .configs import bench_config
from .p8 import run_info, write_result
from .timing import timed


def bench_model_config(name: str) -> ModelConfig:
    """A bench config by name (``bench/configs.py``) or a config.json path."""
    if name.endswith(".json"):
        return load_config(name).replace(fake_quant=False)
    try:
        return bench_config(name)
    except ValueError as e:
        raise SystemExit(f"--config: {e}; or pass a config.json path") from None


def run_length(model, length: int, keep: int, iters: int) -> dict:
    c = model.config
    ids = torch.randint(3, c.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    out: dict = {"tokens": length}
    last: dict[str, torch.Tensor] = {}
    for mode, k in (("off", None), ("compact", keep)):
        state = init_state(c, length + 1, model.dtype, device=model.device, mtp=False, slots=1)
        steps = StepGraphs(
            model,
            state,
            torch.zeros(2, dtype=torch.long, device=model.device),
            max_requests=1,
            max_tokens=length,
            inductor=True,
            keep=k,
        )
        keep_from = [max(0, length - keep)] if k else []

        def step():
            return steps.prefill([(0, 0, ids)], keep_from=keep_from)[0]

        with torch.no_grad():
            first = step()  # compiles and captures
            last[mode] = first.logits[0].float().log_softmax(-1).clone()
            s = timed(step, iters)
        out[mode] = {
            "ms": round(s * 1e3, 3),
            "tok_s": round(length / s, 1),
            "compile_s": round(steps.report()[0]["compile_s"], 1),
        }
        steps = state = None  # free this mode's graphs before the next one compiles
        torch.cuda.empty_cache()
    out["ratio"] = round(out["compact"]["tok_s"] / out["off"]["tok_s"], 3)
    out["drift_max_abs_logprob"] = (last["compact"] - last["off"]).abs().max().item()
    out["same_argmax"] = bool(last["compact"].argmax() == last["off"].argmax())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="v41")
    ap.add_argument("--lens", default="4096,16384,32768")
    ap.add_argument("--keep", type=int, default=140)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="yoco_prefill")
    args = ap.parse_args(argv)
    c = bench_model_config(args.config)
    if not c.is_v41:
        raise SystemExit(f"--config {args.config}: compact prefill needs a V4.1 config, got {c.model_type}")
    model = random_model(c, seed=0, dtype=torch.bfloat16, device="cuda")
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        rows.append(run_length(model, n, args.keep, args.iters))
        print(rows[-1], flush=True)
    result = {
        **run_info(argv),
        "config": args.config,
        "keep": args.keep,
        "layers": c.num_hidden_layers,
        "decoder_layers": list(c.decoder_layers),
        "rows": rows,
    }
    print(write_result(args.out, result))


if __name__ == "__main__":
    main()
