"""``deepinfer::sparse_mqa`` on CUDA: the shape rule and the launcher of the MQA-with-sink kernels
(``mqa_kernels.py``, whose docstring gives the algorithm).

The tiling depends on H, d, the dtypes and the queries per chunk, and the split length on N
alone, never on the number of chunks: a query's output is bitwise the same alone and in any
batch. ``launch_mqa`` serves both key sources (``KeySource``): plain keys ``[C, N, d]`` with a
bias over all N (``sparse_mqa_triton``, here) and keys read in place from the window ring and
entry pools (``ring_attention.py``). The rule is static on shapes, never a host sync, so every
launch replays in CUDA graphs.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NamedTuple, Optional

import torch
import triton

from .. import ops  # noqa: F401  (declares deepinfer::sparse_mqa before the registration below)
from .buffers import out_buffer
from .mqa_kernels import live_tiles_kernel, mqa_combine, mqa_sequential, mqa_split
from .pdl import pdl_args

_LOG2E = math.log2(math.e)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# Tiling depends on H, d, dtypes and the queries per chunk T (decode or prefill), never on the
# number of chunks or on other chunks, so that a query's arithmetic is the same in any batch; the
# split length depends on N alone for the same reason. Decode tiling chosen on an H200 (bf16,
# H 64, d 512); prefill takes all heads of a query per program so each live tile is read once.
_BH = 16
_COMBINE_BH = 4  # a combine program reads S partial rows per head; 16 heads made it 4 long programs at b1
_PREFILL_BH = 64
_DECODE_QUERIES = 8  # chunks of up to this many queries (a verify chunk: a token and its drafts) tile as decode
_PREFILL_WARPS = 8
_BLOCK_N = 64
# from this many keys a query a skipping prefill lists its visible keys, not the tiles holding one:
# scattered top-k entries leave nearly every tile live (the crossover: docs/decisions.md)
_KEYS_MIN_N = 3072
_MIN_SPLIT = 128
_MAX_SPLITS = 32
_NUM_WARPS = 4
_NUM_STAGES = 2
_PARALLEL_WAVES = 0.5
_LIVE_ELEMENTS = 2048  # bias values the live-tile scan holds per step: 32 tiles of 64, 16 a thread


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H200 so CPU tests take the same paths
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_split(n: int, block_n: int = _BLOCK_N) -> int:
    """Keys per split: at least ``_MIN_SPLIT``, at most ``_MAX_SPLITS`` splits, whole tiles."""
    per_split = triton.cdiv(max(n, 1), _MAX_SPLITS)
    return max(_MIN_SPLIT, triton.cdiv(per_split, block_n) * block_n)


class KeySource(NamedTuple):
    """Where the kernels find the keys: plain (``k`` ``[C, N, d]``, the bias covering all N) or
    RING (``k`` the window ring pool ``[S, W, d]`` read at ``slots``, then the entry pool ``e``
    ``[S, E, d]`` at the same slots, through the row lists ``r`` ``[C, K]`` with ``rows``; the
    bias covers the entries only). Unused pointers repeat ``k``."""

    k: torch.Tensor
    e: torch.Tensor
    r: torch.Tensor
    slots: torch.Tensor
    pos: torch.Tensor
    strides: tuple[int, int, int, int, int, int]  # k: chunk/slot, row; e: slot, row; r: chunk, row
    w: int = 0
    window: int = 0
    ring: bool = False
    rows: bool = False

    def after_k(self) -> tuple[torch.Tensor, ...]:
        """The kernels' pointer arguments after the bias: e, r, slots, pos."""
        return self.e, self.r, self.slots, self.pos


def _plain(keys: torch.Tensor) -> KeySource:
    return KeySource(keys, keys, keys, keys, keys, (keys.stride(0), keys.stride(1), 0, 0, 0, 0))


def sparse_mqa_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    **tiling: Any,
) -> torch.Tensor:
    """``graphs/attention.py::mqa_with_sink`` for q ``[..., T, H, d]``, keys ``[..., N, d]``,
    bias ``[..., T, N]``, sink ``[H]`` and the queries' rope tables cos / sin ``[..., T, rd/2]``,
    written into ``out`` (q's shape and dtype) if given. ``tiling``: see ``launch_mqa``."""
    *lead, t, h, d = q.shape
    n = keys.shape[-2]
    half = cos.shape[-1]
    if (
        list(keys.shape) != [*lead, n, d]
        or list(bias.shape) != [*lead, t, n]
        or list(sink.shape) != [h]
        or list(cos.shape) != [*lead, t, half]
        or sin.shape != cos.shape
        or not 0 < 2 * half <= d
    ):
        shapes = (
            f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, bias {tuple(bias.shape)}, sink {tuple(sink.shape)}, "
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
        raise ValueError(f"sparse_mqa: mismatched shapes {shapes}")
    out = out_buffer(out, q.shape, q.dtype, q.device, "sparse_mqa")
    rows = q.numel() // (h * d)
    if rows:
        src = _plain(_last_dim_contiguous(keys.reshape(-1, n, d)))
        launch_mqa(
            q.reshape(rows, h, d),
            t,
            n,
            src,
            bias.reshape(rows, n),
            sink,
            cos.reshape(rows, half),
            sin.reshape(rows, half),
            out.view(rows, h, d),
            **tiling,
        )
    return out


def launch_mqa(
    q2: torch.Tensor,
    t: int,
    n: int,
    src: KeySource,
    b2: torch.Tensor,
    sink: torch.Tensor,
    cos2: torch.Tensor,
    sin2: torch.Tensor,
    o2: torch.Tensor,
    *,
    block_n: Optional[int] = None,
    split: Optional[int] = None,
    parallel: Optional[bool] = None,
    skip: Optional[bool] = None,
    live: Optional[str] = None,
    heads: Optional[int] = None,
    num_warps: Optional[int] = None,
    combine_heads: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> None:
    """Queries ``q2`` ``[R, H, d]`` (``t`` per chunk) over ``n`` keys a query, into ``o2``.
    ``block_n``, ``split`` (keys per split), ``parallel`` (split programs + combine), ``skip``
    (pass over all -inf tiles; plain keys only), ``live`` (what a skipping program lists: "tiles"
    holding a visible key, or the visible "keys" themselves, read ``block_n`` of them a tile:
    the chosen entries of a prefill query lie scattered, so nearly every tile holds one),
    ``heads`` (per program; ``live`` too: keys from ``_KEYS_MIN_N`` keys a query), ``num_warps`` and
    ``combine_heads`` (heads per combine program; per-head arithmetic, so it never moves a bit)
    default to the shape rule, ``num_stages`` (software pipelining depth) to 2; tests and the
    kernel bench set them to reach every path or compare tilings."""
    rows, h, d = q2.shape
    half = cos2.shape[-1]
    q2 = _last_dim_contiguous(q2)
    cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    key_size = src.k.element_size()
    if block_n is None:  # double-buffered fp32 tiles of 64 x 512 would overflow shared memory
        block_n = _BLOCK_N if max(q2.element_size(), key_size) <= 2 else _BLOCK_N // 2
    prefill = t > _DECODE_QUERIES  # the wide tiling gives a query one program: a few queries idle the GPU
    skip = prefill and not src.ring if skip is None else skip
    if skip:  # one split over the live tiles only; the partials of a parallel run would need the tile lists per split
        split, parallel = n, False
    split = default_split(n, block_n) if split is None else split
    n_splits = max(1, triton.cdiv(n, split))
    wide = prefill and max(q2.element_size(), key_size) <= 2  # fp32 tiles of 64 heads would spill
    if heads is None:
        heads = min(_PREFILL_BH, max(_BH, triton.next_power_of_2(h))) if wide else _BH
    if num_warps is None:
        num_warps = _PREFILL_WARPS if wide else _NUM_WARPS
    head_blocks = triton.cdiv(h, heads)
    if parallel is None:
        parallel = n_splits > 1 and rows * head_blocks <= _PARALLEL_WAVES * _sm_count(q2.device)
    block_d = triton.next_power_of_2(d)
    meta = dict(BH=heads, HB=head_blocks, BLOCK_D=block_d, D=d, num_warps=num_warps, **pdl_args(q2.device))
    rope = dict(HALF=half, BLOCK_HALF=triton.next_power_of_2(half))  # for the kernels that store the output
    keys = dict(RING=src.ring, ROWS=src.rows, WHOLE=src.w % block_n == 0)
    dot_fp32 = _INTERPRET or q2.dtype != src.k.dtype or q2.dtype == torch.float32
    qk_scale = d**-0.5 * _LOG2E
    kb, kn, es, en, rr, rn = src.strides
    strides = (q2.stride(0), q2.stride(1), kb, kn, b2.stride(0), b2.stride(1), es, en, rr, rn)
    if live is None:
        live = "keys" if skip and n >= _KEYS_MIN_N else "tiles"
    if live not in ("tiles", "keys") or (live == "keys" and not skip):
        raise ValueError(
            f"sparse_mqa: live={live!r} needs 'tiles' or 'keys', and 'keys' a skipping launch (plain keys)"
        )
    num_stages = _NUM_STAGES if num_stages is None else num_stages
    if not parallel:
        # unread without SKIP; a key list is the tile list of one-key tiles
        tiles, count, n_tiles = _live_tiles(b2, 1 if live == "keys" else block_n) if skip else (b2, b2, 0)
        mqa_sequential[(rows * head_blocks,)](
            q2,
            src.k,
            b2,
            *src.after_k(),
            sink,
            cos2,
            sin2,
            o2,
            tiles,
            count,
            t,
            h,
            n,
            src.w,
            src.window,
            split,
            n_tiles,
            qk_scale,
            *strides,
            o2.stride(0),
            o2.stride(1),
            BLOCK_N=block_n,
            DOT_FP32=dot_fp32,
            SKIP=skip,
            KEYS=skip and live == "keys",
            num_stages=num_stages,
            **meta,
            **rope,
            **keys,
        )
        return
    m = torch.empty((rows, n_splits, h), dtype=torch.float32, device=q2.device)
    l = torch.empty_like(m)
    acc = torch.empty((rows, n_splits, h, block_d), dtype=torch.float32, device=q2.device)
    mqa_split[(rows * n_splits * head_blocks,)](
        q2,
        src.k,
        b2,
        *src.after_k(),
        m,
        l,
        acc,
        t,
        h,
        n,
        src.w,
        src.window,
        split,
        n_splits,
        qk_scale,
        *strides,
        BLOCK_N=block_n,
        DOT_FP32=dot_fp32,
        num_stages=num_stages,
        **meta,
        **keys,
    )
    combine_heads = _COMBINE_BH if combine_heads is None else combine_heads
    combine_blocks = triton.cdiv(h, combine_heads)
    meta.update(BH=combine_heads, HB=combine_blocks)
    mqa_combine[(rows * combine_blocks,)](
        m, l, acc, sink, cos2, sin2, o2, h, n_splits, o2.stride(0), o2.stride(1), **meta, **rope
    )


def _live_tiles(bias: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per row of ``bias`` ``[R, N]``: the indices of its tiles of ``block_n`` keys that hold a
    visible key, ascending and packed first (``[R, n_tiles]`` int32; the entries after a row's
    count are not read and left unset), and how many (``[R]``). One pass over the bias in one
    launch, rebuilt on every CUDA-graph replay (a 4096-token P8 prefill spent ~100 us a layer
    here as amax + a sort + a sum)."""
    rows, n = bias.shape
    n_tiles = triton.cdiv(n, block_n)
    tiles = torch.empty((rows, n_tiles), dtype=torch.int32, device=bias.device)
    count = torch.empty((rows,), dtype=torch.int32, device=bias.device)
    chunk = max(1, min(triton.next_power_of_2(n_tiles), _LIVE_ELEMENTS // block_n))
    live_tiles_kernel[(rows,)](
        bias,
        tiles,
        count,
        n,
        n_tiles,
        bias.stride(0),
        bias.stride(1),
        BLOCK_N=block_n,
        CHUNK=chunk,
        num_warps=4,
        **pdl_args(bias.device),
    )
    return tiles, count, n_tiles


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _sparse_mqa_cuda(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    return sparse_mqa_triton(q, kv, bias, sink, cos, sin)


torch.library.register_kernel("deepinfer::sparse_mqa", "cuda", _sparse_mqa_cuda)
