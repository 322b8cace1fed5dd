"""The two-launch Triton mHC site against ``graphs/mhc.py::mhc_site``: fresh random inputs every
run (the seed is in the failure message), with and without ``pre_in``, token counts from 0 to
several launch-1 blocks, widths whose row splits and channel blocks end part-filled, the tiny
configs' width, strided rows (read in place) and layouts the launcher copies, a stream count
the kernel leaves to the reference, and outputs poisoned with NaN so that an element the
kernel forgets to write fails. A token's outputs are the same bit for bit alone or in a batch.
On CUDA, also the model's sizes (bf16 streams), the op's dispatch to two launches, opcheck
and a CUDA-graph replay. The offline sm_90 compile checks are in ``test_triton_mhc_sm90.py``.

The final learned collapse ``hc_head`` runs through the same two kernels (``mhc_head_triton``:
``N`` rows of ``fn``, the finish kernel's ``HEAD`` variant) and is tested the same way against
``graphs/mhc.py::hc_head``: fp32 and bf16 streams, 0 to 70 tokens, part-filled chunks and
blocks, batch invariance, the reference for stream counts the kernel does not tile, refused
shapes; on CUDA the model's sizes, two launches, opcheck and a graph replay."""

from __future__ import annotations

import pytest
import torch
import triton

from deepinfer_fx.graphs.mhc import hc_head, mhc_site
from deepinfer_fx.kernels.triton import mhc as mhc_kernels
from deepinfer_fx.kernels.triton.mhc import launch_config, mhc_head_triton, mhc_site_triton

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="model-sized inputs need a GPU")
RMS_EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20


def _seed() -> int:
    return torch.seed() % 2**31


def _inputs(seed: int, lead: tuple[int, ...], n: int, d: int, dtype: torch.dtype, device: str, with_pre: bool) -> tuple:
    """Site arguments with the model's value ranges: mixes of unit scale, comb logits up to ~4."""
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    X = (torch.randn(*lead, n, d, generator=g) * 2).to(device=device, dtype=dtype)
    fn = (torch.randn(m, n * d, generator=g) * (n * d) ** -0.5).to(device)
    base = torch.randn(m, generator=g).to(device)
    scale = (0.5 + 1.5 * torch.rand(3, generator=g)).to(device)
    pre_in = torch.rand(*lead, n, generator=g).to(device) if with_pre else None
    return X, fn, base, scale, RMS_EPS, HC_EPS, ITERS, pre_in


def _head_inputs(seed: int, lead: tuple[int, ...], n: int, d: int, dtype: torch.dtype, device: str) -> tuple:
    """hc_head arguments: fn ``[N, N*D]`` (mixes of unit scale), base ``[N]``, scale ``[1]``."""
    g = torch.Generator().manual_seed(seed)
    X = (torch.randn(*lead, n, d, generator=g) * 2).to(device=device, dtype=dtype)
    fn = (torch.randn(n, n * d, generator=g) * (n * d) ** -0.5).to(device)
    base = torch.randn(n, generator=g).to(device)
    scale = (0.5 + 1.5 * torch.rand(1, generator=g)).to(device)
    return X, fn, base, scale, RMS_EPS, HC_EPS


def _poisoned(X: torch.Tensor) -> tuple[torch.Tensor, ...]:
    *lead, n, d = X.shape
    f32 = {"dtype": torch.float32, "device": X.device}
    return (
        torch.full((*lead, n), float("nan"), **f32),
        torch.full((*lead, n), float("nan"), **f32),
        torch.full((*lead, n, n), float("nan"), **f32),
        torch.full((*lead, d), float("nan"), dtype=X.dtype, device=X.device),
    )


def _assert_matches(got: tuple, want: tuple, X: torch.Tensor, why: str, own_pre: bool = True) -> None:
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{why}: {name}\n{m}")
    dpre = (got[0] - want[0]).abs().amax(-1)[..., None] if own_pre else 0.0
    _assert_collapse_matches(got[3], want[3], X, why, dpre)


def _assert_collapse_matches(
    u: torch.Tensor, ref: torch.Tensor, X: torch.Tensor, why: str, dpre: torch.Tensor | float
) -> None:
    """The collapse ``u`` against the reference's, ``dpre`` the difference of the ``pre`` it used."""
    assert u.dtype == ref.dtype == X.dtype, why
    if ref.dtype == torch.bfloat16:
        # One bf16 ulp: the fp32 sums agree to ~1e-7 but a rounding may not; where the weighted
        # streams cancel, that fp32 difference is relative to the inputs, not to the small result,
        # and a collapse with the site's own pre carries pre's difference times the streams.
        _, exp = torch.frexp(ref.float())
        ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exp - 8)
        cancel = X.float().abs().sum(-2) * (dpre + 2.0**-20)
        bad = ~((u.float() - ref.float()).abs() <= ulp + cancel)
        assert not bad.any(), f"{why}: {int(bad.sum())} elements of u off by more than one bf16 ulp"
    else:
        torch.testing.assert_close(u, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{why}: u\n{m}")


def _layout(X: torch.Tensor, layout: str) -> torch.Tensor:
    n = X.shape[-2]
    if layout == "slice":  # tokens further apart than N*D: read in place with their stride
        return torch.cat([X, torch.zeros_like(X[..., :1, :])], -2)[..., :n, :]
    if layout == "transpose":  # channels not contiguous: the launcher copies
        return X.transpose(-1, -2).contiguous().transpose(-1, -2)
    return X


def _run(
    lead: tuple[int, ...],
    n: int,
    d: int,
    with_pre: bool,
    device: str,
    dtype: torch.dtype = torch.float32,
    layout: str = "contiguous",
) -> None:
    seed = _seed()
    args = _inputs(seed, lead, n, d, dtype, device, with_pre)
    X = _layout(args[0], layout)
    args = (X, *args[1:])
    why = f"seed={seed} lead={lead} n={n} d={d} pre_in={with_pre} dtype={dtype} layout={layout}"
    out = _poisoned(X)
    got = mhc_site_triton(*args, out=out)
    assert all(a is b for a, b in zip(got, out)), why
    _assert_matches(got, mhc_site.reference(*args), X, why, not with_pre)  # type: ignore[attr-defined]
    fresh = mhc_site_triton(*args)
    assert all(f.is_contiguous() and torch.equal(f, o) for f, o in zip(fresh, out)), why


# The head's own pre is not returned: its difference is bounded by the site tests' tolerance on
# pre (atol 1e-6 + rtol 1e-5 at pre <= 1 + hc_eps).
_HEAD_DPRE = 1.1e-5


def _run_head(
    lead: tuple[int, ...], n: int, d: int, device: str, dtype: torch.dtype = torch.float32, layout: str = "contiguous"
) -> None:
    seed = _seed()
    X, *rest = _head_inputs(seed, lead, n, d, dtype, device)
    args = (_layout(X, layout), *rest)
    why = f"seed={seed} head lead={lead} n={n} d={d} dtype={dtype} layout={layout}"
    out = torch.full((*lead, d), float("nan"), dtype=dtype, device=device)
    got = mhc_head_triton(*args, out=out)
    want = hc_head.reference(*args)  # type: ignore[attr-defined]
    assert got is out, why
    if n & (n - 1) or n > 16:  # the launcher's fallback is the reference itself
        assert torch.equal(got, want), why
    else:
        _assert_collapse_matches(got, want, args[0], why, _HEAD_DPRE)
    fresh = mhc_head_triton(*args)
    assert fresh.is_contiguous() and torch.equal(fresh, out), why


# d = 64: the tiny configs' hidden width (4 row chunks of 64); d = 100: the last row chunk and
# the channel block part-filled; d = 1100: two channel blocks of launch 2.
@pytest.mark.parametrize("with_pre", [False, True], ids=["own-pre", "pre-in"])
@pytest.mark.parametrize("d", [64, 100])
@pytest.mark.parametrize("tokens", [0, 1, 5, 70])
def test_site_matches_reference(tokens: int, d: int, with_pre: bool, device: str) -> None:
    _run((tokens,), 4, d, with_pre, device)


@pytest.mark.parametrize("tokens", [1, 70])
def test_bf16_streams_split_fn_exactly(tokens: int, device: str) -> None:
    """bf16 streams take the three-way bf16 split of ``fn`` (tensor-core dots on a GPU; the same
    exact products as FMAs under the interpreter): still fp32-accurate coefficients."""
    assert launch_config(4, 100, bf16=True)["dots"]["SPLIT_BF16"]
    _run((tokens,), 4, 100, True, device, torch.bfloat16)


@pytest.mark.parametrize("with_pre", [False, True], ids=["own-pre", "pre-in"])
def test_two_channel_blocks(with_pre: bool, device: str) -> None:
    assert triton.cdiv(1100, launch_config(4, 1100)["finish"]["BLOCK_D"]) == 2
    _run((5,), 4, 1100, with_pre, device)


@pytest.mark.parametrize("lead,n", [((2, 3), 4), ((6,), 2), ((4,), 3)], ids=["chunks", "n2", "n3-reference"])
def test_other_shapes(lead: tuple[int, ...], n: int, device: str) -> None:
    _run(lead, n, 40, True, device)


@pytest.mark.parametrize("layout", ["slice", "transpose"])
def test_strided_streams(layout: str, device: str) -> None:
    _run((9,), 4, 48, False, device, layout=layout)
    _run_head((9,), 4, 48, device, layout=layout)


def test_shapes_that_do_not_fit_are_refused(device: str) -> None:
    X, fn, *rest = _inputs(_seed(), (3,), 4, 32, torch.float32, device, False)
    with pytest.raises(ValueError, match="do not fit"):
        mhc_site_triton(X, fn[:, :64], *rest)


def test_splits_depend_on_the_width_only() -> None:
    """The model's width (N = 4, D = 4096): 64 row chunks of 256, four channel blocks; the test
    widths above split into several chunks, the last part-filled at d = 100. The released wider
    models (V4.1-Flash 5120, V4-Pro 7168), whose 64th of a row is no power of two of 64-element
    tiles, keep P8's chunk of 256 (the one-tile schedule's ``tl.arange`` needs a power of two)
    in more splits."""
    cfg = launch_config(4, 4096)
    assert cfg["finish"]["KSPLIT"] == 64 and cfg["dots"]["CHUNK"] == 256 and 4096 // cfg["finish"]["BLOCK_D"] == 4
    for d in (64, 100):
        c = launch_config(4, d)
        assert c["finish"]["KSPLIT"] > 1 and (4 * d) % c["dots"]["CHUNK"] == (16 if d == 100 else 0)
    for d, splits in ((5120, 80), (7168, 112)):
        for bf16 in (False, True):
            c = launch_config(4, d, bf16)
            assert c["dots"]["CHUNK"] == 256 and c["finish"]["KSPLIT"] == splits, (d, bf16, c)


# The released widths above P8's (V4.1-Flash, V4-Pro) with bf16 streams, the model's, at decode
# token counts: more splits than P8's 64 (launch 2 sums 80 or 112 partials), 5 or 7 channel
# blocks. One call a case (the interpreter takes ~10 s for one at these widths).
@pytest.mark.parametrize("d", [5120, 7168])
def test_released_wide_widths(d: int, device: str) -> None:
    seed = _seed()
    args = _inputs(seed, (3,), 4, d, torch.bfloat16, device, True)
    why = f"seed={seed} d={d}"
    out = _poisoned(args[0])
    _assert_matches(mhc_site_triton(*args, out=out), mhc_site.reference(*args), args[0], why, False)  # type: ignore[attr-defined]
    X, *rest = _head_inputs(seed, (2,), 4, d, torch.bfloat16, device)
    want = hc_head.reference(X, *rest)  # type: ignore[attr-defined]
    _assert_collapse_matches(mhc_head_triton(X, *rest), want, X, f"{why} head", _HEAD_DPRE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 100])
@pytest.mark.parametrize("tokens", [0, 1, 5, 70])
def test_head_matches_reference(tokens: int, d: int, dtype: torch.dtype, device: str) -> None:
    """hc_head through the two kernels: one and several launch-1 blocks, none at T = 0; at
    d = 100 the last row chunk and the channel block part-filled."""
    _run_head((tokens,), 4, d, device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_two_channel_blocks(dtype: torch.dtype, device: str) -> None:
    _run_head((5,), 4, 1100, device, dtype)


@pytest.mark.parametrize(
    "lead,n", [((2, 3), 4), ((6,), 2), ((4,), 3), ((3,), 32)], ids=["chunks", "n2", "n3-reference", "n32-reference"]
)
def test_head_other_shapes(lead: tuple[int, ...], n: int, device: str) -> None:
    """Leading dims of chunks, two streams, and stream counts the kernel leaves to the
    reference (not a power of two; more than 16), which are then its result bit for bit."""
    _run_head(lead, n, 40, device)


@pytest.mark.parametrize("what", ["fn", "base", "scale"])
def test_head_shapes_that_do_not_fit_are_refused(what: str, device: str) -> None:
    """A site's parameters (2N + N^2 rows of fn, 3 scales) are not the head's."""
    X, fn, base, scale, *eps = _head_inputs(_seed(), (3,), 4, 32, torch.float32, device)
    site = _inputs(_seed(), (3,), 4, 32, torch.float32, device, False)
    args = {"fn": fn, "base": base, "scale": scale}
    args[what] = site[("fn", "base", "scale").index(what) + 1]
    with pytest.raises(ValueError, match=r"mhc_head: fn \(.*\), base \(.*\), scale \(.*\) do not fit X \(3, 4, 32\)"):
        mhc_head_triton(X, args["fn"], args["base"], args["scale"], *eps)


def test_head_tiling_is_the_sites_but_for_its_rows() -> None:
    """The head's launch 1 pads its N rows of fn to 16, a site's 2N + N^2 = 24 to 32; the rest
    of both launches' tiling is the site's, from N, D and the dtype only."""
    for bf16 in (False, True):
        for d in (100, 4096):
            site, head = launch_config(4, d, bf16), launch_config(4, d, bf16, head=True)
            assert site["dots"]["MP"] == 32 and head["dots"]["MP"] == 16
            assert head["finish"] == site["finish"] and dict(head["dots"], MP=32) == site["dots"]
    assert launch_config(8, 64, head=True)["dots"]["MP"] == 16 and launch_config(16, 64, head=True)["dots"]["MP"] == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_token_does_not_depend_on_the_batch(dtype: torch.dtype, device: str, monkeypatch) -> None:
    """Rows of a 150-token batch (several launch-1 blocks, the last part-filled) == each row alone,
    the batch loading the streams last and a row alone first (``LOADS_FIRST``). Launch 1's
    schedules (``UNROLL``) differ here too, but only on a GPU: under the interpreter both loop."""
    monkeypatch.setattr(mhc_kernels, "_LOADS_FIRST_TOKENS", 100)
    monkeypatch.setattr(mhc_kernels, "_UNROLL_TOKENS", 100)
    seed = _seed()
    X, *rest = _head_inputs(seed, (150,), 4, 100, dtype, device)
    batch = mhc_head_triton(X, *rest)
    for t in (0, 70, 149):
        assert torch.equal(mhc_head_triton(X[t : t + 1].clone(), *rest)[0], batch[t]), f"seed={seed} token {t}"


@pytest.mark.parametrize("with_pre", [False, True], ids=["own-pre", "pre-in"])
def test_token_does_not_depend_on_the_batch(with_pre: bool, device: str, monkeypatch) -> None:
    """Rows of a 150-token batch (several launch-1 blocks, the last part-filled) == each row alone,
    the batch loading the streams last and a row alone first (``LOADS_FIRST``). Launch 1's
    schedules (``UNROLL``) differ here too, but only on a GPU: under the interpreter both loop."""
    monkeypatch.setattr(mhc_kernels, "_LOADS_FIRST_TOKENS", 100)
    monkeypatch.setattr(mhc_kernels, "_UNROLL_TOKENS", 100)
    seed = _seed()
    X, fn, base, scale, rms_eps, hc_eps, iters, pre_in = _inputs(seed, (150,), 4, 100, torch.float32, device, with_pre)
    batch = mhc_site_triton(X, fn, base, scale, rms_eps, hc_eps, iters, pre_in)
    for t in (0, 70, 149):
        alone = mhc_site_triton(
            X[t : t + 1].clone(),
            fn,
            base,
            scale,
            rms_eps,
            hc_eps,
            iters,
            None if pre_in is None else pre_in[t : t + 1].clone(),
        )
        for name, a, b in zip(("pre", "post", "comb", "u"), alone, batch):
            assert torch.equal(a[0], b[t]), f"seed={seed} token {t}: {name}"


# --- CUDA only ------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("d", [4096, 5120, 7168], ids=["v4-flash", "v41-flash", "v4-pro"])
@pytest.mark.parametrize("with_pre", [False, True], ids=["own-pre", "pre-in"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_model_sizes(tokens: int, with_pre: bool, d: int) -> None:
    _run((tokens,), 4, d, with_pre, "cuda", torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_head_model_sizes(tokens: int) -> None:
    _run_head((tokens,), 4, 4096, "cuda", torch.bfloat16)


def _two_launches(name: str, args: tuple, seed: int) -> object:
    """Run ``deepinfer::<name>`` on CUDA under the profiler (compiled beforehand): its result,
    after checking that the call was the dots launch then the finish launch, nothing else."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"deepinfer::{name}", "CUDA")
    op = getattr(torch.ops.deepinfer, name)
    op(*args)  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = op(*args)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(launches) == 2, f"seed={seed}: {launches}"
    assert "_mhc_dots_kernel" in launches[0] and "_mhc_finish_kernel" in launches[1], f"seed={seed}: {launches}"
    return got


@needs_cuda
@pytest.mark.parametrize("d", [4096, 5120, 7168], ids=["v4-flash", "v41-flash", "v4-pro"])
def test_model_size_batch_invariance(d: int) -> None:
    """Rows of a 300-token batch (launch 1 looping over tiles, launch 2 loading the streams last)
    == each row alone (the chunk as one tile, the streams loaded first), bit for bit; and each
    schedule of launch 1 forced on a batch of either size gives the same bits; at every
    released width (64, 80 and 112 chunks)."""
    seed = _seed()
    X, fn, base, scale, rms_eps, hc_eps, iters, _ = _inputs(seed, (300,), 4, d, torch.bfloat16, "cuda", False)
    assert 300 > max(mhc_kernels._UNROLL_TOKENS, mhc_kernels._LOADS_FIRST_TOKENS)
    batch = mhc_site_triton(X, fn, base, scale, rms_eps, hc_eps, iters, None)
    head = mhc_head_triton(X, fn[:4], base[:4], scale[:1], rms_eps, hc_eps)
    for t in (0, 33, 63, 299):
        alone = mhc_site_triton(X[t : t + 1].clone(), fn, base, scale, rms_eps, hc_eps, iters, None)
        assert all(torch.equal(a[0], b[t]) for a, b in zip(alone, batch)), f"seed={seed} token {t}"
        alone_head = mhc_head_triton(X[t : t + 1].clone(), fn[:4], base[:4], scale[:1], rms_eps, hc_eps)
        assert torch.equal(alone_head[0], head[t]), f"seed={seed} head token {t}"
    for tokens in (1, 64, 300):
        site = (X[:tokens], fn, base, scale, rms_eps, hc_eps, iters, None)
        looped, unrolled = (mhc_site_triton(*site, dots={"UNROLL": u}) for u in (False, True))
        assert all(torch.equal(a, b) for a, b in zip(looped, unrolled)), f"seed={seed} tokens {tokens}"


@needs_cuda
def test_op_dispatches_to_two_launches() -> None:
    seed = _seed()
    args = _inputs(seed, (64,), 4, 4096, torch.bfloat16, "cuda", True)
    got = _two_launches("mhc_site", args, seed)
    _assert_matches(got, mhc_site.reference(*args), args[0], f"seed={seed}", False)  # type: ignore[attr-defined]
    small = _inputs(seed, (5,), 4, 4096, torch.bfloat16, "cuda", True)
    torch.library.opcheck(torch.ops.deepinfer.mhc_site.default, small)
    torch.library.opcheck(torch.ops.deepinfer.mhc_site.default, (*small[:-1], None))


@needs_cuda
def test_head_op_dispatches_to_two_launches() -> None:
    seed = _seed()
    args = _head_inputs(seed, (1,), 4, 4096, torch.bfloat16, "cuda")
    got = _two_launches("mhc_head", args, seed)
    _assert_collapse_matches(got, hc_head.reference(*args), args[0], f"seed={seed}", _HEAD_DPRE)  # type: ignore[attr-defined]
    torch.library.opcheck(
        torch.ops.deepinfer.mhc_head.default, _head_inputs(seed, (5,), 4, 4096, torch.bfloat16, "cuda")
    )


@needs_cuda
def test_cuda_graph_replay() -> None:
    """Captured once, replayed on new streams and pre_in written into the same buffers."""
    seed = _seed()
    args = _inputs(seed, (64,), 4, 4096, torch.bfloat16, "cuda", True)
    mhc_site_triton(*args)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = mhc_site_triton(*args)
    for step in range(2):
        new = _inputs(seed + 1 + step, (64,), 4, 4096, torch.bfloat16, "cuda", True)
        args[0].copy_(new[0])
        args[-1].copy_(new[-1])
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(got, mhc_site.reference(*args), args[0], f"seed={seed} replay {step}", False)  # type: ignore[attr-defined]


@needs_cuda
def test_head_cuda_graph_replay() -> None:
    """The head captured once at decode batch 1, replayed on new streams written into X."""
    seed = _seed()
    args = _head_inputs(seed, (1,), 4, 4096, torch.bfloat16, "cuda")
    mhc_head_triton(*args)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = mhc_head_triton(*args)
    for step in range(2):
        args[0].copy_(_head_inputs(seed + 1 + step, (1,), 4, 4096, torch.bfloat16, "cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        _assert_collapse_matches(got, hc_head.reference(*args), args[0], f"seed={seed} replay {step}", _HEAD_DPRE)  # type: ignore[attr-defined]
