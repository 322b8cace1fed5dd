"""``deepinfer::bi_attend``'s Triton kernel (``kernels/triton/bi_attention.py``) against its CPU
kernel ``graphs/batch_invariant.py::attend_sorted``, and its batch invariance: a query's output
bits depend only on the query, its visible key sequence and the sink, never on the layout around
them (C, T, N, hidden keys, other queries, the head's row in its tile).

Every case draws a fresh seed (named in failure messages). On CPU the kernel runs under Triton's
interpreter in fp32 at small sizes; with CUDA, bf16 at the model's sizes too. The sm_90 compile
at the released widths (H 64 and 128, D 512, bf16) runs offline wherever ptxas is.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sm90_ptxas import PTXAS, compile_in_subprocess, ptxas_report

from deepinfer_fx.graphs.batch_invariant import attend_sorted, canonical_order
from deepinfer_fx.kernels.triton.bi_attention import bi_attend_triton

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="model sizes and bf16 dots need a GPU (the interpreter cannot run bf16 dots)"
)

# dtype -> relative tolerance against the fp32 reference (bf16: probabilities rounded for the P.V dot)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _layout(g: torch.Generator, c: int, t: int, n: int, nw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window positions ``[C, nw]`` (distinct, shuffled: the ring's slot order is not its position
    order) and a 0 / -inf bias ``[C, T, N]`` with about half the keys hidden."""
    k_pos = torch.stack([torch.randperm(4 * n, generator=g)[:nw] for _ in range(c)])
    hidden = torch.rand(c, t, n, generator=g) < 0.5
    return k_pos, torch.zeros(c, t, n).masked_fill(hidden, float("-inf"))


def _case(seed: int, c: int, t: int, h: int, d: int, n: int, dtype: torch.dtype, device: str):
    """Random q / keys / sink and a canonical order over a random visibility; the first query
    sees no key, the second exactly one, the last all N, the others about half."""
    g = torch.Generator().manual_seed(seed)
    k_pos, bias = _layout(g, c, t, n, nw=(n * 2) // 3)
    bias[0, 0] = float("-inf")
    if t > 1:
        bias[0, 1] = float("-inf")
        bias[0, 1, n // 2] = 0.0
    bias[-1, -1] = 0.0
    order, count = canonical_order(k_pos, bias)
    q = torch.randn(c, t, h, d, generator=g)
    keys = torch.randn(c, n, d, generator=g)
    sink = torch.randn(h, generator=g)
    to = dict(device=device)
    return q.to(dtype=dtype, **to), keys.to(dtype=dtype, **to), order.to(**to), count.to(**to), sink.to(**to)


def _check(out: torch.Tensor, q, keys, order, count, sink, seed: int) -> None:
    ref = attend_sorted(q.cpu(), keys.cpu(), order.cpu(), count.cpu(), sink.cpu())
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous(), f"seed {seed}"
    assert not out.isnan().any(), f"seed {seed}: NaN in the output"
    assert torch.all(out[count == 0] == 0), f"seed {seed}: a query with no visible key must give 0"
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize(
    "c, t, h, d, n",
    [(2, 3, 2, 32, 37), (1, 4, 5, 64, 100), (3, 2, 16, 32, 70), (2, 2, 20, 64, 90), (1, 1, 4, 32, 1)],
    ids=["h2", "h5", "h16", "h20", "n1"],
)
def test_matches_reference(device: str, c: int, t: int, h: int, d: int, n: int) -> None:
    seed = _fresh_seed()
    case = _case(seed, c, t, h, d, n, torch.float32, device)
    _check(bi_attend_triton(*case), *case, seed)


def test_strided_inputs(device: str) -> None:
    """q a slice of a wider projection, keys rows of a larger buffer, order and count transposed
    views: the kernel takes every stride."""
    seed = _fresh_seed()
    q, keys, order, count, sink = _case(seed, 2, 3, 5, 32, 60, torch.float32, device)
    q_wide = torch.full((2, 3, 5, 48), float("nan"), device=device)
    q_wide[..., 8:40] = q
    keys_buf = torch.full((2, 80, 32), float("nan"), device=device)
    keys_buf[:, 10:70] = keys
    order_t = order.transpose(0, 1).contiguous().transpose(0, 1)
    count_t = count.t().contiguous().t()
    out = bi_attend_triton(q_wide[..., 8:40], keys_buf[:, 10:70], order_t, count_t, sink)
    _check(out, q, keys, order, count, sink, seed)


def test_no_visible_key_gives_zeros(device: str) -> None:
    """count 0 everywhere: zeros, whatever the keys hold (they are never read, NaN included)."""
    g = torch.Generator().manual_seed(_fresh_seed())
    q = torch.randn(2, 3, 5, 32, generator=g).to(device)
    keys = torch.full((2, 7, 32), float("nan"), device=device)
    order = torch.arange(7, device=device).expand(2, 3, 7)
    count = torch.zeros(2, 3, dtype=torch.int64, device=device)
    out = bi_attend_triton(q, keys, order, count, torch.randn(5, generator=g).to(device))
    assert torch.equal(out, torch.zeros_like(q))


def _embed(g, q_head, seq, sink, *, c, t, n, nw, at, heads, window_keys, junk):
    """A layout of ``c`` chunks of ``t`` queries over ``n`` keys (the first ``nw`` a window ring)
    in which query ``at`` = (c0, t0) has the heads ``q_head`` ``[h, D]`` at rows ``heads`` of
    ``H = len(sink)`` and sees exactly ``seq`` ``[m, D]``: its first ``window_keys`` at random
    ring slots with rising positions, the rest as entries at random rising indices. Hidden keys
    are ``junk`` (NaN: never read), other heads, queries and chunks random. -> the op's inputs."""
    m, d = seq.shape
    c0, t0 = at
    k_pos, bias = _layout(g, c, t, n, nw)
    keys = torch.randn(c, n, d, generator=g)
    keys[c0] = junk
    slots = torch.randperm(nw, generator=g)[:window_keys]  # in the order of their (rising) positions
    k_pos[c0, slots] = torch.sort(torch.randperm(4 * n, generator=g)[:window_keys]).values
    entries = nw + torch.sort(torch.randperm(n - nw, generator=g)[: m - window_keys]).values
    rows = torch.cat([slots, entries])
    keys[c0, rows] = seq
    bias[c0, t0] = float("-inf")
    bias[c0, t0, rows] = 0.0
    order, count = canonical_order(k_pos, bias)
    assert torch.equal(order[c0, t0, :m], rows) and count[c0, t0] == m
    q = torch.randn(c, t, len(sink), d, generator=g)
    q[c0, t0, heads] = q_head
    return q, keys, order, count


def _invariance(seed: int, m: int, d: int, dtype: torch.dtype, device: str, h_all: int = 20) -> None:
    """One query's heads over one visible key sequence of ``m`` keys give the same bits alone and
    embedded among other chunks, queries, heads (at other rows of other head blocks, ``h_all`` in
    all) and hidden keys (NaN, inf or huge: never read). Alone means among ``heads`` heads too:
    the head tiling is a function of H (``heads_per_program``)."""
    g = torch.Generator().manual_seed(seed)
    h = 3
    q_head, seq = torch.randn(h, d, generator=g), torch.randn(m, d, generator=g)
    sink3 = torch.randn(h, generator=g)
    lone_q = torch.zeros(1, 1, h_all, d)
    lone_q[0, 0, :h] = q_head
    lone_sink = torch.zeros(h_all)
    lone_sink[:h] = sink3
    alone = bi_attend_triton(
        lone_q.to(device, dtype),
        seq[None].to(device, dtype),
        torch.arange(m, device=device).expand(1, 1, m),
        torch.full((1, 1), m, device=device),
        lone_sink.to(device),
    )[0, 0, :h]
    # (C, T, N, window slots, the query, its heads' rows among H, its window keys, hidden keys)
    layouts = [
        (1, 1, m + 5, 3, (0, 0), [0, 1, 2], 0, float("nan")),
        (3, 4, m + 40, 30, (1, 2), [17, 4, 9], min(m, 20), float("nan")),
        (2, 5, 2 * m + 7, m, (1, 4), [15, 16, 19], m, float("inf")),
        (4, 1, m + 1, m // 2, (3, 0), [2, 18, 7], m // 2, 1e30),
        (2, 3, m + 300, 128, (0, 1), [5, 3, 11], min(m, 128), float("nan")),
    ]
    for i, (c, t, n, nw, at, heads, window_keys, junk) in enumerate(layouts):
        sink = torch.randn(h_all, generator=g)
        sink[heads] = sink3
        q, keys, order, count = _embed(
            g, q_head, seq, sink, c=c, t=t, n=n, nw=nw, at=at, heads=heads, window_keys=window_keys, junk=junk
        )
        out = bi_attend_triton(
            q.to(device, dtype), keys.to(device, dtype), order.to(device), count.to(device), sink.to(device)
        )
        assert torch.equal(out[at][heads], alone), f"seed {seed}: layout {i} changed the bits"
        assert not out[at].isnan().any(), f"seed {seed}: layout {i}: a hidden key was read"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the other queries of the chunk meet the NaN keys
@pytest.mark.parametrize("m", [1, 32, 150], ids=["one-key", "one-tile", "five-tiles"])
def test_batch_invariance(device: str, m: int) -> None:
    _invariance(_fresh_seed(), m, 32, torch.float32, device)


# --- CUDA: bf16 at the model's sizes ------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("c, t, n", [(4, 1, 700), (2, 64, 1200)], ids=["decode", "prefill"])
def test_bf16_model_sizes(c: int, t: int, n: int, h: int) -> None:
    seed = _fresh_seed()
    case = _case(seed, c, t, h, 512, n, torch.bfloat16, "cuda")
    _check(bi_attend_triton(*case), *case, seed)


@needs_cuda
def test_fp32_d512() -> None:
    seed = _fresh_seed()
    case = _case(seed, 2, 3, 64, 512, 300, torch.float32, "cuda")
    _check(bi_attend_triton(*case), *case, seed)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 64, 700])
def test_batch_invariance_on_gpu(m: int, dtype: torch.dtype) -> None:
    _invariance(_fresh_seed(), m, 512, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("h_all", [64, 128])
@pytest.mark.parametrize("m", [1, 64, 700])
def test_batch_invariance_at_released_widths(m: int, h_all: int) -> None:
    """bf16 with 64 heads a program (``heads_per_program``): a decode query alone, and the same
    query among a prefill chunk's, give the same bits."""
    _invariance(_fresh_seed(), m, 512, torch.bfloat16, "cuda", h_all)


# --- sm_90 offline compile ----------------------------------------------------------------------

SM90_HEADS = (64, 128)  # V4-Flash / V4.1-Flash, V4-Pro


def _compile_for_sm90(out_dir: str) -> None:
    """The kernel's PTX for sm_90 at the released widths (D 512, bf16), as the launcher chooses
    its tiles for H 64 and 128 on ``meta`` tensors, into ``out_dir`` (run in a child process
    without the interpreter, see ``sm90_ptxas.compile_in_subprocess``)."""
    from sm90_ptxas import recorded_launches

    meta = dict(device="meta")
    for h in SM90_HEADS:
        q = torch.empty(3, 2, h, 512, dtype=torch.bfloat16, **meta)
        keys = torch.empty(3, 700, 512, dtype=torch.bfloat16, **meta)
        order = torch.empty(3, 2, 700, dtype=torch.int64, **meta)
        count = torch.empty(3, 2, dtype=torch.int64, **meta)
        with recorded_launches() as launches:
            bi_attend_triton(q, keys, order, count, torch.empty(h, **meta))
        (launch,) = launches
        Path(out_dir, f"h{h}.ptx").write_text(launch.compile().asm["ptx"])
        Path(out_dir, f"h{h}.txt").write_text(launch.describe())


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_bi_attention", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("h", SM90_HEADS)
def test_compiles_for_sm90_without_spills(h: int, sm90_ptx: Path) -> None:
    """The released widths compile for the H200 with tensor-core dots (wgmma: 64 heads a program)
    and no register spills (one program of 8 warps an SM, ``bi_attention.py``'s tiles)."""
    ptx = (sm90_ptx / f"h{h}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, f"{(sm90_ptx / f'h{h}.txt').read_text()}\n{log}"
    assert "wgmma" in ptx


def test_canonical_order_is_a_stable_partition_of_the_sorted_keys() -> None:
    """``canonical_order``: window keys by position, then the entries in their order, each query's
    visible keys first and its hidden ones after, both in that order; ``count`` the visible ones."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    for c, t, n, nw in [(2, 3, 37, 16), (3, 1, 50, 50), (1, 5, 9, 0), (2, 2, 1, 1)]:
        k_pos, bias = _layout(g, c, t, n, nw)
        order, count = canonical_order(k_pos, bias)
        for ci in range(c):
            keys = sorted(range(nw), key=lambda j: int(k_pos[ci, j])) + list(range(nw, n))
            for ti in range(t):
                shown = [j for j in keys if bias[ci, ti, j] == 0]
                want = shown + [j for j in keys if bias[ci, ti, j] != 0]
                assert order[ci, ti].tolist() == want and int(count[ci, ti]) == len(shown), f"seed {seed}"
