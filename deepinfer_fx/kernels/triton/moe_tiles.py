"""Tile choice for the routed-expert Triton GEMMs (``moe.py``): the launch shapes by the rows an
active expert takes, narrower tiles for decode grids of few programs so that a launch stays one
wave (``tile_smem``), and MXFP4's tiles (``fp4_tiles``) that keep a row's bits at every size."""

from __future__ import annotations

from typing import NamedTuple

import triton

# Decode grids below this many programs (about two per SM of an H200) get narrower tiles.
_MIN_PROGRAMS = 256
# H200 residency for the narrow tiles' one-wave rule: SMs, the shared memory of one SM, and the
# 1 KiB of it the hardware reserves for each resident program.
_SMS = 132
_SMEM_PER_SM = 228 * 1024
_SMEM_RESERVED = 1024


class Tiles(NamedTuple):
    """Launch configuration of one GEMM kernel."""

    bm: int
    bn: int
    bk: int
    group_m: int
    warps: int
    stages: int
    half: bool = False  # an expert's last block with <= bm / 2 rows runs as a bm / 2 tile
    fp4_bits: bool = False  # MXFP4 weights decoded in packed PTX, not by Triton's microscaled dot


def max_blocks(pairs: int, experts: int, bm: int) -> int:
    """The most row blocks of ``bm`` rows that ``pairs`` rows over ``experts`` experts can
    need: each active expert wastes under one block, and each block holds at least one row."""
    return min(pairs, (pairs + min(experts, pairs) * (bm - 1)) // bm)


def tile_smem(t: Tiles, gated: bool, act_bytes: int = 2, w_bytes: int = 2) -> int:
    """Shared memory of one GEMM program: Triton's software pipeline keeps ``stages - 1`` buffers
    of the row tile and of the weight tile(s) (the sm_90 compile test checks this against the
    compiler's own figure)."""
    per_stage = t.bm * t.bk * act_bytes + (2 if gated else 1) * t.bk * t.bn * w_bytes
    return (t.stages - 1) * per_stage


def _one_wave(t: Tiles, programs: int, gated: bool, act_bytes: int, w_bytes: int) -> Tiles:
    """``t`` with one stage fewer when that lets all ``programs`` be resident at once and ``t``
    does not. At T = 1 with the shared expert folded in, the narrow tiles' 7 row blocks (6
    routed, 1 shared) made 448 gate/up and 896 down programs, past the 396 and 792 an H200 holds
    at 4 stages (3 and 6 a SM, by shared memory), and both kernels ran a second, nearly empty
    wave: 39 % and 46 % slower for 17 % more bytes (``bench/results/shared_fused_ab_s10.json``).
    At 3 stages 5 and 9 programs fit a SM, one wave: 102.8 -> 92.6 us (gate/up) and 102.3 ->
    92.6 us (down), as fast as any tile of the sweep (``bench/moe_kernel.py --sweep 1 --shared``,
    ``bench/results/moe_tile_sweep_t1_shared_s11.json``)."""

    def fits(c: Tiles) -> bool:
        return programs <= _SMS * (_SMEM_PER_SM // (tile_smem(c, gated, act_bytes, w_bytes) + _SMEM_RESERVED))

    shallower = t._replace(stages=t.stages - 1)
    return shallower if not fits(t) and fits(shallower) else t


def choose_tiles(
    pairs: int, experts: int, n: int, k: int, gated: bool, qblock: int, act_bytes: int = 2, w_bytes: int = 2
) -> Tiles:
    """Tiles for the expert GEMM ``[rows, k] x [k, n]`` over ``pairs`` rows (``gated``: the
    two-weight gate/up one); ``qblock`` > 0 caps the k tile at the fp8 scale block. The element
    sizes of the rows and the weights only size the narrow tiles' pipeline (``_one_wave``); the
    k tile never depends on them or on the row count, so every row sums its products in one
    order whatever the batch."""
    rows_per_expert = pairs / min(experts, pairs)
    narrow = False
    # Measured on an H200 at P8 widths (D 4096, I 2048): the decode tiles stream weights at
    # 4.2-4.4 TB/s from T = 8 to 256; the prefill ones reach ~460 TFLOP/s at T = 4096.
    if rows_per_expert <= 16:
        t = Tiles(16, 128, 128, 1, 4, 3)
        if max_blocks(pairs, experts, 16) * triton.cdiv(n, 128) < _MIN_PROGRAMS:
            t = Tiles(16, 32, 128, 1, 4, 4)  # few rows (T = 1): narrow tiles keep every SM streaming
            narrow = True
    elif rows_per_expert <= 64:
        t = Tiles(32, 128, 128, 4, 4, 3)
    else:
        t = Tiles(128, 128, 64, 16, 8, 3, True) if gated else Tiles(128, 256, 64, 8, 8, 4, True)
    bn = min(t.bn, max(16, triton.next_power_of_2(n)))
    bk = min(t.bk, max(16, triton.next_power_of_2(k)))
    if qblock:
        bk = min(bk, qblock & -qblock)  # the largest power of two dividing the block
        if bk < 16:
            raise ValueError(f"fp8 scale block {qblock} must be a multiple of 16")
    t = t._replace(bn=bn, bk=bk)
    if narrow:
        t = _one_wave(t, max_blocks(pairs, experts, t.bm) * triton.cdiv(n, t.bn), gated, act_bytes, w_bytes)
    return t


def fp4_tiles(gate_up: Tiles, down: Tiles, inter: int, dim: int) -> tuple[Tiles, Tiles]:
    """The tiles for MXFP4 weights from the bf16 ones. The k tile is 64 at every row count and the
    column tile at least 64: Triton's microscaled dot rounds differently at 32 columns on sm_90 (27
    of 40 tokens alone differed from their batch, ``docs/decisions.md``), so with these a row's bits
    do not follow the batch. Decode (below 128-row blocks) takes 64 columns and 4 warps for both
    kernels, 4 stages for gate/up and 3 for down (``bench.moe_kernel --fp4 --sweep 8|64``,
    ``bench/results/latest/moe_tile_sweep_p8_fp4_t{8,64}_h100_s46.json``); prefill 128 x 64 on 4
    warps for gate/up and 256 x 128 on 8 for down, within 1.2 % of the fastest tile that keeps the
    bits (``bench.moe_kernel --fp4 --sweep 4096``,
    ``bench/results/latest/moe_tile_sweep_p8_fp4_t4096_h100_s47.json``). ``inter`` and ``dim``: the
    gate/up and down GEMMs' column counts (no tile wider than the next power of two of them)."""

    def cols(n: int, bn: int) -> int:
        return min(bn, max(16, triton.next_power_of_2(n)))

    if gate_up.bm >= 128:
        gate_up = gate_up._replace(bn=cols(inter, 64), warps=4, stages=4)
        down = down._replace(bm=256, bn=cols(dim, 128), warps=8, stages=3)
    else:
        gate_up = gate_up._replace(bn=cols(inter, 64), warps=4, stages=4)
        down = down._replace(bn=cols(dim, 64), warps=4, stages=3)
    return gate_up._replace(bk=min(gate_up.bk, 64)), down._replace(bk=min(down.bk, 64))


def expert_tiles(
    pairs: int, experts: int, inter: int, dim: int, qblock: int, fp4: bool, act_bytes: int, w_bytes: int
) -> tuple[Tiles, Tiles]:
    """The (gate/up, down) tiles ``run_experts`` takes for ``pairs`` rows over ``experts`` experts
    of widths ``inter`` and ``dim`` (``qblock``: fp8's scale block, else 0; ``fp4``: MXFP4)."""
    g = choose_tiles(pairs, experts, inter, dim, True, qblock, act_bytes, w_bytes)
    d = choose_tiles(pairs, experts, dim, inter, False, qblock, act_bytes, w_bytes)
    return fp4_tiles(g, d, inter, dim) if fp4 else (g, d)
