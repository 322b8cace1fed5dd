"""L1: compact prefill's bookkeeping against an independent computation, no weights, seconds.

    python examples/yoco/l1.py                      # the default grid; exit 1 on any mismatch
    python examples/yoco/l1.py --lens 300 --chunks 64,whole --keep 140 --shift-pivot 1   # fails

For each prompt length, chunking and KEEP, the engine's own functions (``graphs/yoco.py``'s
``replay_for`` / ``kept_rows``, ``graphs/window.py``'s ring and mask, ``graphs/compressor.py``'s
group bookkeeping and visibility) run chunk after chunk on a position-valued state (every
ring row holds the position it was written for; rows of "another request" hold -7), and each
result is compared with plain integer arithmetic:

- pivot: the replay start ``max(0, P - KEEP)`` and each chunk's kept rows;
- keys: the positions each kept row attends at the first decoder layer ``[t - W + 1, t]`` and
  at the later ones ``[max(pivot, t - W + 1), t]``, and that every key read holds its position;
- slots: what the rings hold after each chunk (first decoder layer: the newest position of
  each slot; later layers: the newest at or after the pivot, the rest untouched);
- entries: the compressed entries the first decoder layer writes per chunk (every row's) and
  the range each kept row may select from, ``[0, (t + 1) // ratio)``.

``--shift-pivot N`` moves the engine's pivot by N rows (a deliberate bug) to show L1 catches it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from deepinfer_fx.graphs.batch import make_batch
from deepinfer_fx.graphs.compressor import pool_windows, visible_entries
from deepinfer_fx.graphs.window import window_bias, window_keys
from deepinfer_fx.graphs.yoco import Replay, kept_rows, replay_for

STALE = -7.0  # a ring row written for another request


def _chunks(P: int, size: str) -> list[int]:
    n = P if size == "whole" else int(size)
    return [min(n, P - s) for s in range(0, P, n)]


def _keys_ok(
    keys: torch.Tensor, k_pos: torch.Tensor, bias: torch.Tensor, rows: list[int], low: int, W: int
) -> str | None:
    """Query row j (at position ``rows[j]``) must see exactly the keys at ``[max(low, t - W + 1), t]``,
    each holding its own position; the first row that does not, described."""
    t = torch.tensor(rows, dtype=torch.long)[:, None]
    want = (k_pos[None] >= torch.clamp(t - W + 1, min=low)) & (k_pos[None] <= t)
    seen = bias[: len(rows)] == 0
    wrong = (seen != want).any(-1) | (seen & (keys[None, :, 0] != k_pos[None].float())).any(-1)
    if not wrong.any():
        return None
    j = int(torch.nonzero(wrong)[0])
    got = k_pos[seen[j]].tolist()
    return f"row {rows[j]} sees {got[:1]}..{got[-1:]} ({len(got)} keys), want {max(low, rows[j] - W + 1)}..{rows[j]}"


def check(P: int, size: str, keep: int, W: int, ratio: int, shift: int = 0) -> list[str]:
    """Every mismatch between the engine and the independent computation for one case."""
    bad: list[str] = []
    first_ring = torch.full((2, W, 1), STALE)  # the first decoder layer's ring, slot 0 + scratch
    later_ring = torch.full((2, W, 1), STALE)  # any later decoder layer's
    rows_kv = torch.zeros(2, ratio, 1)
    pivot = max(0, P - keep)
    start = 0
    for n in _chunks(P, size):
        end = start + n
        batch = make_batch([torch.zeros(n, dtype=torch.long)], [0], [start])
        replay = replay_for(batch, [P], keep)
        replay = Replay(tuple(k + shift for k in replay.keep_from), replay.rows)
        kept = kept_rows(batch, replay)
        g, kg, qs = batch.groups[0], kept.batch.groups[0], kept.queries.split.queries[0]
        # pivot and kept rows
        want_kept = list(range(max(start, pivot), end))
        got_kept = kept.batch.positions[: int(kg.lens[0])].tolist()
        if int(kg.floor[0]) != pivot or got_kept != want_kept:
            bad.append(
                f"chunk {start}+{n}: pivot {int(kg.floor[0])} rows {got_kept[:1]}..{got_kept[-1:]}, want {pivot} {want_kept[:1]}..{want_kept[-1:]}"
            )
        # keys at the first decoder layer: every row's kv on the key side, kept rows query
        kv = g.positions.float()[..., None]
        keys, k_pos = window_keys(first_ring, kv, g)
        bias = window_bias(qs.positions, k_pos, W)
        if want_kept and (why := _keys_ok(keys[0], k_pos[0], bias[0], want_kept, 0, W)):
            bad.append(f"first decoder layer: {why}")
        # keys at a later decoder layer: the kept rows alone, their ring floored at the pivot
        keys, k_pos = window_keys(later_ring, kg.positions.float()[..., None], kg)
        bias = window_bias(kg.positions, k_pos, W)
        if want_kept and (why := _keys_ok(keys[0], k_pos[0], bias[0], want_kept, pivot, W)):
            bad.append(f"later decoder layer: {why}")
        # ring slots after the chunk
        for name, ring, low in (("first", first_ring, 0), ("later", later_ring, pivot)):
            newest = [end - 1 - (end - 1 - i) % W for i in range(W)]  # the newest position p < end with p % W == i
            want = [float(p) if p >= low else STALE for p in newest]
            if ring[0, :, 0].tolist() != want:
                bad.append(
                    f"chunk {start}+{n}: {name} decoder ring holds {ring[0, :, 0].tolist()[:4]}.., want {want[:4]}.."
                )
        # compressed entries written (every row) and visible to each kept row
        w, complete, _ = pool_windows(
            torch.zeros(1, n, 1),
            None,
            rows_kv,
            rows_kv.clone(),
            g.slots,
            g.starts,
            g.lens,
            torch.ones(1),
            ratio,
            False,
            1e-6,
        )
        want_w = [e for e in range(P // ratio + 1) if start <= e * ratio + ratio - 1 < end]
        if w[complete].tolist() != want_w:
            bad.append(f"chunk {start}+{n}: entries written {w[complete].tolist()[:3]}.., want {want_w[:3]}..")
        vis = visible_entries(qs.positions[0, : len(want_kept)], P // ratio + 1, ratio)
        t = torch.tensor(want_kept, dtype=torch.long)[:, None]
        wrong = (vis != (torch.arange(vis.shape[-1]) < (t + 1) // ratio)).any(-1)
        if wrong.any():
            bad.append(f"row {want_kept[int(torch.nonzero(wrong)[0])]}: selects from the wrong entry range")
        start = end
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="1,2,127,128,129,140,141,333,700")
    ap.add_argument("--chunks", default="whole,33,100,128,139", help="chunk sizes ('whole': one chunk)")
    ap.add_argument("--keep", default="128,134,140,256")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--ratio", type=int, default=1, help="the first decoder layer's compress ratio")
    ap.add_argument("--shift-pivot", type=int, default=0)
    args = ap.parse_args(argv)
    failed = 0
    print(f"{'P':>6} {'chunks':>7} {'KEEP':>5} {'pivot':>6}  result")
    for P in (int(x) for x in args.lens.split(",")):
        for size in args.chunks.split(","):
            for keep in (int(x) for x in args.keep.split(",")):
                bad = check(P, size, keep, args.window, args.ratio, args.shift_pivot)
                failed += bool(bad)
                print(
                    f"{P:>6} {size:>7} {keep:>5} {max(0, P - keep):>6}  "
                    + ("ok" if not bad else f"MISMATCH ({len(bad)}): {bad[0]}")
                )
    print(f"{failed} mismatching case(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
