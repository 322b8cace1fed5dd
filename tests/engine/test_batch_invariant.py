"""Batch-invariant inference on the CPU (tiny V4, fp32 and bf16; tiny V4.1): with the flag on, a request's
logprobs and seeded samples are the same bits alone, in batches of other sizes and compositions,
under other chunk splits, with overlap on or off, eagerly or compiled (aot_eager); with it off
they are not. Each test draws fresh seeds and names them in its failures."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_v4, tiny_v41

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.options import build_options, check_batch_invariant
from deepinfer_fx.graphs import batch_invariant as bi
from deepinfer_fx.graphs.swap import reference
from deepinfer_fx.passes.batch_invariant import FORMS, batch_invariant_swaps
from deepinfer_fx.settings import EngineConfig

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def model(request) -> deepinfer_fx.api.Model:
    return deepinfer_fx.random_model(config_from_dict(tiny_v4()).replace(fake_quant=False), seed=7, dtype=request.param)


def make_llm(model, **kw) -> LLM:
    kw.setdefault("max_model_len", 96)
    kw.setdefault("num_threads", 1)  # the test machine's cores are shared: one thread runs fastest
    kw.setdefault("batch_invariant", True)
    return LLM(model, device="cpu", eager=kw.pop("eager", True), **kw)


def _prompts(rng: random.Random, n: int, longest: int = 40) -> list[list[int]]:
    return [[rng.randrange(3, 300) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def _greedy(rng: random.Random, n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True, logprobs=5) for _ in range(n)]


def _sampled(rng: random.Random, n: int) -> list[SamplingParams]:
    kinds = [{"temperature": 0.9}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.1, "top_k": 30, "min_p": 0.02}]
    return [
        SamplingParams(
            **kinds[i % 3], max_tokens=rng.randint(2, 8), ignore_eos=True, logprobs=3, seq_seed=rng.randrange(2**40)
        )
        for i in range(n)
    ]


def _result(out) -> tuple[list[int], list[dict[int, float]]]:
    o = out.outputs[0]
    return o.token_ids, o.logprobs


def _alone(llm: LLM, prompts, params) -> list[tuple]:
    return [_result(llm.generate([p], sp)[0]) for p, sp in zip(prompts, params)]


# (engine arguments, how the requests are mixed): batch sizes, token budgets (chunk splits) and
# overlap differ; "shuffled" reverses the order, "padded" adds other requests around them
LAYOUTS = [
    ({"max_num_seqs": 16, "max_num_batched_tokens": 64}, "plain"),
    ({"max_num_seqs": 3, "max_num_batched_tokens": 7, "overlap": False}, "shuffled"),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 23}, "padded"),
]


def _together(model, kw: dict, how: str, prompts, params, rng: random.Random) -> list[tuple]:
    llm = make_llm(model, **kw)
    order = list(range(len(prompts)))
    if how == "shuffled":
        order.reverse()
    ps, sps = [prompts[i] for i in order], [params[i] for i in order]
    if how == "padded":  # other requests before and between them
        extra = _prompts(rng, 4)
        ps = extra[:2] + ps[:3] + extra[2:] + ps[3:]
        sps = _greedy(rng, 2) + sps[:3] + _greedy(rng, 2) + sps[3:]
    outs = [_result(o) for o in llm.generate(ps, sps)]
    if how == "padded":
        outs = outs[2:5] + outs[7:]
    got = [None] * len(prompts)
    for i, r in zip(order, outs):
        got[i] = r
    return got


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_same_bits_in_any_batch(model, kind: str) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = _prompts(rng, 8)
    params = (_greedy if kind == "greedy" else _sampled)(rng, 8)
    want = _alone(make_llm(model, max_num_seqs=1), prompts, params)
    for kw, how in LAYOUTS:
        got = _together(model, kw, how, prompts, params, rng)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"seed={seed} {kw} {how}: request {i} (prompt of {len(prompts[i])}) differs from alone"


def test_same_bits_v41_compact_prefill() -> None:
    """V4.1 (shared-cache selections, Engram) with compact prefill keeping 12 rows (the prompts
    run to 40): greedy and seeded rows, alone against two batch layouts (fp32)."""
    model = deepinfer_fx.random_model(config_from_dict(tiny_v41()).replace(fake_quant=False), seed=5)
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = _prompts(rng, 6)
    params = [g if i % 2 else s for i, (g, s) in enumerate(zip(_greedy(rng, 6), _sampled(rng, 6)))]
    want = _alone(make_llm(model, max_num_seqs=1, yoco_keep_tokens=12), prompts, params)
    for kw, how in LAYOUTS[:2]:
        got = _together(model, {**kw, "yoco_keep_tokens": 12}, how, prompts, params, rng)
        assert got == want, f"seed={seed} {kw} {how}"


def test_same_bits_in_large_decode_groups(model) -> None:
    """66 requests decode together: decode groups of >= 64 chunks read the ring in place
    (``attention.RING_MIN_CHUNKS``), a path of its own; a few of them against alone."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = _prompts(rng, 66, longest=6)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2) for _ in prompts]
    got = [_result(o) for o in make_llm(model, max_num_seqs=66, max_num_batched_tokens=512).generate(prompts, params)]
    alone = make_llm(model, max_num_seqs=1)
    for i in rng.sample(range(66), 3):
        assert got[i] == _alone(alone, [prompts[i]], [params[i]])[0], f"seed={seed}: request {i}"


def test_flag_off_differs(model) -> None:
    """Without the flag the same comparison finds differing bits (the flag does the work)."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = _prompts(rng, 8)
    params = _greedy(rng, 8)
    want = _alone(make_llm(model, max_num_seqs=1, batch_invariant=False), prompts, params)
    got = _together(
        model,
        {"max_num_seqs": 16, "max_num_batched_tokens": 64, "batch_invariant": False},
        "plain",
        prompts,
        params,
        rng,
    )
    assert got != want, f"seed={seed}: every request matched alone without the flag"


def test_compiled_equals_eager() -> None:
    """aot_eager steps (padded buckets, the compiled sampler) give the eager steps' bits (fp32)."""
    model = deepinfer_fx.random_model(config_from_dict(tiny_v4()).replace(fake_quant=False), seed=3)
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 14))] for _ in range(2)]
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True, logprobs=3, seq_seed=rng.randrange(2**40)),
    ]
    compiled = make_llm(
        model, eager=False, warmup=False, inductor=False, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48
    )
    got = [_result(o) for o in compiled.generate(prompts, params)]
    want = _alone(make_llm(model, max_num_seqs=1, max_model_len=48), prompts, params)
    assert got == want, f"seed={seed}"


def test_gpu_table_on_the_cpu(monkeypatch, tmp_path) -> None:
    """The nvidia table (its invariant kernels: mHC sites, the compressor, norms and RoPE at
    every size, the indexer's top-k) run on the CPU, where each op's kernel is its reference under
    the forms: the CPU table's bits, eagerly and compiled; a disabled swap leaves its place to the
    form. The compiled steps lift no host tensor constant (on a GPU aot_eager would copy it in at
    every call, which CUDA-graph capture refuses: V4.1's first collapse did, found on an H100)."""
    gpu = batch_invariant_swaps((), "nvidia")
    assert gpu["mhc.mhc_site"] is not reference("mhc.mhc_site") and "norm.rms_norm" in gpu
    assert batch_invariant_swaps((), "cpu")["mhc.mhc_site"] is reference("mhc.mhc_site")
    assert batch_invariant_swaps((), "nvidia", {"mhc_site_kernel"})["mhc.mhc_site"] is reference("mhc.mhc_site")
    model = deepinfer_fx.random_model(config_from_dict(tiny_v41()).replace(fake_quant=False), seed=4)
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompts = _prompts(rng, 3, 20)
    params = _greedy(rng, 2) + _sampled(rng, 1)
    want = [_result(o) for o in make_llm(model, max_num_seqs=4, max_num_batched_tokens=16).generate(prompts, params)]
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    for eager in (True, False):
        dump = None if eager else tmp_path
        llm = make_llm(model, eager=eager, max_num_seqs=4, max_num_batched_tokens=16, dump_graphs=dump)
        assert llm.runner.swaps["norm.rms_norm"] is gpu["norm.rms_norm"]
        assert [_result(o) for o in llm.generate(prompts, params)] == want, f"seed={seed} eager={eager}"
    lifted = [f.name for f in tmp_path.rglob("*.py") if "lift_fresh_copy" in f.read_text()]
    assert not lifted and list(tmp_path.rglob("*.py")), f"host constants in compiled steps: {lifted[:5]}"


def test_switch_from_env_and_argument(monkeypatch) -> None:
    model = deepinfer_fx.random_model(config_from_dict(tiny_v4()).replace(fake_quant=False), seed=1)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    on = LLM(model, device="cpu", max_model_len=32, batch_invariant=None)
    assert on.options.steps.batch_invariant and all(on.runner.swaps[p] is f for p, f in FORMS.items())
    off = LLM(model, device="cpu", max_model_len=32, batch_invariant=False)  # the argument wins
    assert not off.options.steps.batch_invariant and not off.runner.swaps
    with pytest.raises(ValueError, match="batch_invariant=True.*not built.*speculative"):
        LLM(model, device="cpu", max_model_len=32, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not built under Inductor on cpu"):
        LLM(model, device="cpu", max_model_len=32, eager=False, inductor=True)


def test_unbuilt_settings_refuse() -> None:
    on, cpu, cuda = EngineConfig(batch_invariant=True), torch.device("cpu"), torch.device("cuda")
    check_batch_invariant(on, cpu, speculative=False, compiled=True, inductor=False)
    check_batch_invariant(EngineConfig(), cuda, speculative=True, compiled=True, inductor=True)
    check_batch_invariant(on, cuda, speculative=False, compiled=True, inductor=False)  # its Triton kernels
    with pytest.raises(ValueError, match="not built on xpu: its kernels exist for the CPU and CUDA only"):
        check_batch_invariant(on, torch.device("xpu"), speculative=False, compiled=False, inductor=False)
    check_batch_invariant(on, cuda, speculative=False, compiled=True, inductor=True)  # shown on sm_90
    with pytest.raises(ValueError, match="not built under Inductor on cpu: Inductor's C\\+\\+ kernels"):
        check_batch_invariant(on, cpu, speculative=False, compiled=True, inductor=True)
    check_batch_invariant(on, cpu, speculative=False, compiled=False, inductor=True)  # eager steps: no Inductor


def test_cuda_default_is_inductor_with_or_without_the_flag() -> None:
    """Compiled CUDA steps default to Inductor, the flag on or off (its graphs pass
    ``passes/invariant_guard.py``, and ``test_batch_invariant_cuda.py`` shows the bits on sm_90);
    CPU steps default to aot_eager."""
    kw = dict(eager=None, overlap=True, warmup=None, max_num_seqs=4, max_num_batched_tokens=64, cuda_graphs=None)
    kw.update(inductor=None, dump_graphs=None, disable_passes=None)
    cuda = torch.device("cuda")
    assert build_options(EngineConfig(), cuda, **kw).steps.inductor
    opts = build_options(EngineConfig(batch_invariant=True), cuda, **kw).steps
    assert opts.compiled and opts.inductor and opts.batch_invariant
    cpu = build_options(EngineConfig(batch_invariant=True), torch.device("cpu"), **{**kw, "eager": False}).steps
    assert cpu.compiled and not cpu.inductor


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fixed_order_matmul_rows_do_not_depend_on_m(dtype: torch.dtype) -> None:
    """The CPU kernel of ``deepinfer::bi_matmul``: row m's bits alike for every M (MKL's GEMM
    differs between M = 1, 2..15 and >= 16 here)."""
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    x, w = torch.randn(40, 96, generator=g).to(dtype), torch.randn(72, 96, generator=g).to(dtype)
    full = torch.ops.deepinfer.bi_matmul(x, w, True)
    for m in (1, 2, 3, 8, 16, 17):
        assert torch.equal(torch.ops.deepinfer.bi_matmul(x[-m:], w, True), full[-m:]), m
    assert torch.equal(bi.fixed_order_matmul(x, w, False), full.to(dtype))


def test_pointwise_forms_do_not_depend_on_position() -> None:
    """The batch-invariant sigmoid / silu / softplus give an element the same bits wherever it
    sits (torch's own run a tensor's vector tail through scalar code, which rounds differently)."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))) * 8
    for f in (bi.sigmoid, bi.silu, bi.softplus):
        whole = f(x)
        assert torch.equal(torch.cat([f(x[i : i + 1]) for i in range(40)]), whole[:40]), f.__name__
        assert torch.equal(f(x[3:]), whole[3:]), f.__name__
    assert torch.allclose(bi.softplus(x), torch.nn.functional.softplus(x)) and torch.allclose(
        bi.silu(x), torch.nn.functional.silu(x)
    )


# torch ops whose float reduction order follows the number of rows on CUDA (its reductions split a
# row over threads by the row count; its GEMMs choose tiles and split-K by M; its top-k and
# unstable sorts order ties by algorithm): with the flag on, a step must reach none of them, only
# the deepinfer::bi_* ops and stable sorts that stand in for them
BATCH_DEPENDENT = {
    "sum",
    "mean",
    "nansum",
    "cumsum",
    "cumprod",
    "prod",
    "var",
    "std",
    "var_mean",
    "logsumexp",
    "norm",
    "linalg_vector_norm",
    "_softmax",
    "_log_softmax",
    "native_layer_norm",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "matmul",
    "mv",
    "addmv",
    "dot",
    "einsum",
    "topk",
    "kthvalue",
}
UNSTABLE = {"aten.sort.default"}  # an unstable sort orders equal values as its algorithm happens to


@pytest.mark.parametrize("cfg", [tiny_v4, tiny_v41], ids=["v4", "v41"])
def test_steps_reach_no_batch_dependent_torch_reduction(cfg) -> None:
    """What makes the flag hold on CUDA too: every float reduction and matmul a step runs (model,
    sampler, logprobs; V4.1 with Engram and compact prefill) goes through an op with a fixed order
    (``kernels/ops_bi.py``), none through torch's own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                if func.overloadpacket.__name__ in BATCH_DEPENDENT or str(func) in UNSTABLE:
                    found.add(str(func))
            return func(*args, **(kwargs or {}))

    model = deepinfer_fx.random_model(config_from_dict(cfg()).replace(fake_quant=False), seed=2, dtype=torch.bfloat16)
    llm = make_llm(model, max_num_seqs=4, max_num_batched_tokens=16, yoco_keep_tokens=12) if cfg is tiny_v41 else None
    llm = llm or make_llm(model, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [[5, 6, 7, 8, 9] * 6, [3, 4], [9] * 17]
    params = _sampled(random.Random(0), 2) + _greedy(random.Random(1), 1)
    with Record():
        outs = llm.generate(prompts, params)
    assert all(o.outputs[0].token_ids for o in outs)
    assert not found, f"torch reductions reached with batch_invariant=True: {sorted(found)}"
