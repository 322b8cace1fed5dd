"""The Triton indexer kernels against ``graphs/indexer.py`` (``index_scores``, ``score_topk``).

Every case draws a fresh seed (in the failure message) and poisons the outputs. On CPU the
kernels run under Triton's interpreter in fp32 at small sizes; with CUDA, bf16 cases at the
model's sizes (Hi 64, di 128, k 512) run too. The kernel's scores differ from the reference's
by rounding, so a selection may differ only at a near-tie: the checks demand the reference's
exact set wherever its k-th and (k+1)-th scores are apart by more than a tolerance, and
everywhere what is well defined (the count, visibility, chosen >= unchosen). Keys held as a
trained-format state's MXFP4 rows score bit for bit as their unpacked values do (the sm_90
offline compile of every variant: ``test_triton_indexer_sm90.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_fx.graphs.compressor import visible_entries
from deepinfer_fx.graphs.indexer import index_scores, score_topk, top_k_mask
from deepinfer_fx.io.state_rows import RowCodec
from deepinfer_fx.kernels.triton.indexer import indexer_scores_triton, indexer_topk_triton, topk_mask_triton

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="bf16 at model sizes needs a GPU")
INF = float("inf")


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _case(seed: int, lead: tuple[int, ...], t: int, h: int, d: int, n: int, dtype: torch.dtype, device: str):
    """Random q / keys, positive head weights (a score is 0 only where every head's ReLU is, so
    ties sit at the bottom only) and ~half the entries visible; the first query sees nothing,
    the last (t > 2) ~15% of them, fewer than the small cases' k."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, t, h, d, generator=g)
    keys = torch.randn(*lead, n, d, generator=g)
    head_w = torch.rand(*lead, t, h, generator=g) + 0.1
    visible = torch.rand(*lead, t, n, generator=g) < 0.5
    visible[..., 0, :] = False
    if t > 2:
        visible[..., t - 1, :] = torch.rand(*lead, n, generator=g) < 0.15
    return q.to(device, dtype), keys.to(device, dtype), head_w.to(device), visible.to(device)


def _ref_scores(q, keys, head_w, visible, dot_scale: float = 1.0) -> torch.Tensor:
    """The graphs function, 512 queries at a time (its ``[T, Hi, N]`` intermediate is large)."""
    parts = [
        index_scores(
            q[..., i : i + 512, :, :], keys, head_w[..., i : i + 512, :], visible[..., i : i + 512, :], dot_scale
        )
        for i in range(0, q.shape[-3], 512)
    ]
    return torch.cat(parts, dim=-2)


def _check_selection(
    mask: torch.Tensor,
    ref: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    tol: float,
    seed: int,
    expect: torch.Tensor | None = None,
) -> None:
    """``mask`` against the reference scores ``ref`` (-inf where hidden) and the reference
    selection ``expect`` (by default score_topk's, restated on ``ref``)."""
    assert mask.dtype == torch.bool and mask.shape == visible.shape, f"seed {seed}"
    assert not (mask & ~visible).any(), f"seed {seed}: a hidden entry was chosen"
    assert torch.equal(mask.sum(-1), visible.sum(-1).clamp(max=k)), f"seed {seed}: counts != min(k, #visible)"
    lowest_chosen = ref.masked_fill(~mask, INF).amin(-1)
    highest_left = ref.masked_fill(~(visible & ~mask), -INF).amax(-1)
    assert (lowest_chosen >= highest_left - tol).all(), f"seed {seed}: an unchosen entry scores above a chosen one"
    n = ref.shape[-1]
    top = ref.topk(min(k + 1, n), dim=-1)
    if k < n:
        gap = torch.where(top.values[..., k] == -INF, INF, top.values[..., k - 1] - top.values[..., k])
    else:
        gap = torch.full(ref.shape[:-1], INF, device=ref.device)
    if expect is None:
        expect = torch.zeros_like(mask).scatter_(-1, top.indices[..., :k], True) & visible
    clear = gap > tol
    assert torch.equal(mask[clear], expect[clear]), f"seed {seed}: the chosen set differs from the reference"


# --- CPU (interpreter) and GPU: small fp32 cases --------------------------------------------------


@pytest.mark.parametrize("dot_scale", [1.0, 32**-0.5])
@pytest.mark.parametrize(
    "lead, t, h, d, n",
    [((2,), 3, 4, 32, 70), ((), 5, 3, 20, 33), ((2, 2), 2, 16, 64, 130)],
    ids=["small", "odd-dims", "CL"],
)
def test_scores_match_reference(device: str, lead, t: int, h: int, d: int, n: int, dot_scale: float) -> None:
    seed = _fresh_seed()
    q, keys, head_w, visible = _case(seed, lead, t, h, d, n, torch.float32, device)
    out = torch.full(visible.shape, float("nan"), device=device)  # poisoned: every element must be written
    assert indexer_scores_triton(q, keys, head_w, visible, dot_scale, out=out) is out
    ref = index_scores(q, keys, head_w, visible, dot_scale)
    assert torch.equal(out == -INF, ~visible), f"seed {seed}: -inf exactly where hidden"
    torch.testing.assert_close(out[visible], ref[visible], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("block", [None, 16])  # 16: several blocks per row, ties ranked across them
@pytest.mark.parametrize("k", [1, 16, 40, 70, 100])  # 40 > most rows' #visible; 70 = N; 100 > N
def test_topk_matches_reference(device: str, k: int, block) -> None:
    seed = _fresh_seed()
    q, keys, head_w, visible = _case(seed, (2,), 3, 4, 32, 70, torch.float32, device)
    scores = indexer_scores_triton(q, keys, head_w, visible)
    mask = torch.ones_like(visible)  # poisoned: a row left unwritten fails the count
    assert topk_mask_triton(scores, k, out=mask, block=block) is mask
    ref = index_scores(q, keys, head_w, visible, 1.0)
    _check_selection(mask, ref, visible, k, 1e-4, seed, expect=score_topk(q, keys, head_w, visible, k))
    assert not mask[:, 0].any(), f"seed {seed}: a query that sees nothing chooses nothing"
    assert torch.equal(indexer_topk_triton(q, keys, head_w, visible, k), mask), f"seed {seed}"


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("k", [1, 4, 30, 64, 90])  # 30: more than some rows' finite entries; 90 > N
def test_topk_mask_op_is_the_graphs_selection(device: str, k: int, block) -> None:
    """``deepinfer::topk_mask``'s kernel against ``indexer.top_k_mask`` (V4.1's selections): the
    same set, +inf always kept (the candidate level's newest block), -inf never; distinct random
    scores, so the reference's set is defined."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, 5, 64, generator=g)
    scores = scores.masked_fill(torch.rand(3, 5, 64, generator=g) < torch.rand(3, 5, 1, generator=g), -INF)
    scores[:, 1, 17] = INF
    scores[0, 2] = -INF  # a query that sees nothing
    scores = scores.to(device)
    mask = torch.ones(scores.shape, dtype=torch.bool, device=device)  # poisoned
    assert topk_mask_triton(scores, k, out=mask, block=block) is mask
    assert torch.equal(mask, top_k_mask(scores, min(k, 64))), f"seed {seed}"
    assert mask[:, 1, 17].all() and not mask[0, 2].any(), f"seed {seed}"


@pytest.mark.parametrize("block", [None, 8])
@pytest.mark.parametrize("k", [1, 3, 5, 9, 12, 20])
def test_ties_lowest_index_first(device: str, k: int, block) -> None:
    """Scores with heavy ties (at the threshold too), negatives, -0.0 == +0.0 and hidden entries:
    exactly the first k of a stable descending sort of the entries above -inf."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (4, 19), generator=g).float()
    scores[0, ::3] = -0.0
    scores[1] = -1e30
    scores[2, :7] = -INF
    scores[3] = -INF
    scores = scores.to(device)
    mask = topk_mask_triton(scores, k, block=block)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    n_eligible = (scores > -INF).sum(-1, keepdim=True)
    first = torch.arange(19, device=device) < n_eligible.clamp(max=k)
    expect = torch.zeros_like(mask).scatter_(-1, order, first)
    assert torch.equal(mask, expect), f"seed {seed}: {scores}\n{mask}\n{expect}"


@pytest.mark.parametrize("k", [4, 16])
def test_integer_scores_tie_through_both_kernels(device: str, k: int) -> None:
    """Small integer q, keys and weights make every score exact in any order of summation, and
    many of them equal: the kernels choose the reference's scores, ties lowest index first."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (2, 3, 4, 32), generator=g).float().to(device)
    keys = torch.randint(-2, 3, (2, 70, 32), generator=g).float().to(device)
    head_w = torch.randint(1, 4, (2, 3, 4), generator=g).float().to(device)
    keys[:, 40:50] = keys[:, 30:31]  # equal keys: equal scores whatever q is
    visible = (torch.rand(2, 3, 70, generator=g) < 0.7).to(device)
    ref = index_scores(q, keys, head_w, visible, 1.0)
    order = torch.sort(ref, dim=-1, descending=True, stable=True).indices
    first = torch.arange(70, device=device) < visible.sum(-1, keepdim=True).clamp(max=k)
    expect = torch.zeros_like(visible).scatter_(-1, order, first)
    assert torch.equal(indexer_topk_triton(q, keys, head_w, visible, k), expect), f"seed {seed}"


def test_strided_inputs(device: str) -> None:
    """Keys cut from a larger buffer, q a slice of a wider last dim, visible a column slice."""
    seed = _fresh_seed()
    q, keys, head_w, visible = _case(seed, (2,), 3, 4, 48, 90, torch.float32, device)
    q_view, keys_view, vis_view = q[..., :32], keys[:, 5:75, :32], visible[..., 5:75]
    scores = indexer_scores_triton(q_view, keys_view, head_w, vis_view)
    ref = index_scores(q_view, keys_view, head_w, vis_view, 1.0)
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    _check_selection(indexer_topk_triton(q_view, keys_view, head_w, vis_view, 16), ref, vis_view, 16, 1e-4, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_read_from_a_pool_by_slot(dtype: torch.dtype, device: str) -> None:
    """``slots``: chunk c scores the pool's slot ``slots[c]`` in place, bit for bit what it scores
    on a gathered copy (slots out of order, one repeated, the pool larger than the batch); the op
    and the graphs function agree, and a slots tensor that does not fit is refused."""
    seed = _fresh_seed()
    q, pool, head_w, visible = _case(seed, (3,), 4, 4, 32, 70, dtype, device)
    pool = torch.cat([pool, torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(seed)).to(device, dtype)])
    slots = torch.tensor([4, 1, 4], device=device)
    scores = indexer_scores_triton(q, pool, head_w, visible, 1.0, slots)
    assert torch.equal(scores, indexer_scores_triton(q, pool[slots], head_w, visible)), f"seed {seed}"
    ref = index_scores(q, pool, head_w, visible, 1.0, slots)
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    mask = indexer_topk_triton(q, pool, head_w, visible, 16, slots)
    assert torch.equal(mask, topk_mask_triton(scores, 16)), f"seed {seed}"
    assert torch.equal(
        torch.ops.deepinfer.indexer_topk(q, pool, head_w, visible, 16, slots),
        mask if device == "cuda" else score_topk(q, pool, head_w, visible, 16, slots),
    ), f"seed {seed}"
    torch.library.opcheck(torch.ops.deepinfer.indexer_scores.default, (q, pool, head_w, visible, 1.0, slots))
    torch.library.opcheck(torch.ops.deepinfer.indexer_topk.default, (q, pool, head_w, visible, 16, slots))
    with pytest.raises(ValueError, match="mismatched shapes"):
        indexer_scores_triton(q, pool, head_w, visible, 1.0, slots[:2])


# Index keys as a trained-format state holds them (``graphs/fake_quant.codec(c, "index")``).
INDEX_ROWS = RowCodec("mxfp4", 128, 32)


def _packed_case(seed: int, c: int, s: int, t: int, h: int, n: int, dtype: torch.dtype, device: str):
    """``_case``'s q, head weights and visibility for ``c`` chunks, with a pool of ``s`` slots of
    ``n`` index keys (di 128) packed as MXFP4 rows: magnitudes from 1e-6 to 1e2 a key, one zero
    key and one zero block. Returns (q, rows, their values in q's dtype, head_w, visible)."""
    q, _, head_w, visible = _case(seed, (c,), t, h, 128, n, dtype, device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s, n, 128, generator=g) * torch.exp(torch.empty(s, n, 1).uniform_(-13.8, 4.6, generator=g))
    x[0, 0] = 0.0
    x[-1, n // 2, :32] = 0.0
    rows = INDEX_ROWS.pack(x.to(dtype)).to(device)
    return q, rows, INDEX_ROWS.unpack(rows, dtype), head_w, visible


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_cuda)])
@pytest.mark.parametrize("n", [1, 64, 70, 200])  # one key, one tile, a partial tile, several tiles
@pytest.mark.parametrize("by_slot", [True, False], ids=["pool", "gathered"])
def test_packed_keys_score_as_their_values(by_slot: bool, n: int, dtype: torch.dtype, device: str) -> None:
    """Keys held as a trained-format state's MXFP4 rows (``key_rows``), read in place: the kernel's
    scores and selections equal, bit for bit, the kernel's on the unpacked values, and the
    reference's (``index_scores`` / ``score_topk``, which unpack only what they read); the ops
    take the layout too."""
    seed = _fresh_seed()
    c, t, h, k, spec = 3, 5, 8, 16, INDEX_ROWS.spec
    q, rows, values, head_w, visible = _packed_case(seed, c, 5 if by_slot else c, t, h, n, dtype, device)
    slots = torch.tensor([4, 1, 4], device=device) if by_slot else None
    out = torch.full(visible.shape, float("nan"), device=device)  # poisoned
    assert indexer_scores_triton(q, rows, head_w, visible, 0.125, slots, spec, out=out) is out
    plain = indexer_scores_triton(q, values, head_w, visible, 0.125, slots)
    assert torch.equal(out.view(torch.int32), plain.view(torch.int32)), f"seed {seed}"
    ref = index_scores(q, rows, head_w, visible, 0.125, slots, spec)
    assert torch.equal(ref, index_scores(q, values, head_w, visible, 0.125, slots)), f"seed {seed}"
    assert torch.equal(out == -INF, ~visible), f"seed {seed}"
    # keys span 1e-6 .. 1e2: the sums' rounding against the largest score (the order of the fp32 sums differs)
    scale = ref.abs().masked_fill(~visible, 0).amax().clamp(min=1e-30)
    torch.testing.assert_close(
        out[visible] / scale, ref[visible] / scale, rtol=0, atol=1e-5, msg=lambda m: f"seed {seed}: {m}"
    )
    mask = indexer_topk_triton(q, rows, head_w, visible, k, slots, spec)
    assert torch.equal(mask, indexer_topk_triton(q, values, head_w, visible, k, slots)), f"seed {seed}"
    _check_selection(mask, ref / 0.125, visible, k, 1e-5 * float(scale) / 0.125, seed)
    assert torch.equal(
        score_topk(q, rows, head_w, visible, k, slots, spec), score_topk(q, values, head_w, visible, k, slots)
    ), f"seed {seed}"
    op_scores = torch.ops.deepinfer.indexer_scores(q, rows, head_w, visible, 0.125, slots, spec)
    assert torch.equal(op_scores, out if device == "cuda" else ref), f"seed {seed}"
    op_mask = torch.ops.deepinfer.indexer_topk(q, rows, head_w, visible, k, slots, spec)
    want = mask if device == "cuda" else score_topk(q, rows, head_w, visible, k, slots, spec)
    assert torch.equal(op_mask, want), f"seed {seed}"


def test_packed_keys_refused_unless_they_fit(device: str) -> None:
    """Rows of another width or dtype than the layout's, or a layout that is no spec, in one line."""
    seed = _fresh_seed()
    q, rows, values, head_w, visible = _packed_case(seed, 2, 2, 3, 4, 40, torch.float32, device)
    spec = INDEX_ROWS.spec
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., N, 68\].*got torch.uint8 \(2, 40, 64\)"):
        indexer_scores_triton(q, rows[..., :64], head_w, visible, 1.0, None, spec)
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., N, 68\].*got torch.float32"):
        indexer_scores_triton(q, values, head_w, visible, 1.0, None, spec)
    with pytest.raises(ValueError, match="not fmt/block/tail"):
        indexer_topk_triton(q, rows, head_w, visible, 4, None, "mxfp4")
    with pytest.raises(ValueError, match="mismatched shapes"):
        indexer_scores_triton(q, rows[:, :30], head_w, visible, 1.0, None, spec)
    torch.library.opcheck(torch.ops.deepinfer.indexer_scores.default, (q, rows, head_w, visible, 1.0, None, spec))
    torch.library.opcheck(torch.ops.deepinfer.indexer_topk.default, (q, rows, head_w, visible, 4, None, spec))


def _batch_invariance(
    seed: int, c: int, t: int, h: int, d: int, n: int, k: int, dtype: torch.dtype, device: str
) -> None:
    q, keys, head_w, visible = _case(seed, (c,), t, h, d, n, dtype, device)
    scores = indexer_scores_triton(q, keys, head_w, visible)
    mask = topk_mask_triton(scores, k)
    for ci, ti in {(0, 0), (c - 1, t - 1), (c // 2, t // 3), (0, min(1, t - 1))}:
        one = (slice(ci, ci + 1), slice(ti, ti + 1))
        alone = indexer_scores_triton(q[one], keys[ci : ci + 1], head_w[one], visible[one])
        assert torch.equal(alone[0, 0], scores[ci, ti]), f"seed {seed}: query ({ci}, {ti}) scores differ alone"
        assert torch.equal(topk_mask_triton(alone, k)[0, 0], mask[ci, ti]), f"seed {seed}: ({ci}, {ti}) selection"


def test_batch_invariance(device: str) -> None:
    _batch_invariance(_fresh_seed(), 3, 5, 4, 32, 70, 16, torch.float32, device)


def test_empty_and_k_zero(device: str) -> None:
    seed = _fresh_seed()
    q, keys, head_w, visible = _case(seed, (2,), 3, 4, 32, 70, torch.float32, device)
    assert not indexer_topk_triton(q, keys, head_w, visible, 0).any()
    none = indexer_topk_triton(q[..., :0, :, :], keys, head_w[..., :0, :], visible[..., :0, :], 16)
    assert none.shape == (2, 0, 70)
    no_entries = indexer_topk_triton(q, keys[:, :0], head_w, visible[..., :0], 16)
    assert no_entries.shape == (2, 3, 0)


def test_registered_for_cuda() -> None:
    for name in ("deepinfer::indexer_topk", "deepinfer::indexer_scores"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name


# --- CUDA: bf16 at the model's sizes ----------------------------------------------------------------


def _model_case(seed: int, c: int, t: int, n: int, positions: torch.Tensor):
    """Hi 64, di 128, bf16 q / keys, head weights scaled as the model does, CSA (ratio 4)
    visibility of queries at ``positions`` ``[c, t]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c, t, 64, 128, generator=g).to("cuda", torch.bfloat16)
    keys = torch.randn(c, n, 128, generator=g).to("cuda", torch.bfloat16)
    head_w = (torch.randn(c, t, 64, generator=g) * (128**-0.5 * 64**-0.5)).cuda()
    return q, keys, head_w, visible_entries(positions.cuda(), n, 4)


@needs_cuda
@pytest.mark.parametrize("n", [128, 2000, 8192])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_bf16_model_sizes(shape: str, n: int) -> None:
    """Decode: 64 rows of one query at random positions (some see fewer than k entries).
    Prefill: one chunk of 4096 queries, entries becoming visible along it."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    if shape == "decode":
        c, t, positions = 64, 1, torch.randint(0, 4 * n, (64, 1), generator=g)
    else:
        c, t = 1, 4096
        positions = torch.randint(0, max(1, 4 * n - t), (1, 1), generator=g) + torch.arange(t)
    q, keys, head_w, visible = _model_case(seed, c, t, n, positions)
    scores = torch.full(visible.shape, float("nan"), device="cuda")
    indexer_scores_triton(q, keys, head_w, visible, out=scores)
    ref = _ref_scores(q, keys, head_w, visible)
    assert torch.equal(scores == -INF, ~visible), f"seed {seed}"
    # bf16 products are exact in fp32; only the order of the fp32 sums differs (~1e-6 here)
    torch.testing.assert_close(scores[visible], ref[visible], rtol=1e-4, atol=2e-5, msg=lambda m: f"seed {seed}: {m}")
    mask = torch.ones_like(visible)
    topk_mask_triton(scores, 512, out=mask)
    _check_selection(mask, ref, visible, 512, 2e-5, seed)
    assert torch.equal(torch.ops.deepinfer.indexer_topk(q, keys, head_w, visible, 512), mask), f"seed {seed}"


@needs_cuda
def test_bf16_batch_invariance() -> None:
    """A query alone == the same query among 8 x 256 (its block neighbour differs)."""
    seed = _fresh_seed()
    _batch_invariance(seed, 8, 256, 64, 128, 3000, 512, torch.bfloat16, "cuda")


@needs_cuda
def test_op_replays_in_a_cuda_graph() -> None:
    seed = _fresh_seed()
    positions = torch.randint(0, 4 * 4096, (64, 1), generator=torch.Generator().manual_seed(seed))
    q, keys, head_w, visible = _model_case(seed, 64, 1, 4096, positions)
    graph = torch.cuda.CUDAGraph()
    torch.ops.deepinfer.indexer_topk(q, keys, head_w, visible, 512)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = torch.ops.deepinfer.indexer_topk(q, keys, head_w, visible, 512)
    q2, keys2, head_w2, visible2 = _model_case(seed + 1, 64, 1, 4096, positions.flip(0))
    q.copy_(q2), keys.copy_(keys2), head_w.copy_(head_w2), visible.copy_(visible2)
    graph.replay()
    assert torch.equal(out, indexer_topk_triton(q, keys, head_w, visible, 512)), f"seed {seed}"
