"""What ``LLM`` refuses, without coercion, each with its message: prompts and token ids of the
wrong kind, options out of range or in a mode where they do nothing, unusable devices, a mesh
started without torchrun; and what it accepts (NumPy and torch integer ids, num_threads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.engine.inputs import eager_setting, is_token_id, prompt_list, resolve_device
from deepinfer_fx.settings import usable_cores

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
IDS = "token ids are ints"


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("tiny")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(), seed=3)
    return LLM(path, dtype="float32", device="cpu", fake_quant=False, max_model_len=64)


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([1.7, 2.2], rf"prompts\[0\] is 1.7 \(float\), not a token id; {IDS}"),
        ([[5, 6], ["5", "6"]], rf"prompts\[1\]\[0\] is '5' \(str\), not a token id; {IDS}"),
        ([[True, 5]], r"prompts\[0\]\[0\] is True \(bool\), not a token id"),
        ([[5, torch.tensor(2.0)]], r"prompts\[0\]\[1\] is a torch.float32 tensor of shape \[\], not a token id"),
        ([[5, np.float32(3)]], r"prompts\[0\]\[1\] is .*float32.*not a token id"),
        ([[5, b"6"]], r"prompts\[0\]\[1\] is b'6' \(bytes\), not a token id"),
        (
            b"hi",
            r"prompts is bytes, which would read as byte values; decode it \(prompts.decode\(\)\) or pass token ids",
        ),
        ([b"hi"], r"prompts\[0\] is bytes, which would read as byte values; decode it \(prompts\[0\].decode\(\)\)"),
        (None, r"generate\(\) needs prompts: a str, a list of token ids \(ints\), a dict .*, or a list of those"),
        ([None], r"prompts\[0\] is None; it must be a str or a list of token ids"),
        (["ok", 7], r"prompts\[1\] is 7 \(int\); it must be a str or a list of token ids"),
        (5, r"prompts is 5 \(int\); it must be a str, a list of token ids \(ints\), a dict .*, or a list of those"),
        (torch.tensor([5, 6]), r"prompts is a Tensor; pass a list of ints \(prompts.tolist\(\)\)"),
        ([[5, 6], np.array([5, 6])], r"prompts\[1\] is a ndarray; pass a list of ints \(prompts\[1\].tolist\(\)\)"),
        ([[5, 6], []], r"prompts\[1\] is empty; a prompt needs at least one token"),
        (
            [[5, 6], [5, 300]],
            r"prompts\[1\]: token ids must lie in \[0, 300\) \(the model's vocabulary\); prompts\[1\]\[1\] is 300",
        ),
        ([[-1]], r"prompts\[0\]: token ids must lie in \[0, 300\).*prompts\[0\]\[0\] is -1"),
    ],
    ids=lambda v: repr(v)[:24],
)
def test_bad_prompts_are_refused_with_the_prompt_named(llm, prompts, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)
    assert not llm.has_unfinished_requests()  # validated before anything was queued


def test_add_request_names_its_prompt(llm) -> None:
    with pytest.raises(ValueError, match=r"prompt is None; it must be a str or a list of token ids"):
        llm.add_request(None)
    with pytest.raises(ValueError, match=r"prompt\[0\] is 1.5 \(float\), not a token id"):
        llm.add_request([1.5])
    with pytest.raises(ValueError, match=r"sampling_params\[1\] is dict; pass SamplingParams"):
        llm.generate([[5], [6]], [GREEDY, {"temperature": 0}])


def test_integer_ids_of_numpy_and_torch_are_token_ids(llm) -> None:
    want = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    for ids in (
        [np.int64(5), np.int32(6), 7],
        [torch.tensor(5), torch.tensor(6, dtype=torch.int32), np.uint8(7)],
        (5, 6, 7),
    ):
        got = llm.generate([ids], GREEDY)[0]
        assert got.prompt_token_ids == [5, 6, 7] and got.outputs[0].token_ids == want
    assert [type(t) for t in llm.generate([np.int64(5), np.int64(6)], GREEDY)[0].prompt_token_ids] == [int, int]
    assert (
        not is_token_id(np.bool_(True)) and not is_token_id(torch.tensor(True)) and not is_token_id(torch.tensor([1]))
    )
    assert prompt_list([]) == ([], [])  # no prompts, no outputs (vLLM alike)


def test_stop_token_ids_outside_the_vocabulary(llm) -> None:
    with pytest.raises(
        ValueError,
        match=r"SamplingParams.stop_token_ids \[300, 5000\] lie outside the model's vocabulary \[0, 300\); .*drop them",
    ):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[7, 300, 5000]))
    llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=1, stop_token_ids=[299]))  # the last id is in


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_model_len": 0}, r"max_model_len must be an int >= 1 or None, got 0"),
        ({"max_model_len": -4}, r"max_model_len must be an int >= 1 or None, got -4"),
        ({"max_model_len": 64.0}, r"max_model_len must be an int >= 1 or None, got 64.0"),
        ({"max_num_seqs": 0}, r"max_num_seqs must be an int >= 1, got 0"),
        ({"max_num_batched_tokens": True}, r"max_num_batched_tokens must be an int >= 1, got True"),
        ({"memory_budget": 0}, r"memory_budget must be an int >= 1 or None, got 0"),
        ({"num_threads": 0}, r"num_threads must be an int >= 1 or None, got 0"),
        ({"num_threads": "4"}, r"num_threads must be an int >= 1 or None, got '4'"),
        ({"seed": -1}, r"seed must be an int >= 0, got -1"),
        ({"overlap": "yes"}, r"overlap must be True or False, got 'yes'"),
        ({"eager": 1}, r"eager must be True or False or None, got 1"),
        (
            {"eager": True, "dump_graphs": "d"},
            r"dump_graphs act on compiled steps, which eager=True \(--eager\) turns off; drop one or the other",
        ),
        ({"eager": True, "disable_passes": "rope_kernel"}, r"disable_passes act on compiled steps, which eager=True"),
        ({"eager": True, "cuda_graphs": False, "inductor": False}, r"cuda_graphs, inductor act on compiled steps"),
        ({"device": "garbage"}, r"device 'garbage' is not a device; use 'cpu', 'cuda', 'cuda:N' or 'npu'"),
        ({"device": 3}, r"device must be a str or torch.device, got 3 \(int\)"),
        ({"device": "meta"}, r"device 'meta': the engine runs on 'cpu', 'cuda'"),
        (
            {"mesh": "ep3"},
            r"mesh ep3 has 3 ranks but this process was not started by torchrun; launch it under torchrun --nproc-per-node 3",
        ),
        ({"mesh": "dp2,ep2"}, r"launch it under torchrun --nproc-per-node 4"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_options_are_refused(llm, kwargs, message) -> None:
    kwargs = {"dtype": "float32", "device": "cpu", "fake_quant": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        LLM(llm.model.path, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message needs a machine without CUDA")
def test_cuda_on_a_machine_without_cuda(llm) -> None:
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        with pytest.raises(
            ValueError,
            match=r"this machine has no usable CUDA device \(torch.cuda.is_available\(\) is False\); use 'cpu'",
        ):
            resolve_device(device)
    with pytest.raises(ValueError, match="no usable CUDA device"):
        LLM(llm.model.path, device="cuda")


def test_compiled_step_options_ask_for_compiled_steps() -> None:
    assert eager_setting(None, dump_graphs="d", disable_passes=None) is False
    assert eager_setting(None, disable_passes="rope_kernel") is False
    assert eager_setting(None, cuda_graphs=None, inductor=None, dump_graphs=None, disable_passes="") is None
    assert eager_setting(True, disable_passes=[]) is True
    with pytest.raises(ValueError, match="disable_passes act on compiled steps, which eager=True"):
        eager_setting(True, disable_passes="rope_kernel")


def test_disable_passes_on_the_cpu_compiles_the_steps(llm) -> None:
    torch._dynamo.reset()
    compiled = LLM(
        llm.model.path,
        dtype="float32",
        device="cpu",
        fake_quant=False,
        max_model_len=64,
        max_num_seqs=2,
        disable_passes="rope_kernel",
        warmup=False,
    )
    assert compiled.options.steps.compiled and "rope_kernel" in compiled.runner.steps.disabled
    assert not llm.options.steps.compiled  # the default CPU run stays eager


def test_the_settings_passes_and_engram_placement_reach_the_steps(llm, monkeypatch, tmp_path) -> None:
    """DEEPINFER_DISABLE_PASSES joins disable_passes= when the engine reads its settings, and the
    steps' backends hold both names without reading the environment again; an unknown name is
    refused before the model loads (the path below holds no checkpoint)."""
    torch._dynamo.reset()
    monkeypatch.setenv("DEEPINFER_DISABLE_PASSES", "rope_kernel")
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "host")
    monkeypatch.setenv("DEEPINFER_ENGRAM_DEVICE_GIB", "2.5")
    compiled = LLM(llm.model.path, dtype="float32", device="cpu", fake_quant=False, max_model_len=64,
                   max_num_seqs=2, disable_passes=["norm_rope_kernel"], warmup=False)  # fmt: skip
    steps = compiled.runner.steps
    assert steps.disabled == ("norm_rope_kernel", "rope_kernel")
    assert compiled.options.steps.engram_tables == "host" and compiled.options.steps.engram_device_gib == 2.5
    monkeypatch.delenv("DEEPINFER_DISABLE_PASSES")
    pipeline = steps.functions.backend("decode-b1").pipeline
    assert pipeline.disabled == {"norm_rope_kernel", "rope_kernel"}
    assert not {"norm_rope_kernel", "rope_kernel"} & set(pipeline.names) and "rms_norm_fusion" in pipeline.names
    monkeypatch.setenv("DEEPINFER_DISABLE_PASSES", "rope_kernel, no_such_pass")
    with pytest.raises(ValueError, match=r"unknown graph pass name\(s\) \['no_such_pass'\].*DEEPINFER_DISABLE_PASSES"):
        LLM(tmp_path / "nothing-here", device="cpu", eager=False)


def test_num_threads(llm, monkeypatch) -> None:
    before = torch.get_num_threads()
    make = lambda **kw: LLM(llm.model.path, dtype="float32", device="cpu", fake_quant=False, max_model_len=64, **kw)  # noqa: E731
    try:
        make(num_threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it for each rank: left in force
        make()
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        make()
        assert torch.get_num_threads() == usable_cores()
    finally:
        torch.set_num_threads(before)
