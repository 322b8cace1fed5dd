"""Pareto plots from ``p8_vs_hf`` results: decode tok/s/user against tok/s/GPU (one point per
batch size, one curve per engine and context) and prefill tok/s/GPU and latency against chunk
size; this engine, HF transformers and the roofline on the same axes.

    python -m deepinfer_fx.bench.plots bench/results/sweep/run*/*.json --out bench/results/latest/sweep

Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ENGINES = {"ours": "deepinfer_fx", "hf": "HF transformers (eager)", "roofline": "roofline"}


def decode_curves(results: list[dict]) -> dict[tuple[str, int, str], list[tuple[float, float, int]]]:
    """(engine, context, model) -> [(tok/s/user, tok/s/GPU, batch)] sorted by batch. Throughput per
    GPU counts steps/s x batch x (1 + nextn) / cp, as DeepInfer reports it."""
    curves: dict[tuple[str, int, str], list[tuple[float, float, int]]] = {}
    for res in results:
        tokens_per_step = 1 + res.get("nextn", 0)
        for row in res.get("decode", []):
            for engine in ENGINES:
                ms = row.get(f"{engine}_ms")
                if ms:
                    steps = 1e3 / ms
                    point = (
                        steps * tokens_per_step,
                        steps * row["batch"] * tokens_per_step / res.get("cp", 1),
                        row["batch"],
                    )
                    curves.setdefault((engine, row["context"], res.get("model", "")), []).append(point)
    return {k: sorted(v, key=lambda p: p[2]) for k, v in curves.items()}


def prefill_curves(results: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """engine -> [(chunk tokens, tok/s/GPU, latency ms)] sorted by chunk size."""
    curves: dict[str, list[tuple[int, float, float]]] = {}
    for res in results:
        for row in res.get("prefill", []):
            for engine in ENGINES:
                ms = row.get(f"{engine}_ms")
                if ms:
                    curves.setdefault(engine, []).append(
                        (row["tokens"], row["tokens"] / ms * 1e3 / res.get("cp", 1), ms)
                    )
    return {k: sorted(v) for k, v in curves.items()}


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(p).read_text()) for p in args.results]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    dec = decode_curves(results)
    if dec:
        fig, ax = plt.subplots(figsize=(7, 5))
        for (engine, ctx, model), pts in sorted(dec.items()):
            style = "o-" if engine != "roofline" else "--"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                label=f"{ENGINES[engine]}, ctx {ctx}, {model.split(',')[0]}",
            )
            for user, gpu, b in pts:
                ax.annotate(str(b), (user, gpu), fontsize=7)
        ax.set(
            xlabel="tok/s per user",
            ylabel="tok/s per GPU",
            xscale="log",
            yscale="log",
            title="P8 decode on one H200 (labels: batch)",
        )
        ax.legend(fontsize=7)
        written.append(out / "decode_pareto.png")
        fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    pre = prefill_curves(results)
    if pre:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for engine, pts in sorted(pre.items()):
            style = "o-" if engine != "roofline" else "--"
            a1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=ENGINES[engine])
            a2.plot([p[0] for p in pts], [p[2] for p in pts], style, label=ENGINES[engine])
        a1.set(xlabel="chunk tokens", ylabel="tok/s per GPU", xscale="log", title="P8 prefill throughput")
        a2.set(xlabel="chunk tokens", ylabel="ms per chunk", xscale="log", yscale="log", title="P8 prefill latency")
        a1.legend(fontsize=7)
        written.append(out / "prefill.png")
        fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()
