"""Structured output in the compiled steps (CPU, aot_eager, the tiny checkpoint of
structured_helpers): the masked steps enforce the grammar, and with CUDA graphs stood in for on
the CPU, a masked step's sampler graph reads its model part's captured logits."""

from __future__ import annotations

import random
import re

import pytest
import torch
from structured_helpers import REGEXES, TOKENIZER_VOCAB, check_outputs, make_llm, write_checkpoint

from deepinfer_fx import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-so"))


def test_compiled_steps_enforce_the_grammar(ckpt) -> None:
    """One request (one decode bucket, one prefill bucket: the fewest compiles)."""
    llm = make_llm(ckpt, eager=False, warmup=False, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=48)
    for seed in (3, 4):
        params = SamplingParams(temperature=0.9, max_tokens=16, seq_seed=seed, so_args={"regex": REGEXES[0]})
        c = llm.generate([[7, 8, 9]], params)[0].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(REGEXES[0], c.text), c
    assert {r["graph"].rsplit("-", 2)[-2:] == ["plain", "masked"] for r in llm.runner.steps.report()} == {True}


class _CpuGraph:
    """A stand-in for a CUDA graph on the CPU: capture runs the function once to get its outputs
    and then puts back every tensor it wrote (a real capture runs nothing); replay runs it again
    and copies the results into the captured outputs, as a replay writes the static buffers."""

    def __init__(self, written: list[torch.Tensor]) -> None:
        self.written = written

    def capture(self, fn):
        saved = [t.clone() for t in self.written]
        self.fn, self.out = fn, fn()
        for t, s in zip(self.written, saved):
            t.copy_(s)
        return self.out

    def replay(self) -> None:
        _copy_into(self.out, self.fn())


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [t for x in items for t in _tensors(x)]


def test_captured_pieces_replay_the_tokens_of_uncaptured_steps(ckpt, monkeypatch) -> None:
    """Compiled steps (aot_eager) with graphs stood in for by ``_CpuGraph``: a masked step's
    sampler graph reads its model part's captured logits (a sampler captured over the first
    call's logits would replay stale ones), so replays with overlap give the tokens of the same
    compiled steps run without graphs and without overlap, constrained and free requests alike."""
    from types import SimpleNamespace

    from deepinfer_fx.engine import graph_capture

    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    llm = make_llm(ckpt, eager=False, warmup=False, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48)
    params = [
        SamplingParams(temperature=0.9, max_tokens=16, seq_seed=rng.randrange(2**40), so_args={"regex": REGEXES[1]}),
        SamplingParams(temperature=0.8, max_tokens=12, seq_seed=rng.randrange(2**40), ignore_eos=True),
    ]
    prompts = [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.randint(3, 9))] for _ in params]
    llm._loop().overlap = False
    ref = llm.generate(prompts, params)
    steps = llm.runner.steps
    written = _tensors(steps.state) + [steps.next_token]
    monkeypatch.setattr(graph_capture, "DeviceGraph", lambda device_type, pool: _CpuGraph(written))
    monkeypatch.setattr(graph_capture, "graph_api", lambda device_type: SimpleNamespace(graph_pool_handle=object))
    steps.graphs = True
    steps._entries.clear()  # the compiled pieces stay; their entries capture on their next first call
    llm._loop().overlap = True
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref], f"seed={seed}"
    check_outputs(llm, got, ["regex1", None], params, f"seed={seed}")
    report = steps.report()
    decode = [r for r in report if r["graph"].startswith("decode")]
    # every decode graph captured, and replayed (a bucket the seed's batch reached once is not)
    assert decode and all(r["captured"] for r in decode) and any(r["calls"] >= 2 for r in decode), report
    assert {r["pieces"] for r in report if r["graph"].endswith("-masked")} == {2}, report
