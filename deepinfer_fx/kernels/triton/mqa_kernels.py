"""The flash-decoding Triton kernels behind ``deepinfer::sparse_mqa`` and ``deepinfer::ring_mqa``
(device code only; ``attention.py`` chooses the tiling and launches them).


One program holds a block of ``BH`` heads of one query (their fp32 accumulator stays in
registers) and streams the shared K = V rows in tiles of ``BLOCK_N``, with an online softmax
in base 2. Decode (one query per chunk) reads every tile: a data-dependent branch around the
key load stops Triton from pipelining it, which cost more on an H200 (decode 1.5-2x slower)
than skipped tiles saved. Chunks of several queries (prefill) see a few hundred live keys
among thousands (the window plus the selected entries), so there a program takes all heads
of its query and reads only the tiles where its bias row holds a visible key, from a per-row
list built before the launch, in one split. Skipping is exact: a hidden tile would leave the
online-softmax state bit for bit as it was. The list may name visible keys instead of tiles
(``KEYS``): a prefill query's top-k entries lie scattered over the chunk's entries, so nearly every
tile holds one; then tiles of ``BLOCK_N`` listed keys are read (other sums, the same math).

The keys are cut into splits of ``split`` rows, a length that depends on N alone. Each split
runs its own online softmax from an empty state and the split states are merged in split order,
either inside the program (*sequential*) or by separate programs whose partial states a combine
kernel merges (*parallel*, to fill the GPU at small batch and long N). Both modes run the same
arithmetic in the same order, so a query's output is bitwise the same alone, in any batch and in
either mode; the mode is a static rule on shapes, never a host sync, so it replays in CUDA graphs.

The keys are plain (``[C, N, d]`` with a bias over all N) or, for ``ring_mqa``
(``ring_attention.py``), read in place from a window ring pool and an entry pool (``KeySource``);
``attention.launch_mqa`` runs either through the same kernels and the same shape rule.

The program that stores a query's heads also turns their rotary tails back by the query's angle
(the model's inverse rope on the attention output): a separate rotation was one more launch a
layer, ~9 us each at a batch-1 P8 decode step on an H200 (``bench/results/p8_vs_hf_s11.json``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_previous


# Where a tile's keys lie (``_key_rows``): plain rows, the window ring, the entries, or a mix.
_PLAIN = tl.constexpr(0)
_WINDOW = tl.constexpr(1)
_ENTRIES = tl.constexpr(2)
_MIXED = tl.constexpr(3)


@triton.jit
def _window_rows(k_base, pos, stride_kn, offs_n, W, window):
    """Ring rows ``offs_n``: pointers and bias (0 / -inf). Slot i holds the newest position <=
    ``pos`` that is i mod W, visible once written and within ``window`` of the query."""
    # slot n holds pos - ((pos - n) mod W); with r = pos mod W (one scalar division a tile:
    # element-wise int64 remainders, which a GPU emulates, made a split launch 2.4x slower on
    # an H200, bench/results/ring_mqa_int64_rem_ab_s14.json) that distance is r - n, or
    # r - n + W below 0
    back = (pos % W).to(tl.int32) - offs_n
    back = tl.where(back < 0, back + W, back)
    seen = (offs_n < W) & (pos - back >= 0) & (back < window)
    return k_base + offs_n * stride_kn, tl.where(seen, 0.0, float("-inf"))


@triton.jit
def _entry_rows(e_base, r_base, b_base, stride_en, stride_rn, stride_bn, offs_n, in_n, W, ROWS: tl.constexpr):
    """Entry rows ``offs_n - W`` (through the row list at ``r_base`` with ROWS): pointers and bias."""
    in_e = in_n & (offs_n >= W)
    j = tl.maximum(offs_n - W, 0)
    if ROWS:
        e_row = tl.load(r_base + j * stride_rn, mask=in_e, other=0).to(tl.int32)
    else:
        e_row = j
    return e_base + e_row * stride_en, tl.load(b_base + j * stride_bn, mask=in_e, other=float("-inf")).to(tl.float32)


@triton.jit
def _key_rows(
    k_base,
    b_base,
    e_base,
    r_base,
    pos,
    stride_kn,
    stride_bn,
    stride_en,
    stride_rn,
    start,
    n_hi,
    W,
    window,
    BLOCK_N: tl.constexpr,
    SOURCE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The key row pointers of the tile at ``start``, which rows exist, and their bias in base 2:
    row n of ``k_base`` with its bias at ``b_base`` (_PLAIN); or (decode) rows below ``W`` from
    the window ring at ``k_base`` and the rest entries at ``e_base``, their bias at ``b_base``:
    a tile wholly in the ring (_WINDOW), wholly among the entries (_ENTRIES), or either (_MIXED,
    each row picks: per-row 64-bit pointer selects, which spill registers on sm_90)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    in_n = offs_n < n_hi
    if SOURCE == _PLAIN:
        rows = k_base + offs_n * stride_kn
        b = tl.load(b_base + offs_n * stride_bn, mask=in_n, other=float("-inf")).to(tl.float32)
    elif SOURCE == _WINDOW:
        rows, b = _window_rows(k_base, pos, stride_kn, offs_n, W, window)
    elif SOURCE == _ENTRIES:
        rows, b = _entry_rows(e_base, r_base, b_base, stride_en, stride_rn, stride_bn, offs_n, in_n, W, ROWS)
    else:
        rows_w, b_w = _window_rows(k_base, pos, stride_kn, offs_n, W, window)
        rows_e, b_e = _entry_rows(e_base, r_base, b_base, stride_en, stride_rn, stride_bn, offs_n, in_n, W, ROWS)
        in_w = offs_n < W
        rows, b = tl.where(in_w, rows_w, rows_e), tl.where(in_w, b_w, b_e)
    return rows, in_n, b * 1.4426950408889634


@triton.jit
def _tiles(
    q,
    m,
    l,
    acc,
    k_base,
    b_base,
    e_base,
    r_base,
    pos,
    stride_kn,
    stride_bn,
    stride_en,
    stride_rn,
    W,
    window,
    lo,
    hi,
    qk_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOURCE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The key tiles of rows ``[lo, hi)`` into the online-softmax state (m, l, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        rows, in_n, b = _key_rows(
            k_base,
            b_base,
            e_base,
            r_base,
            pos,
            stride_kn,
            stride_bn,
            stride_en,
            stride_rn,
            start,
            hi,
            W,
            window,
            BLOCK_N,
            SOURCE,
            ROWS,
        )
        m, l, acc = _tile(q, rows, offs_d, in_n, b, m, l, acc, qk_scale, D, DOT_FP32)
    return m, l, acc


@triton.jit
def _split_state(
    q,
    k_base,
    b_base,
    e_base,
    r_base,
    pos,
    stride_kn,
    stride_bn,
    stride_en,
    stride_rn,
    W,
    window,
    n_lo,
    n_hi,
    qk_scale,
    BH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    RING: tl.constexpr,
    ROWS: tl.constexpr,
    WHOLE: tl.constexpr,
):
    """Online softmax of ``q`` ``[BH, BLOCK_D]`` over key rows ``[n_lo, n_hi)`` -> (max, sum, acc),
    base 2. RING with WHOLE (``W`` a multiple of ``BLOCK_N``): the ring's tiles, then the
    entries' tiles, in two loops whose pointers each step evenly; the same tiles in the same
    order as one loop, so the same bits."""
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BLOCK_D], tl.float32)
    args = (k_base, b_base, e_base, r_base, pos, stride_kn, stride_bn, stride_en, stride_rn, W, window)
    if RING and WHOLE:
        m, l, acc = _tiles(
            q, m, l, acc, *args, n_lo, tl.minimum(n_hi, W), qk_scale, BLOCK_N, BLOCK_D, D, DOT_FP32, _WINDOW, ROWS
        )
        m, l, acc = _tiles(
            q, m, l, acc, *args, tl.maximum(n_lo, W), n_hi, qk_scale, BLOCK_N, BLOCK_D, D, DOT_FP32, _ENTRIES, ROWS
        )
    else:
        m, l, acc = _tiles(
            q, m, l, acc, *args, n_lo, n_hi, qk_scale, BLOCK_N, BLOCK_D, D, DOT_FP32, _MIXED if RING else _PLAIN, ROWS
        )
    return m, l, acc


@triton.jit
def _live_state(
    q,
    k_base,
    b_base,
    tiles,
    count,
    stride_kn,
    stride_bn,
    N,
    qk_scale,
    BH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KEYS: tl.constexpr,
):
    """Online softmax of ``q`` over the ``count`` tiles listed at ``tiles`` (ascending); with
    ``KEYS`` the list holds visible keys, not tiles, read ``BLOCK_N`` of them a tile."""
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BLOCK_D], tl.float32)
    if KEYS:
        every = tl.full([BLOCK_N], True, tl.int1)
        for i in range(0, count, BLOCK_N):
            listed = i + tl.arange(0, BLOCK_N) < count
            # past the list's end a slot names the tile's first key (its bias -inf): the key load
            # takes no mask, which keeps two pipeline stages within 255 registers on sm_90
            offs_n = tl.load(tiles + i + tl.arange(0, BLOCK_N), mask=listed, other=tl.load(tiles + i))
            b = tl.load(b_base + offs_n * stride_bn, mask=listed, other=float("-inf")).to(tl.float32)
            b = b * 1.4426950408889634
            m, l, acc = _tile(q, k_base + offs_n * stride_kn, offs_d, every, b, m, l, acc, qk_scale, D, DOT_FP32)
    else:
        for i in range(0, count):
            offs_n = tl.load(tiles + i) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_n = offs_n < N
            b = tl.load(b_base + offs_n * stride_bn, mask=in_n, other=float("-inf")).to(tl.float32) * 1.4426950408889634
            m, l, acc = _tile(q, k_base + offs_n * stride_kn, offs_d, in_n, b, m, l, acc, qk_scale, D, DOT_FP32)
    return m, l, acc


@triton.jit
def _tile(q, rows, offs_d, in_n, b, m, l, acc, qk_scale, D: tl.constexpr, DOT_FP32: tl.constexpr):
    """One key tile (row pointers ``rows``) into the online-softmax state (m, l, acc)."""
    k_mask = in_n[:, None] & (offs_d[None, :] < D)
    k = tl.load(rows[:, None] + offs_d[None, :], mask=k_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale + b[None, :]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row with every key so far hidden keeps its max at -inf; shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = tl.dot(p, k, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _merge(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Merge two softmax states; with (-inf, 0, 0) as ``a`` it returns ``b`` exactly."""
    m = tl.maximum(m_a, m_b)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2(m_a - m_shift)
    w_b = tl.exp2(m_b - m_shift)
    return m, l_a * w_a + l_b * w_b, acc_a * w_a[:, None] + acc_b * w_b[:, None]


@triton.jit
def _finish(
    m,
    l,
    acc,
    sink_ptr,
    out_base,
    cos_base,
    sin_base,
    stride_oh,
    offs_h,
    H,
    BH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Normalise with the sink in the denominator and store; a row with no visible key gives 0.
    Then the values' rotary tails are turned back by the query's angle (``_unrotate_tail``)."""
    sink = tl.load(sink_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m, sink)
    w = tl.exp2(m - top)
    scale = w / (l * w + tl.exp2(sink - top))
    offs_d = tl.arange(0, BLOCK_D)
    out = acc * scale[:, None]
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    tl.store(out_base + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(out_base.dtype.element_ty), mask=mask)
    _unrotate_tail(out_base, cos_base, sin_base, stride_oh, offs_h, H, BH, D, HALF, BLOCK_HALF)


@triton.jit
def _unrotate_tail(
    out_base,
    cos_base,
    sin_base,
    stride_oh,
    offs_h,
    H,
    BH: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the last ``2 * HALF`` channels of each stored head by minus the query's angle
    (``apply_rope(o, cos, sin, inverse=True)``, pairs (2i, 2i+1)). The tail is read back from
    what this program just stored, after a barrier that makes every thread's stores visible:
    the same bf16 rounding the reference applies between attention and rotation, without
    regrouping the accumulator's registers into pairs (and an eighth of a row moves twice)."""
    tl.debug_barrier()
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_base + i, mask=i < HALF, other=1.0).to(tl.float32)
    sin = tl.load(sin_base + i, mask=i < HALF, other=0.0).to(tl.float32)
    j = tl.arange(0, 2 * BLOCK_HALF)
    mask = (offs_h[:, None] < H) & (j[None, :] < 2 * HALF)
    ptrs = out_base + offs_h[:, None] * stride_oh + (D - 2 * HALF) + j[None, :]
    tail = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(tail, (BH, BLOCK_HALF, 2)))
    turned = tl.join(a * cos[None, :] + b * sin[None, :], b * cos[None, :] - a * sin[None, :])
    tl.store(ptrs, tl.reshape(turned, (BH, 2 * BLOCK_HALF)).to(out_base.dtype.element_ty), mask=mask)


@triton.jit
def _load_q(
    q_ptr, row, stride_qr, stride_qh, offs_h, H, BLOCK_D: tl.constexpr, D: tl.constexpr, DOT_FP32: tl.constexpr
):
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    q = tl.load(q_ptr + row * stride_qr + offs_h[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    return q.to(tl.float32) if DOT_FP32 else q


@triton.jit
def _bases(k_ptr, e_ptr, r_ptr, slots_ptr, pos_ptr, row, T, stride_kb, stride_es, stride_rr, RING: tl.constexpr):
    """Where query ``row``'s keys start: its chunk's keys (plain), or (RING) its chunk's slot in
    the ring and entry pools, its entry row list and its position."""
    chunk = row // T
    if RING:
        slot = tl.load(slots_ptr + chunk).to(tl.int64)
        bases = (
            k_ptr + slot * stride_kb,
            e_ptr + slot * stride_es,
            r_ptr + chunk * stride_rr,
            tl.load(pos_ptr + row).to(tl.int64),
        )
    else:
        bases = (k_ptr + chunk * stride_kb, e_ptr, r_ptr, row)
    return bases


@triton.jit
def mqa_sequential(
    q_ptr,
    k_ptr,
    b_ptr,
    e_ptr,
    r_ptr,
    slots_ptr,
    pos_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    tiles_ptr,
    count_ptr,
    T,
    H,
    N,
    W,
    window,
    split,
    n_tiles,
    qk_scale,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_br,
    stride_bn,
    stride_es,
    stride_en,
    stride_rr,
    stride_rn,
    stride_or,
    stride_oh,
    BH: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SKIP: tl.constexpr,
    KEYS: tl.constexpr,
    RING: tl.constexpr,
    ROWS: tl.constexpr,
    WHOLE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    # Head blocks of one query are neighbours in launch order, so the keys they share stay in L2.
    pid = tl.program_id(0)
    row = (pid // HB).to(tl.int64)  # flattened (leading index, query t); int64: long offsets
    offs_h = (pid % HB) * BH + tl.arange(0, BH)
    q = _load_q(q_ptr, row, stride_qr, stride_qh, offs_h, H, BLOCK_D, D, DOT_FP32)
    k_base, e_base, r_base, pos = _bases(
        k_ptr, e_ptr, r_ptr, slots_ptr, pos_ptr, row, T, stride_kb, stride_es, stride_rr, RING
    )
    b_base = b_ptr + row * stride_br
    if SKIP:  # one split; only the row's live tiles
        m, l, acc = _live_state(
            q,
            k_base,
            b_base,
            tiles_ptr + row * n_tiles,
            tl.load(count_ptr + row),
            stride_kn,
            stride_bn,
            N,
            qk_scale,
            BH,
            BLOCK_N,
            BLOCK_D,
            D,
            DOT_FP32,
            KEYS,
        )
    else:
        m = tl.full([BH], float("-inf"), tl.float32)
        l = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, BLOCK_D], tl.float32)
        for n_lo in range(0, N, split):
            m_s, l_s, acc_s = _split_state(
                q,
                k_base,
                b_base,
                e_base,
                r_base,
                pos,
                stride_kn,
                stride_bn,
                stride_en,
                stride_rn,
                W,
                window,
                n_lo,
                tl.minimum(n_lo + split, N),
                qk_scale,
                BH,
                BLOCK_N,
                BLOCK_D,
                D,
                DOT_FP32,
                RING,
                ROWS,
                WHOLE,
            )
            m, l, acc = _merge(m, l, acc, m_s, l_s, acc_s)
    _finish(
        m,
        l,
        acc,
        sink_ptr,
        out_ptr + row * stride_or,
        cos_ptr + row * HALF,
        sin_ptr + row * HALF,
        stride_oh,
        offs_h,
        H,
        BH,
        BLOCK_D,
        D,
        HALF,
        BLOCK_HALF,
    )


@triton.jit
def mqa_split(
    q_ptr,
    k_ptr,
    b_ptr,
    e_ptr,
    r_ptr,
    slots_ptr,
    pos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    T,
    H,
    N,
    W,
    window,
    split,
    n_splits,
    qk_scale,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_br,
    stride_bn,
    stride_es,
    stride_en,
    stride_rr,
    stride_rn,
    BH: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    RING: tl.constexpr,
    ROWS: tl.constexpr,
    WHOLE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split's state into the fp32 partials ``m``/``l`` ``[R, S, H]`` and ``acc`` ``[R, S, H, BLOCK_D]``."""
    wait_previous(PDL)
    pid = tl.program_id(0)
    row = (pid // (HB * n_splits)).to(tl.int64)
    s_idx = (pid // HB) % n_splits
    offs_h = (pid % HB) * BH + tl.arange(0, BH)
    q = _load_q(q_ptr, row, stride_qr, stride_qh, offs_h, H, BLOCK_D, D, DOT_FP32)
    n_lo = s_idx * split
    k_base, e_base, r_base, pos = _bases(
        k_ptr, e_ptr, r_ptr, slots_ptr, pos_ptr, row, T, stride_kb, stride_es, stride_rr, RING
    )
    m, l, acc = _split_state(
        q,
        k_base,
        b_ptr + row * stride_br,
        e_base,
        r_base,
        pos,
        stride_kn,
        stride_bn,
        stride_en,
        stride_rn,
        W,
        window,
        n_lo,
        tl.minimum(n_lo + split, N),
        qk_scale,
        BH,
        BLOCK_N,
        BLOCK_D,
        D,
        DOT_FP32,
        RING,
        ROWS,
        WHOLE,
    )
    base = (row * n_splits + s_idx) * H + offs_h
    tl.store(m_ptr + base, m, mask=offs_h < H)
    tl.store(l_ptr + base, l, mask=offs_h < H)
    tl.store(acc_ptr + base[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc, mask=(offs_h < H)[:, None])


@triton.jit
def mqa_combine(
    m_ptr,
    l_ptr,
    acc_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    H,
    n_splits,
    stride_or,
    stride_oh,
    BH: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid = tl.program_id(0)
    row = (pid // HB).to(tl.int64)
    offs_h = (pid % HB) * BH + tl.arange(0, BH)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BLOCK_D], tl.float32)
    for s_idx in range(0, n_splits):
        base = (row * n_splits + s_idx) * H + offs_h
        m_s = tl.load(m_ptr + base, mask=offs_h < H, other=float("-inf"))
        l_s = tl.load(l_ptr + base, mask=offs_h < H, other=0.0)
        acc_s = tl.load(acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], mask=(offs_h < H)[:, None], other=0.0)
        m, l, acc = _merge(m, l, acc, m_s, l_s, acc_s)
    _finish(
        m,
        l,
        acc,
        sink_ptr,
        out_ptr + row * stride_or,
        cos_ptr + row * HALF,
        sin_ptr + row * HALF,
        stride_oh,
        offs_h,
        H,
        BH,
        BLOCK_D,
        D,
        HALF,
        BLOCK_HALF,
    )


@triton.jit
def live_tiles_kernel(
    b_ptr,
    tiles_ptr,
    count_ptr,
    N,
    n_tiles,
    stride_br,
    stride_bn,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of the bias: the ids of its tiles holding a visible key, ascending, and their count."""
    wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = b_ptr + row * stride_br
    out = tiles_ptr + row * n_tiles
    count = 0
    for t0 in range(0, n_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        offs = t[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        b = tl.load(base + offs * stride_bn, mask=offs < N, other=float("-inf")).to(tl.float32)
        live = (tl.max(b, axis=1) > float("-inf")) & (t < n_tiles)
        flags = live.to(tl.int32)
        tl.store(out + count + tl.cumsum(flags, axis=0) - 1, t, mask=live)
        count += tl.sum(flags, axis=0)
    tl.store(count_ptr + row, count)
