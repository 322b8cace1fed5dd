"""The Triton skinny GEMM (``kernels/triton/linear.py``) against ``graphs/norm.py::project``.

On CPU the launcher runs under Triton's interpreter with fp32 operands (its bf16 ``tl.dot`` is
not usable) and small shapes; on a GPU the same cases also run bf16, plus the attention
projections of the P8 model, for accuracy and for batch invariance: a row's result must be the
same bits alone or inside any batch. Every case draws a fresh seed and names it on failure.

Split K runs in one launch: the last split of a tile to arrive sums every split's partial in
split order. The result must be the same bits as summing, in torch, the partials that one-split
calls over each k range produce, and the arrival counters must be zero after every call. The
interpreter runs programs one after another, so it checks the election and the sum but not the
memory ordering between SMs; on a GPU, repeats replayed from a CUDA graph must match the first
result bitwise, and each call must be one kernel. Everywhere ptxas is, the kernel is compiled
for sm_90 offline and must not spill.
"""

from __future__ import annotations


import pytest
import torch

from linear_helpers import (
    DTYPES,
    MODEL_WEIGHTS,
    assert_close,
    cuda_only,
    fresh_seed,
    live_counters,
    operands,
    reference,
    split_bounds,
)

from deepinfer_fx.kernels.triton import linear
from deepinfer_fx.kernels.triton.linear import _MAX_SPLIT, Tiles, choose_tiles, skinny_linear_triton

# (M, N, K, tiles): None is the shape rule; explicit tiles reach the split-K and masked paths
# on shapes the interpreter can afford.
CASES = [
    (1, 96, 64, None),
    (3, 96, 64, None),
    (16, 96, 64, None),
    (16, 96, 160, Tiles(32, 32, 2, 4, 3)),  # two splits, the second masked past K
    (20, 80, 48, Tiles(32, 16, 3, 4, 3)),  # two row blocks, N not a multiple of the column tile
    (5, 64, 256, Tiles(64, 32, 4, 4, 4)),  # four full splits
    (2, 48, 24, None),  # K below one k tile
]
# (M, N, K, tiles) with K split: even ones, N and K off the tiles, more row blocks than one.
SPLIT_CASES = [
    (4, 64, 128, Tiles(32, 32, 2, 4, 3)),
    (3, 48, 192, Tiles(16, 16, 3, 4, 3)),
    (16, 64, 256, Tiles(32, 16, 8, 4, 3)),
    (7, 50, 200, Tiles(16, 16, 8, 4, 3)),  # 32-wide splits: seven, the last one 8 deep
    (20, 40, 90, Tiles(32, 16, 4, 4, 3)),  # two row blocks, two column tiles, one partial
    (1, 96, 112, Tiles(32, 16, 7, 4, 3)),
]


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,tiles", CASES)
def test_matches_reference(
    m: int, n: int, k: int, tiles: Tiles | None, dtype: torch.dtype, out_fp32: bool, device: str
) -> None:
    seed = fresh_seed()
    x, w = operands(seed, m, n, k, dtype, device)
    got = skinny_linear_triton(x, w, out_fp32, tiles)
    why = f"seed={seed} M={m} N={n} K={k} tiles={tiles} {dtype} out_fp32={out_fp32}"
    assert_close(got, x, w, out_fp32, why)
    want = reference(x, w, out_fp32)
    assert got.dtype == want.dtype and got.shape == want.shape, why


def test_stridedoperands(device: str) -> None:
    """Rows of a wider buffer and a weight stored transposed: strides are honoured."""
    seed = fresh_seed()
    x, w = operands(seed, 3, 48, 64, torch.float32, device)
    wide = torch.zeros(3, 80, device=device)
    wide[:, 8:72] = x
    w_t = w.T.contiguous().T  # [N, K] with stride (1, N)
    got = skinny_linear_triton(wide[:, 8:72], w_t, False, Tiles(16, 32, 2, 4, 3))
    assert_close(got, x, w, False, f"seed={seed}")


def test_empty_and_mismatched(device: str) -> None:
    w = torch.randn(32, 16, device=device)
    assert skinny_linear_triton(torch.randn(0, 16, device=device), w, True).shape == (0, 32)
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear_triton(torch.randn(2, 16, device=device, dtype=torch.float64), w, False)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        skinny_linear_triton(torch.randn(2, 8, device=device), w, False)


def test_shape_rule_fills_the_gpu_without_tiny_splits() -> None:
    """At model widths every weight gets ~two programs per SM, or the most splits that keep at
    least two k tiles each; every split's k range is whole k tiles."""
    for n, k in [*MODEL_WEIGHTS, (129280, 4096), (96, 64)]:
        t = choose_tiles(n, k)
        programs = -(-n // t.bn) * t.split
        assert t.split == 1 or k // t.split >= 2 * t.bk, (n, k, t)
        assert programs >= 256 or t.split == _MAX_SPLIT or k < 4 * t.split * t.bk, (n, k, t)


def test_op_reference_on_cpu() -> None:
    """On CPU the op is the reference math; it traces under fake tensors with the same metadata."""
    seed = fresh_seed()
    for dtype in (torch.float32, torch.bfloat16):
        x, w = operands(seed, 4, 32, 48, dtype, "cpu")
        for out_fp32 in (False, True):
            got = torch.ops.deepinfer.skinny_linear(x, w, out_fp32)
            assert torch.equal(got, reference(x, w, out_fp32)), f"seed={seed} {dtype} {out_fp32}"
            torch.library.opcheck(torch.ops.deepinfer.skinny_linear.default, (x, w, out_fp32))


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,tiles", SPLIT_CASES)
def test_split_k_is_the_ordered_sum_of_partials(
    m: int, n: int, k: int, tiles: Tiles, dtype: torch.dtype, out_fp32: bool, device: str
) -> None:
    """One launch == partial_0 + partial_1 + ... in fp32, summed in torch, bitwise; each partial
    is a one-split call over the split's k range (the same tiles run the same dots), and the
    arrival counters are all zero after every call."""
    seed = fresh_seed()
    x, w = operands(seed, m, n, k, dtype, device)
    why = f"seed={seed} M={m} N={n} K={k} tiles={tiles} {dtype} out_fp32={out_fp32}"
    bounds = split_bounds(k, tiles)
    assert len(bounds) > 2, why
    one = tiles._replace(split=1)
    want = skinny_linear_triton(x[:, : bounds[1]], w[:, : bounds[1]], True, one)
    for lo, hi in zip(bounds[1:-1], bounds[2:]):
        want = want + skinny_linear_triton(x[:, lo:hi], w[:, lo:hi], True, one)
    want = want.to(torch.float32 if out_fp32 else dtype)
    for call in range(3):  # repeats: the counters the first call leaves must elect correctly again
        got = skinny_linear_triton(x, w, out_fp32, tiles)
        assert torch.equal(got, want), f"{why} call {call}"
        assert not live_counters(x.device).any(), f"{why}: counters left nonzero after call {call}"
    assert_close(got, x, w, out_fp32, why)


def test_counters_grow_outside_capture_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A larger grid gets a larger zeroed buffer, and the superseded one stays allocated (a graph
    captured earlier may hold it); during a capture growing is refused with a clear error."""
    monkeypatch.setattr(linear, "_COUNTERS", {})
    cpu = torch.device("cpu")
    small = linear._counters(cpu, 10)
    assert linear._counters(cpu, small.numel()) is small
    big = linear._counters(cpu, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any() and linear._COUNTERS[cpu] == [small, big]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="graph capture"):  # raised before touching the device
        linear._counters(torch.device("cuda", 0), 10)


# --- GPU: model sizes ----------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("n,k", MODEL_WEIGHTS)
def test_model_sizes_match_reference(n: int, k: int, out_fp32: bool) -> None:
    seed = fresh_seed()
    for m in (1, 8, 64):
        x, w = operands(seed + m, m, n, k, torch.bfloat16, "cuda")
        got = skinny_linear_triton(x, w, out_fp32)
        assert_close(got, x, w, out_fp32, f"seed={seed + m} M={m} N={n} K={k} out_fp32={out_fp32}")


@cuda_only
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
@pytest.mark.parametrize("n,k", [*MODEL_WEIGHTS, (129280, 4096)])
def test_batch_invariant(n: int, k: int, out_fp32: bool, tma: bool) -> None:
    """Row r alone == row r inside M = 8, 16, 64 == row r beside other rows, bitwise; with the
    rule's tiles, and with their tensor-descriptor variant."""
    seed = fresh_seed()
    x, w = operands(seed, 64, n, k, torch.bfloat16, "cuda")
    t = choose_tiles(n, k)._replace(tma=tma)
    full = skinny_linear_triton(x, w, out_fp32, t)
    assert_close(full, x, w, out_fp32, f"seed={seed} N={n} K={k} {t}")
    other = x.clone()
    other[1:] = torch.randn_like(other[1:])
    for r in (0, 5, 15):
        alone = skinny_linear_triton(x[r : r + 1], w, out_fp32, t)
        for m in (8, 16, 64):
            if r < m:
                inside = skinny_linear_triton(x[:m], w, out_fp32, t)
                assert torch.equal(alone[0], inside[r]), f"seed={seed} N={n} K={k} row {r} of M={m}"
        assert torch.equal(alone[0], full[r]), f"seed={seed} N={n} K={k} row {r}"
    assert torch.equal(skinny_linear_triton(other, w, out_fp32, t)[0], full[0]), (
        f"seed={seed}: other rows changed row 0"
    )


@cuda_only
def test_op_dispatches_to_triton() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::skinny_linear", "CUDA")
    seed = fresh_seed()
    x, w = operands(seed, 8, 4096, 8192, torch.bfloat16, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.skinny_linear(x, w, True)
        torch.cuda.synchronize()
    assert any("_skinny_kernel" in e.name for e in prof.events()), f"seed={seed}: the op did not launch the kernel"
    assert torch.equal(got, skinny_linear_triton(x, w, True)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.skinny_linear.default, (x, w, False))


@cuda_only
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", MODEL_WEIGHTS[1:4])
def test_split_k_graph_replay_is_deterministic(n: int, k: int, m: int) -> None:
    """Many calls captured in one CUDA graph and replayed again and again: every result is the
    bits of the first eager call. Programs of a launch run on many SMs at once here, so this is
    where the arrival counters' memory ordering is exercised (a partial read before it lands,
    or a counter left nonzero, changes the bits or the summing program)."""
    seed = fresh_seed()
    x, w = operands(seed, m, n, k, torch.bfloat16, "cuda")
    assert choose_tiles(n, k).split > 1
    first = skinny_linear_triton(x, w, False)  # compiles and sizes the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_linear_triton(x, w, False) for _ in range(64)]
    for replay in range(20):
        graph.replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert torch.equal(out, first), f"seed={seed} N={n} K={k} M={m}: replay {replay} call {i} differs"
        assert not live_counters(x.device).any(), f"seed={seed}: counters left nonzero"


@cuda_only
@pytest.mark.parametrize("n,k", MODEL_WEIGHTS)
def test_one_launch_per_call(n: int, k: int) -> None:
    """Split or not, a call is one kernel on the device: no sum kernel, no counter reset."""
    x, w = operands(fresh_seed(), 8, n, k, torch.bfloat16, "cuda")
    skinny_linear_triton(x, w, False)  # compiles and allocates the counters first
    torch.cuda.synchronize()
    calls = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(calls):
            skinny_linear_triton(x, w, False)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == calls and all("_skinny_kernel" in name for name in kernels), (choose_tiles(n, k), kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,tiles", CASES + SPLIT_CASES)
def test_tma_tiles_match_reference(
    m: int, n: int, k: int, tiles: Tiles | None, dtype: torch.dtype, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weight tiles read through a tensor descriptor (zeros past N and K), split K included;
    weights whose rows are not 16-byte aligned keep pointer loads."""
    seed = fresh_seed()
    x, w = operands(seed, m, n, k, dtype, device)
    t = tiles or choose_tiles(n, k)
    made = []
    real = linear.TensorDescriptor.from_tensor
    monkeypatch.setattr(
        linear.TensorDescriptor, "from_tensor", staticmethod(lambda *a, **kw: made.append(1) or real(*a, **kw))
    )
    got = skinny_linear_triton(x, w, False, t._replace(tma=True))
    why = f"seed={seed} M={m} N={n} K={k} tiles={t} {dtype}"
    assert len(made) == int(k * w.element_size() % 16 == 0), why
    assert_close(got, x, w, False, why)
