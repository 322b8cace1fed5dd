"""The Triton ``sparse_mqa`` kernel against ``graphs/attention.py::mqa_with_sink``.

Every case draws a fresh seed (printed in the failure message). On CPU the kernels run under
Triton's interpreter in fp32 at small sizes; with CUDA, bf16 cases at the model's sizes run too.
Small ``block_n``/``split`` values reach the split paths (several splits, parallel + combine)
at interpreter sizes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import triton
from sm90_ptxas import PTXAS, compile_in_subprocess, ptxas_report

from deepinfer_fx.graphs.attention import mqa_with_sink
from deepinfer_fx.kernels.triton.attention import _live_tiles, default_split, sparse_mqa_triton

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="bf16 at model sizes needs a GPU")

# Forced tilings: the shape rule's own, one sequential and one parallel with several splits.
PATHS = {
    "default": {},
    "sequential": dict(block_n=16, split=32, parallel=False),
    "parallel": dict(block_n=16, split=32, parallel=True),
}


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _case(seed: int, lead: tuple[int, ...], t: int, h: int, d: int, n: int, dtype: torch.dtype, device: str):
    """Random q/keys/sink, rope tables of random angles over the last eighth of d (d 48: 3 pairs,
    not a power of two) and a 0/-inf bias with ~half the keys hidden, a whole hidden tile
    range, and fully hidden rows (the sink alone: output 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, t, h, d, generator=g)
    keys = torch.randn(*lead, n, d, generator=g)
    hidden = torch.rand(*lead, t, n, generator=g) < 0.5
    hidden[..., : min(n, 40)] = True  # whole tiles to skip
    hidden[..., 0, :] = True
    if t > 2:
        hidden[..., t // 2, :] = True
    bias = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    sink = torch.randn(h, generator=g)
    angles = torch.rand(*lead, t, d // 16, generator=g) * 2 * math.pi
    tables = angles.cos().to(device), angles.sin().to(device)
    return q.to(device, dtype), keys.to(device, dtype), bias.to(device), sink.to(device), *tables


def _check(out: torch.Tensor, q, keys, bias, sink, cos, sin, seed: int, tol: float = 1e-5) -> None:
    ref = mqa_with_sink(q, keys, bias, sink, cos, sin)
    assert out.dtype == q.dtype and out.shape == q.shape, f"seed {seed}"
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "lead, t, h, d, n",
    [((), 5, 4, 32, 37), ((2, 3), 4, 8, 64, 100), ((3,), 2, 4, 48, 70)],
    ids=["3d", "CL", "d48"],
)
def test_matches_reference(device: str, path: str, lead, t: int, h: int, d: int, n: int) -> None:
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, lead, t, h, d, n, torch.float32, device)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    assert sparse_mqa_triton(q, keys, bias, sink, cos, sin, out=out, **PATHS[path]) is out
    _check(out, q, keys, bias, sink, cos, sin, seed)
    assert torch.all(out[..., 0, :, :] == 0), f"seed {seed}: a fully hidden row must give 0"


def test_strided_inputs(device: str) -> None:
    """Keys cut from a larger buffer and a bias that is a column slice keep their strides."""
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, (2,), 3, 4, 32, 90, torch.float32, device)
    keys_view, bias_view = keys[:, 5:65], bias[..., 5:65]
    out = sparse_mqa_triton(q, keys_view, bias_view, sink, cos, sin, **PATHS["parallel"])
    _check(out, q, keys_view, bias_view, sink, cos, sin, seed)


@pytest.mark.parametrize("combine_heads", [None, 1, 2])
def test_modes_bitwise_equal(device: str, combine_heads: int | None) -> None:
    """Sequential and parallel runs of one split length share their arithmetic exactly, however
    many heads a combine program takes."""
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, (2,), 3, 4, 32, 100, torch.float32, device)
    a = sparse_mqa_triton(q, keys, bias, sink, cos, sin, **PATHS["sequential"])
    b = sparse_mqa_triton(q, keys, bias, sink, cos, sin, **PATHS["parallel"], combine_heads=combine_heads)
    assert torch.equal(a, b), f"seed {seed}"


def _batch_invariance(seed: int, c: int, t: int, h: int, d: int, n: int, dtype: torch.dtype, device: str, **kw) -> None:
    """A chunk alone (parallel path: few programs) == the same chunk among ``c`` (sequential)."""
    q, keys, bias, sink, cos, sin = _case(seed, (c,), t, h, d, n, dtype, device)
    batched = sparse_mqa_triton(q, keys, bias, sink, cos, sin, **kw)
    for ci in (0, c - 1, c // 2):
        alone = sparse_mqa_triton(
            q[ci : ci + 1], keys[ci : ci + 1], bias[ci : ci + 1], sink, cos[ci : ci + 1], sin[ci : ci + 1], **kw
        )
        assert torch.equal(alone[0], batched[ci]), f"seed {seed}: chunk {ci} differs alone"


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill"])
def test_batch_invariance(device: str, t: int) -> None:
    """Alone, a chunk takes the parallel path; in a batch of 70, the sequential one; the bits agree."""
    _batch_invariance(_fresh_seed(), 70, t, 4, 32, 100, torch.float32, device, block_n=16, split=32)


@pytest.mark.parametrize("t", [1, 4])
def test_skipping_hidden_tiles_is_exact(device: str, t: int) -> None:
    """Reading only the live tiles gives the bits of reading every tile in one split."""
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, (2,), t, 4, 32, 100, torch.float32, device)
    bias[..., 50:90] = float("-inf")  # more whole hidden tiles, between live ones
    a = sparse_mqa_triton(q, keys, bias, sink, cos, sin, block_n=16, skip=True)
    b = sparse_mqa_triton(q, keys, bias, sink, cos, sin, block_n=16, skip=False, split=100, parallel=False)
    assert torch.equal(a, b), f"seed {seed}"
    _check(a, q, keys, bias, sink, cos, sin, seed)


@pytest.mark.parametrize(
    "n, block_n",
    [(100, 16), (3000, 64), (64, 64), (3000, 1)],
    ids=["partial-tile", "two-chunks", "one-tile", "keys"],
)
def test_live_tile_lists(device: str, n: int, block_n: int) -> None:
    """Per row, the tiles holding a visible key, ascending and packed first, and their count:
    against a torch scan, on a column-strided bias (rows of all -inf, of all live, and random)."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    rows = 7
    # a tile is live with probability ~0.4 whatever block_n is: hide whole tiles, then sprinkle keys
    live_tile = torch.rand(rows, triton.cdiv(n, block_n), generator=g) < 0.4
    visible = live_tile.repeat_interleave(block_n, -1)[:, :n] & (torch.rand(rows, n, generator=g) < 0.3)
    visible[torch.arange(rows), (torch.rand(rows, generator=g) * n).long()] = True
    visible[0], visible[1] = False, True
    bias = torch.zeros(rows, n).masked_fill(~visible, float("-inf"))
    strided = torch.full((rows, n, 2), float("nan"), device=device)[..., 0]
    strided.copy_(bias)
    # the scan holds _LIVE_ELEMENTS values a step: 3000 keys in tiles of 64 take two steps
    tiles, count, n_tiles = _live_tiles(strided, block_n)
    padded = torch.nn.functional.pad(visible, (0, n_tiles * block_n - n))
    want = padded.view(rows, n_tiles, block_n).any(-1)
    assert n_tiles == want.shape[1] and torch.equal(count.cpu(), want.sum(-1).int()), f"seed {seed}"
    for r in range(rows):
        got = tiles[r, : int(count[r])].cpu()
        assert torch.equal(got, want[r].nonzero().flatten().int()), f"seed {seed} row {r}"


def test_split_rule() -> None:
    """Whole tiles, at least 128 keys, at most 32 splits (partials stay small)."""
    for n in (1, 100, 640, 4224, 40_000):
        split = default_split(n, 64)
        assert split % 64 == 0 and split >= 128 and -(-n // split) <= 32, n


# --- CUDA: bf16 at the model's sizes ------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("n", [640, 4224])
@pytest.mark.parametrize("lead, t", [((), 1), ((4,), 1), ((2,), 64)], ids=["T1", "C4xT1", "C2xT64"])
def test_bf16_model_sizes(lead, t: int, n: int) -> None:
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, lead, t, 64, 512, n, torch.bfloat16, "cuda")
    out = torch.full_like(q, float("nan"))
    sparse_mqa_triton(q, keys, bias, sink, cos, sin, out=out)
    _check(out, q, keys, bias, sink, cos, sin, seed, tol=2e-2)


@needs_cuda
def test_fp32_d512() -> None:
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, (2,), 3, 64, 512, 700, torch.float32, "cuda")
    _check(sparse_mqa_triton(q, keys, bias, sink, cos, sin), q, keys, bias, sink, cos, sin, seed, tol=1e-4)


@needs_cuda
@pytest.mark.parametrize("c, t", [(64, 1), (8, 2)], ids=["decode", "prefill"])
def test_bf16_batch_invariance(c: int, t: int) -> None:
    """Default rule at model sizes: alone is parallel (split + combine), in the batch sequential."""
    _batch_invariance(_fresh_seed(), c, t, 64, 512, 4224, torch.bfloat16, "cuda")


@needs_cuda
def test_bf16_prefill_chunk() -> None:
    """A 1024-query prefill chunk whose bias is the model's: a 128-key window and 512 chosen
    compressed entries of the 256 + 1024 (ring + chunk) rows and 256 entries."""
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    t, ring, ents = 1024, 128, 256
    pos = torch.arange(t)[:, None]
    key_pos = torch.cat([torch.arange(-ring, 0), torch.arange(t)])[None, :]
    window = (key_pos <= pos) & (key_pos > pos - 128)
    chosen = torch.rand(t, ents, generator=g) < 0.5
    chosen &= torch.arange(ents)[None, :] < (pos + 1) // 4
    hidden = ~torch.cat([window, chosen], 1)
    bias = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf")).cuda()
    q = torch.randn(t, 64, 512, generator=g).to("cuda", torch.bfloat16)
    keys = torch.randn(hidden.shape[1], 512, generator=g).to("cuda", torch.bfloat16)
    sink = torch.randn(64, generator=g).cuda()
    angles = torch.arange(t)[:, None] * torch.rand(32, generator=g)  # the rope of positions 0..t-1
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    _check(sparse_mqa_triton(q, keys, bias, sink, cos, sin), q, keys, bias, sink, cos, sin, seed, tol=2e-2)


@needs_cuda
def test_op_dispatches_to_triton_and_replays_in_a_cuda_graph() -> None:
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, (4,), 1, 64, 512, 1000, torch.bfloat16, "cuda")
    op = torch.ops.deepinfer.sparse_mqa
    assert torch.equal(op(q, keys, bias, sink, cos, sin), sparse_mqa_triton(q, keys, bias, sink, cos, sin))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, keys, bias, sink, cos, sin)
    q2, keys2, bias2, _, cos2, sin2 = _case(seed + 1, (4,), 1, 64, 512, 1000, torch.bfloat16, "cuda")
    q.copy_(q2), keys.copy_(keys2), bias.copy_(bias2), cos.copy_(cos2), sin.copy_(sin2)
    graph.replay()
    _check(out, q, keys, bias, sink, cos, sin, seed + 1, tol=2e-2)


@pytest.mark.parametrize("t", [4, 9])
def test_key_lists_match_the_reference_and_the_batch(device: str, t: int) -> None:
    """``live="keys"``: a skipping launch reads tiles of listed visible keys instead of the tiles
    holding one; it gives the reference's values, a row the same bits alone and in its batch."""
    seed = _fresh_seed()
    q, keys, bias, sink, cos, sin = _case(seed, (3,), t, 4, 32, 150, torch.float32, device)
    kw = dict(block_n=16, skip=True, live="keys")
    got = sparse_mqa_triton(q, keys, bias, sink, cos, sin, **kw)
    _check(got, q, keys, bias, sink, cos, sin, seed)
    assert torch.all(got[..., 0, :, :] == 0), f"seed {seed}: a fully hidden row must give 0"
    alone = sparse_mqa_triton(q[1:2], keys[1:2], bias[1:2], sink, cos[1:2], sin[1:2], **kw)
    assert torch.equal(alone[0], got[1]), f"seed {seed}: chunk 1 differs alone"
    # a list's last tile is padded with a listed key: keys no query lists are never read
    hidden = torch.isinf(bias).all(dim=-2)
    assert hidden.any(), f"seed {seed}: the case hides no key from a whole chunk"
    poisoned = keys.masked_fill(hidden[..., None], float("nan"))
    assert torch.equal(sparse_mqa_triton(q, poisoned, bias, sink, cos, sin, **kw), got), f"seed {seed}"
    with pytest.raises(ValueError, match="'keys' a skipping launch"):
        sparse_mqa_triton(q, keys, bias, sink, cos, sin, block_n=16, skip=False, live="keys")


def _compile_for_sm90(out_dir: str) -> None:
    """The prefill launches' PTX for sm_90 at the released widths (H 64, d 512, bf16, a chunk of
    64 queries over 700 keys), live tiles and live keys, as the launcher chooses them on ``meta``
    tensors, into ``out_dir`` (a child process without the interpreter: ``compile_in_subprocess``)."""
    from sm90_ptxas import recorded_launches

    meta = dict(device="meta")
    q = torch.empty(64, 64, 512, dtype=torch.bfloat16, **meta)
    keys = torch.empty(700, 512, dtype=torch.bfloat16, **meta)
    bias = torch.empty(64, 700, **meta)
    cos = torch.empty(64, 32, **meta)
    for live in ("tiles", "keys"):
        with recorded_launches() as launches:
            sparse_mqa_triton(q, keys, bias, torch.empty(64, **meta), cos, cos, live=live)
        (launch,) = [x for x in launches if x.name == "mqa_sequential"]
        Path(out_dir, f"{live}.ptx").write_text(launch.compile().asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_attention", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("live", ["tiles", "keys"])
def test_prefill_compiles_for_sm90_without_spills(live: str, sm90_ptx: Path) -> None:
    """Both prefill lists compile for the H200 on tensor cores (wgmma) without spills, as two
    kernels (``live`` reaches the kernel)."""
    ptx = (sm90_ptx / f"{live}.ptx").read_text()
    assert ptx != (sm90_ptx / f"{'tiles' if live == 'keys' else 'keys'}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, log
    assert "wgmma" in ptx
