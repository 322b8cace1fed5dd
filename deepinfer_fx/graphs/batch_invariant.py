"""Batch-invariant forms of the model's places: each output element is reduced in one order that
depends on nothing but that element's own operands, so a token's bits do not depend on how many
rows, chunks or keys share its step, nor on whether it is prefilled or decoded.

The rules on the CPU (``docs/decisions.md``, batch invariance, has the measurements):

- a sum over a fixed-length last dim (``Tensor.sum(-1)``) is reduced alike for every row count,
  where MKL's GEMM changes its reduction with M (M = 1, 2..15 and >= 16 each differ); so a matmul
  is an fp32 elementwise product summed over K (``fixed_order_matmul``);
- a sum over a length that differs with the layout (the keys of a query: a prefill chunk's ring
  then its own rows, or a decode ring) is a ``cumsum`` (a sequential scan, trailing zeros add
  nothing) over the keys sorted into one canonical order: window keys by position, then the
  compressed entries in ascending order;
- top-k ties go to the lower index (a stable sort); a token's experts are listed, and so
  combined, in ascending expert id (in one process and by expert parallelism's combine alike);
- pointwise functions and softmaxes are built from ops whose vector, scalar and compiled forms
  agree (``graphs/pointwise.py`` says why).

The passes module ``passes/batch_invariant.py`` installs these at their places, with every
other place held to its reference (no kernel swap stands in).
"""

from __future__ import annotations

import torch

from .attention import attend, ring_keys
from . import indexer
from .indexer import read_keys
from .moe import _score, swiglu_act
from .reduce import sum_over

# Elements of an fp32 product materialised at once (4 MiB: it stays in cache, where 256 MiB blocks
# ran 3-8x slower, docs/decisions.md); blocks split rows, and a matmul's weight rows beyond that.
PRODUCT_BLOCK = 1 << 20


def _rows_per_block(per_row: int) -> int:
    return max(1, PRODUCT_BLOCK // max(1, per_row))


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` (callers start their block loops at 0 even for no rows, so parts is never empty)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def fixed_order_matmul(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """x ``[M, K]`` @ w ``[N, K]``.T, each output the fp32 sum over K of exact fp32 products (a
    bf16 product is exact in fp32) in one order for every M, in blocks of rows and columns."""
    wf = w.float()
    n, k = w.shape
    cols = min(n, _rows_per_block(k))
    rows = _rows_per_block(cols * k)
    y = _cat(
        [
            _cat(
                [(x[s : s + rows].float()[:, None, :] * wf[j : j + cols][None]).sum(-1) for j in range(0, n, cols)], -1
            )
            for s in range(0, max(1, x.shape[0]), rows)
        ],
        0,
    )
    return y if out_fp32 else y.to(x.dtype)


def fixed_order_matmul_group(x: torch.Tensor, ws: list[torch.Tensor], out_fp32: bool) -> list[torch.Tensor]:
    """``[fixed_order_matmul(x, w, out_fp32) for w in ws]``: projections of one input, which a
    kernel may run in one launch where that keeps each one's bits (``passes/grouping.py``)."""
    return [fixed_order_matmul(x, w, out_fp32) for w in ws]


def fixed_order_matmul_blocks(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    """x ``[M, G*K]`` times the block-diagonal weight of w's ``G`` row blocks (w ``[G*R, K]``) ->
    ``[M, G*R]`` in x's dtype: ``fixed_order_matmul`` block by block (``norm.project_blocks``)."""
    return torch.cat([fixed_order_matmul(a, b, False) for a, b in zip(x.chunk(blocks, -1), w.chunk(blocks, 0))], -1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus`` (beta 1, threshold 20) from exp and log1p."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``softmax`` as the ops its compiled decomposition runs (max, exp, sum, divide)."""
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / sum_over(e, dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``log_softmax`` as the ops its compiled decomposition runs."""
    s = x - x.amax(dim, keepdim=True)
    return s - torch.log(sum_over(torch.exp(s), dim, keepdim=True))


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest of each row, ties to the lower index."""
    return scores.argsort(dim=-1, descending=True, stable=True)[..., :k]


def top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``reduce.top_values`` with ties to the lower index (a stable sort: exact on every device)."""
    idx = _top_k(x, k)
    return x.gather(-1, idx), idx


def route_weights(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor | None,
    k: int,
    kind: str,
    temp: float,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.route_weights`` with ties to the lower expert id and each token's experts listed
    in ascending id, the order every later sum over them takes (the place's own math otherwise;
    its scores go through the pointwise places)."""
    scores = _score(logits / temp, kind)
    idx = (ids if ids is not None else _top_k(scores + bias.float(), k)).sort(-1).values
    w = scores.gather(1, idx)
    if norm:
        w = w / (sum_over(w, -1, keepdim=True) + 1e-20)
    return idx, w * scale


def _expert_matmul(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Row p of ``x`` ``[P, in]`` times ``w[expert[p]].T`` (``w`` ``[E, out, in]``), fixed order, in x's dtype."""
    step = _rows_per_block(w.shape[1] * w.shape[2])
    parts = [
        (x[s : s + step].float()[:, None, :] * w[expert[s : s + step]].float()).sum(-1)
        for s in range(0, max(1, x.shape[0]), step)
    ]
    return _cat(parts, 0).to(x.dtype)


def fixed_order_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``moe.routed_experts`` over bf16/fp32 expert weights: each (token, expert) pair's GEMVs in a
    fixed order, and each token's results summed in k order (ascending expert id, as the form's
    routing lists them), one add at a time; -> fp32 ``[T, D]``. The CPU kernel of
    ``deepinfer::bi_moe_experts``."""
    t, k = idx.shape
    order = idx.argsort(dim=-1, stable=True)
    expert = idx.gather(1, order).reshape(-1)
    xs = x.repeat_interleave(k, 0)
    h = swiglu_act(_expert_matmul(xs, w1, expert), _expert_matmul(xs, w3, expert), limit)
    h = h * w.gather(1, order).reshape(-1, 1)
    y = _expert_matmul(h.to(x.dtype), w2, expert).float().view(t, k, -1)
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out


def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    dot_scale: float,
    slots: torch.Tensor | None = None,
    key_rows: str | None = None,
) -> torch.Tensor:
    """``indexer.index_scores`` with each dot product a fixed-order sum over the head dim (packed
    keys read as the reference reads them: only the rows scored, unpacked)."""
    keys = read_keys(q, keys, slots, key_rows)
    dots = torch.relu((q.float()[..., :, :, None, :] * keys.float()[..., None, None, :, :]).sum(-1)) * dot_scale
    return (dots * head_w.float()[..., None]).sum(-2).masked_fill(~visible, float("-inf"))


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``indexer.top_k_mask`` with ties to the lower index."""
    idx = _top_k(scores, k)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, scores.gather(-1, idx) > float("-inf"))


def score_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    slots: torch.Tensor | None = None,
    key_rows: str | None = None,
) -> torch.Tensor:
    """``indexer.score_topk`` with ties to the lower entry (entries keep their index in every layout),
    scored by the ``indexer.index_scores`` place (whose form the table installs)."""
    n = visible.shape[-1]
    if n == 0 or k <= 0:
        return torch.zeros_like(visible)
    top = _top_k(indexer.index_scores(q, keys, head_w, visible, 1.0, slots, key_rows), min(k, n))
    return torch.zeros_like(visible).scatter_(-1, top, True) & visible


def canonical_order(k_pos: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's visible keys in one canonical order: window keys by position, then the
    compressed entries as given (ascending), whatever the layout (a prefill chunk's ring then its
    own rows, a decode ring). -> ``order`` ``[C, T, N]`` (key indices, the visible ones first) and
    ``count`` ``[C, T]`` (how many are visible). One sort a chunk (its window keys by position),
    then each query's visible keys moved first by integer prefix sums, not a sort per query: on an
    H100 the per-query radix sort was ~5.8 of a P8 4096-token prefill's 24.4 ms. Exact everywhere."""
    c, t, n = bias.shape
    nw = k_pos.shape[-1]
    entries = torch.arange(nw, n, device=bias.device).expand(c, n - nw)
    keys = torch.cat([k_pos.argsort(dim=-1, stable=True), entries], -1)[:, None, :].expand(c, t, n)
    seen = (bias == 0).gather(-1, keys)  # in the canonical order of the keys
    count = seen.sum(-1)
    # a stable partition: the i-th visible key goes to i, the i-th hidden one to count + i; key j
    # has ``j + 1 - visible`` hidden ones up to it (one int32 scan: the sort's cost at decode)
    visible = seen.to(torch.int32).cumsum(-1, dtype=torch.int32)
    at = torch.arange(n, device=bias.device, dtype=torch.int32)
    dest = torch.where(seen, visible - 1, count[..., None] + (at - visible)).long()
    return torch.empty_like(dest).scatter_(-1, dest, keys), count


def attend_sorted(
    q: torch.Tensor, keys: torch.Tensor, order: torch.Tensor, count: torch.Tensor, sink: torch.Tensor
) -> torch.Tensor:
    """``mqa_with_sink`` of q ``[C, T, H, d]`` over the keys ``[C, N, d]`` (K = V) that each query
    sees, ``keys[c, order[c, t, :count[c, t]]]`` in that order: the softmax's denominator and the
    value sum a sequential ``cumsum`` over them (the hidden keys, sorted last, add exact zeros),
    the sink's term added last; -> ``[C, T, H, d]`` in q's dtype, before the inverse rotation.
    The CPU kernel of ``deepinfer::bi_attend``; queries in blocks within the budget."""
    c, t, h, d = q.shape
    n = keys.shape[-2]
    at = torch.arange(n, device=q.device)
    step = _rows_per_block(c * h * n * d)
    outs = []
    for s in range(0, max(1, t), step):  # one (empty) block where a rank has no queries
        o = order[:, s : s + step]
        seen = at < count[:, s : s + step, None]
        kc = keys.float().gather(1, o.flatten(1)[..., None].expand(-1, -1, d)).view(c, -1, n, d)
        logits = (q[:, s : s + step].float()[:, :, :, None, :] * kc[:, :, None]).sum(-1) * d**-0.5
        logits = logits.masked_fill(~seen[:, :, None], float("-inf"))
        sk = sink.float().expand(*logits.shape[:-1])
        m = torch.maximum(logits.amax(-1), sk)
        e = torch.exp(logits - m[..., None])
        denom = e.cumsum(-1)[..., -1] + torch.exp(sk - m)
        probs = e / denom[..., None]
        outs.append((probs[..., None, :] * kc.transpose(-1, -2)[:, :, None]).cumsum(-1)[..., -1])
    return _cat(outs, 1).to(q.dtype)


def mqa_ring(
    q: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    entries: torch.Tensor | None,
    entry_rows: torch.Tensor | None,
    entry_bias: torch.Tensor | None,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """``attention.mqa_ring``'s gathered keys, attended by the ``attention.attend`` place (whose
    form the batch-invariant table installs)."""
    keys, k_pos, bias = ring_keys(ring, slots, pos, entries, entry_rows, entry_bias, window)
    return attend(q, keys, k_pos, bias, sink, cos, sin)
