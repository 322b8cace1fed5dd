"""The V4.1 vision path at the released widths (32-layer ViT, width 1024, aligner into 5120),
random bf16 weights: preprocessing one image on the host, then encoding it on the GPU.

    python -m deepinfer_fx.bench.vision      # 1374 x 1260: 90 x 99 patches, 990 image tokens, a 1022-position span
    python -m deepinfer_fx.bench.vision --width 1920 --height 1080 --batch 4 --out vision_1080p

The image is random noise of ``--width x --height`` pixels; the resize plan decides its patch
grid (at most 1024 span positions). ``--batch`` images of that size are encoded in one call
(each attends only to itself). Reports ms per call, patches and image tokens per second, and
the peak memory of the call, for the eager tower and the compiled one the engine runs
(``vision/compiled.py``, Inductor) in the same process, and their ratio; writes
``bench/results/latest/<out>.json``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ..config import load_config
from ..config import released_config
from ..graphs.param_spec import build_tree, init_param
from ..vision.compiled import compiled_parts
from ..vision.merge import encode, token_grids
from ..vision.params import vision_specs
from ..vision.processor import preprocess
from ..vision.spans import span_length
from ..vision.vit import EAGER
from .p8 import run_info, write_result
from .roofline import measure_ceilings
from .timing import timed


def vision_params(c, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """Random weights of the vision path alone (the text model is not built)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return build_tree({s.path: init_param(s, gen, dtype, c.n_routed_experts) for s in vision_specs(c)})


def tower_flops(c, aligner: dict, grids: list[tuple[int, int]]) -> float:
    """Matmul FLOPs of encoding images with ViT patch grids ``grids``: per patch the patch
    projection and each block's qkv, output, SwiGLU projections and attention over its image's
    patches; per aligner token the aligner's two projections."""
    v = c.vision
    d, m = v.hidden_size, v.intermediate_size
    flops = 0.0
    for gh, gw in grids:
        p = gh * gw
        flops += 2 * p * v.patch_dim * d + v.num_hidden_layers * (2 * p * (4 * d * d + 3 * d * m) + 4 * p * p * d)
    tokens = sum(h * w for h, w in token_grids(c, grids))
    return flops + 2 * tokens * (aligner["w1"].numel() + aligner["w2"].numel())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_fx.bench.vision", description=__doc__.split("\n\n")[0])
    # the default nearly fills the 1024-position budget: 30 x 33 aligner tokens, 1022 with newlines and ends
    ap.add_argument("--width", type=int, default=1374)
    ap.add_argument("--height", type=int, default=1260)
    ap.add_argument("--batch", type=int, default=1, help="images per encode call (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--out", default="vision_v41_released", help="result name under bench/results/latest (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.vision runs on a CUDA GPU")
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    c = load_config(released_config("deepseek_v41_flash"))
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8), "RGB")
        for _ in range(args.batch)
    ]
    t0 = time.perf_counter()
    pixel_values, grids = preprocess(images, c)
    host_s = time.perf_counter() - t0
    model = (c, vision_params(c, dtype, dev))
    pixels = pixel_values.to(dev, non_blocking=False)
    ((h, w),) = set(token_grids(c, grids))
    patches, tokens = pixel_values.shape[0], args.batch * h * w
    flops = tower_flops(c, model[1]["aligner"], grids)
    ceil = measure_ceilings()  # the GPU that runs, not the H200's constants
    runs = {}
    for name, parts in (("eager", EAGER), ("compiled", compiled_parts("inductor"))):
        with torch.no_grad():
            t0 = time.perf_counter()
            encode(model, pixels, grids, parts)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats(dev)
            s = timed(lambda: encode(model, pixels, grids, parts), args.iters)
            peak = torch.cuda.max_memory_allocated(dev)
        runs[name] = {
            "first_call_s": round(first_s, 2),
            "encode_ms": round(s * 1e3, 3),
            "patches_per_s": round(patches / s, 1),
            "image_tokens_per_s": round(tokens / s, 1),
            "peak_memory_gib": round(peak / 2**30, 3),
            "tflops_per_s": round(flops / s / 1e12, 1),
            "of_bf16_ceiling": round(flops / ceil.bf16_flops / s, 3),
        }
    result = {
        "run": run_info(argv),
        "image": {
            "width": args.width,
            "height": args.height,
            "batch": args.batch,
            "patch_grid": list(grids[0]),
            "token_grid": [h, w],
            "span_positions": span_length(h, w),
        },
        "vit": {
            "layers": c.vision.num_hidden_layers,
            "hidden": c.vision.hidden_size,
            "heads": c.vision.num_attention_heads,
            "mlp": c.vision.intermediate_size,
            "dtype": args.dtype,
        },
        "preprocess_ms": round(host_s * 1e3, 2),
        "tflop_per_call": round(flops / 1e12, 3),
        "bf16_ceiling": ceil.as_dict(),
        **runs,
        "compiled_speedup": round(runs["eager"]["encode_ms"] / runs["compiled"]["encode_ms"], 3),
    }
    path = write_result(args.out, result)
    for name, r in runs.items():
        print(
            f"{name}: {args.batch} x {args.width}x{args.height}: {patches} patches -> {tokens} image tokens; encode "
            f"{r['encode_ms']} ms ({r['image_tokens_per_s']} tok/s, {r['of_bf16_ceiling']} of the bf16 matmul "
            f"ceiling), first call {r['first_call_s']} s"
        )
    print(f"compiled / eager: {result['compiled_speedup']}x; preprocess {result['preprocess_ms']} ms; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
