"""Sparse MQA at P8 widths: the Triton kernel's tilings against each other and the reference.

    python -m deepinfer_fx.bench.attention_kernel --prefill 4096,16384 --decode 1,64,256 [--decode-sweep] [--decode-ring]

64 heads x 512, one shared K = V head, bf16. The masks are the model's: a prefill chunk of T
queries from position 0 sees its 128-key window and, in a CSA layer, top-512 of its T/4
compressed entries (an HCA layer: all T/128; V4.1's CSA2 layers top-512 of T/2 or T entries);
each prefill case also runs with the live keys listed and with the live tiles listed
(``live="keys"`` / ``"tiles"``, tilings ``keys`` / ``tiles``; the rule picks by keys a query); a decode query sees ``--decode-keys`` keys (256:
its window and every entry of a 512-token CSA context). Each call runs captured in a CUDA
graph. Reported per case and tiling: ms and TFLOP/s counted on the live keys only (4 * H * d
flops per query and live key: QK and PV), the useful work; the shape rule's own tiling is
marked ``default``.
"""

from __future__ import annotations

import argparse

import torch

from ..graphs.attention import mqa_with_sink
from ..graphs.window import ring_positions, window_bias
from ..kernels.triton.attention import sparse_mqa_triton
from ..kernels.triton.ring_attention import ring_mqa_triton
from .p8 import run_info, write_result
from .timing import graph_ms

H, D, WINDOW, TOPK, ROPE_HALF = 64, 512, 128, 512, 32

# prefill tilings to compare with the rule's: (heads per program, warps, keys per tile, what a
# program lists, pipeline stages); session 45 swept heads x warps x keys per tile (64 x 8 x 64
# was the fastest at every layer, attention_kernel_prefill_keys_h100_s45.json), so these vary
# what is listed and the pipeline depth (the rule's: two stages since session 46)
_PREFILL_TILINGS = [
    (64, 8, 64, "keys", 2),
    (64, 8, 32, "keys", 2),
    (64, 8, 32, "keys", 3),
    (32, 4, 64, "keys", 2),
    (32, 4, 32, "keys", 3),
    (64, 8, 64, "tiles", 3),
    (64, 8, 32, "tiles", 3),
]
# decode tilings (``--decode-sweep``): (heads per program, warps, keys per tile, keys per split,
# split programs + combine, heads per combine program)
_DECODE_TILINGS = [
    (16, w, 64, split, par, ch)
    for w in (4, 8)
    for split in (64, 128, 256)
    for par, ch in ((False, 16), (True, 16), (True, 4), (True, 2))
]


def prefill_bias(t: int, ratio: int, device: str) -> torch.Tensor:
    """``[T, ring + T + entries]`` 0 / -inf: window keys (a ring of 128 before the chunk, then the
    chunk) and the compressed entries, all visible ones (HCA) or a random top-512 of them (CSA)."""
    pos = torch.arange(t, device=device)[:, None]
    key_pos = torch.cat([torch.arange(-WINDOW, 0, device=device), torch.arange(t, device=device)])[None, :]
    window = (key_pos <= pos) & (key_pos > pos - WINDOW)
    n_ent = t // ratio
    visible = torch.arange(n_ent, device=device)[None, :] < (pos + 1) // ratio
    if ratio < 128:  # the indexer keeps 512 of the visible entries: random scores, top 512
        scores = torch.rand(t, n_ent, device=device).masked_fill(~visible, -1.0)
        top = scores.topk(min(TOPK, n_ent), dim=-1).indices
        visible = torch.zeros_like(visible).scatter_(-1, top, True) & visible
    live = torch.cat([window, visible], 1)
    return torch.zeros(live.shape, device=device).masked_fill(~live, float("-inf"))


def _case(bias: torch.Tensor, lead: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    t, n = bias.shape[-2:]
    q = torch.randn(*lead, t, H, D, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(*lead, n, D, device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(H, device="cuda")
    angles = torch.rand(*lead, t, ROPE_HALF, device="cuda") * 6.3  # the queries' rope tables
    return q, keys, bias.expand(*lead, t, n).contiguous(), sink, angles.cos(), angles.sin()


def _time(q, keys, bias, sink, cos, sin, iters: int, **kw) -> tuple[float, float]:
    out = torch.empty_like(q)
    ms = graph_ms(lambda: sparse_mqa_triton(q, keys, bias, sink, cos, sin, out=out, **kw), iters)
    rows = slice(-256, None)  # the reference materialises [T, H, N] logits: check the last queries only
    ref = mqa_with_sink.reference(
        q[..., rows, :, :], keys, bias[..., rows, :], sink, cos[..., rows, :], sin[..., rows, :]
    ).float()
    err = ((out[..., rows, :, :].float() - ref).abs().max() / ref.abs().max()).item()
    return ms, err


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", default="4096", help="chunk lengths, comma-separated")
    ap.add_argument(
        "--prefill-layers",
        default="CSA,HCA,CSA2 ratio 2,CSA2 ratio 1",
        help="which kinds of layer the prefill cases take, comma-separated",
    )
    ap.add_argument("--decode", default="1,64", help="decode batch sizes, comma-separated")
    ap.add_argument("--decode-keys", default="256", help="keys per decode query, comma-separated")
    ap.add_argument("--decode-sweep", action="store_true", help="also time the decode tilings")
    ap.add_argument(
        "--decode-ring",
        action="store_true",
        help="also time ring_mqa (keys read in place) against gathered keys, per kind of layer",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    result = {**run_info(argv), "heads": H, "head_dim": D, "prefill": [], "decode": []}

    for t in [int(x) for x in args.prefill.split(",") if x]:
        for ratio, layer in ((4, "CSA"), (128, "HCA"), (2, "CSA2 ratio 2"), (1, "CSA2 ratio 1")):
            if layer not in args.prefill_layers.split(","):
                continue
            bias = prefill_bias(t, ratio, "cuda")
            live = int((bias == 0).sum())
            q, keys, bias, sink, cos, sin = _case(bias, ())
            flops = 4 * H * D * live
            for tiling in [None, "keys", "tiles", *_PREFILL_TILINGS]:
                if tiling is None or isinstance(tiling, str):
                    kw = {} if tiling is None else {"live": tiling}
                else:
                    kw = dict(zip(("heads", "num_warps", "block_n", "live", "num_stages"), tiling))
                try:
                    ms, err = _time(q, keys, bias, sink, cos, sin, args.iters, **kw)
                except Exception as e:  # a tiling that does not fit (shared memory) is reported, not fatal
                    print(f"prefill T={t} {layer} {tiling}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row = {
                    "tokens": t,
                    "layer": layer,
                    "tiling": "default" if tiling is None else tiling if isinstance(tiling, str) else list(tiling),
                    "live_keys_per_query": round(live / t, 1),
                    "ms": round(ms, 3),
                    "TFLOPs_live": round(flops / ms / 1e9, 1),
                    "max_rel_err": round(err, 4),
                }
                result["prefill"].append(row)
                print(row, flush=True)
            del q, keys, bias
            write_result("attention_kernel", result, args.out)

    # 128 keys: an SWA layer's window ring; 256: the ring and every entry of a 512-token CSA
    # context; 640: a CSA layer past 2k tokens (window + top-512)
    for b in [int(x) for x in args.decode.split(",") if x]:
        for n in [int(x) for x in args.decode_keys.split(",") if x]:
            bias = torch.zeros(1, n, device="cuda")
            q, keys, bias, sink, cos, sin = _case(bias, (b,))
            kv_bytes = keys.numel() * keys.element_size()
            for tiling in [None, *(_DECODE_TILINGS if args.decode_sweep else [])]:
                kw = (
                    {}
                    if tiling is None
                    else dict(zip(("heads", "num_warps", "block_n", "split", "parallel", "combine_heads"), tiling))
                )
                try:
                    ms, err = _time(q, keys, bias, sink, cos, sin, args.iters * 20, **kw)
                except Exception as e:  # a tiling that does not fit (shared memory) is reported, not fatal
                    print(f"decode b={b} n={n} {tiling}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row = {
                    "batch": b,
                    "keys": n,
                    "tiling": "default" if tiling is None else list(tiling),
                    "ms": round(ms, 4),
                    "kv_TBps": round(kv_bytes / ms / 1e9, 3),
                    "max_rel_err": round(err, 4),
                }
                result["decode"].append(row)
                print(row, flush=True)
            del q, keys, bias
    if args.decode_ring:
        result["decode_ring"] = [
            _ring_case(b, *layer, args.iters * 20)
            for b in [int(x) for x in args.decode.split(",") if x]
            for layer in _RING_LAYERS
        ]
    write_result("attention_kernel", result, args.out)
    return result


# decode layers for ``--decode-ring``: (name, entries a slot, rows read of them or None: all)
_RING_LAYERS = [("SWA", 0, None), ("HCA", 32, None), ("CSA", 1040, TOPK)]


def _ring_case(b: int, layer: str, e: int, k: int | None, iters: int) -> dict:
    """One decode layer (``_RING_LAYERS``) at batch ``b``: ``ring_mqa`` reading the ring and entry
    pools in place against ``sparse_mqa`` over keys gathered beforehand (the kernel alone) and
    with the gather in the timed graph (what the model's gathered path runs)."""
    g = torch.Generator(device="cuda").manual_seed(b)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, 1, H, D, generator=g, **dev)
    ring = torch.randn(b + 1, WINDOW, D, generator=g, **dev)
    pool = torch.randn(b + 1, e, D, generator=g, **dev) if e else None
    slots = torch.randperm(b + 1, device="cuda")[:b]
    pos = torch.randint(4 * WINDOW, 8 * WINDOW, (b,), device="cuda")
    rows = torch.sort(torch.randperm(e, device="cuda")[:k].expand(b, k)).values if k else None
    n_e = 0 if not e else (k or e)
    bias = torch.zeros(b, 1, n_e, device="cuda") if e else None
    sink = torch.randn(H, device="cuda")
    angles = torch.rand(b, 1, ROPE_HALF, device="cuda") * 6.3
    cos, sin = angles.cos(), angles.sin()

    def gathered() -> tuple[torch.Tensor, torch.Tensor]:
        keys, full = ring[slots], window_bias(pos[:, None], ring_positions(pos, WINDOW), WINDOW)
        if e:
            chosen = pool[slots] if rows is None else pool[slots].gather(1, rows[..., None].expand(-1, -1, D))
            keys, full = torch.cat([keys, chosen], 1), torch.cat([full, bias], -1)
        return keys, full

    out = torch.empty_like(q)
    keys, full = gathered()
    ring_ms = graph_ms(lambda: ring_mqa_triton(q, ring, slots, pos, pool, rows, bias, sink, cos, sin, out=out), iters)
    try:  # a third stage lets a tile's row numbers load a tile ahead of its keys; it may not fit in shared memory
        ring3 = round(
            graph_ms(
                lambda: ring_mqa_triton(q, ring, slots, pos, pool, rows, bias, sink, cos, sin, out=out, num_stages=3),
                iters,
            ),
            4,
        )
    except Exception as err:  # reported, not fatal
        ring3 = f"{type(err).__name__}: {str(err)[:100]}"
    kernel_ms = graph_ms(lambda: sparse_mqa_triton(q, keys, full, sink, cos, sin, out=out), iters)
    with_gather_ms = graph_ms(lambda: sparse_mqa_triton(q, *gathered(), sink, cos, sin, out=out), iters)
    same = torch.equal(
        ring_mqa_triton(q, ring, slots, pos, pool, rows, bias, sink, cos, sin),
        sparse_mqa_triton(q, keys, full, sink, cos, sin),
    )
    row = {
        "batch": b,
        "layer": layer,
        "keys": WINDOW + n_e,
        "ring_ms": round(ring_ms, 4),
        "ring_3_stages_ms": ring3,
        "gathered_kernel_ms": round(kernel_ms, 4),
        "gather_and_kernel_ms": round(with_gather_ms, 4),
        "bitwise_equal": same,
    }
    print(row, flush=True)
    return row


if __name__ == "__main__":
    main()
