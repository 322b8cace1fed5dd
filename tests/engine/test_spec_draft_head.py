"""``speculative_config["draft_head"] = "fp8"`` (fp32, CPU): the drafters (MTP-1, DSpark) read a
block-FP8 copy of the output head for draft steps of up to ``DRAFT_HEAD_FP8_ROWS`` rows and the
stored head past that; the target never reads the copy, so outputs stay plain decoding's."""

from __future__ import annotations

import random
from typing import Callable

import pytest
import torch
from test_dspark import _model, _prefill
from test_spec_drafters import _params, _prompts, make_llm, spec

import deepinfer_fx
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.spec_config import DRAFT_HEAD_BLOCK, draft_head_params
from deepinfer_fx.graphs.dspark import dspark_propose
from deepinfer_fx.graphs.model import DRAFT_HEAD_FP8_ROWS, forward, output_head
from deepinfer_fx.graphs.mtp import mtp_forward
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.io.quant import dequant_fp8_block
from deepinfer_fx.kernels.ops_linear import FP8_MAX_ROWS
from tiny import tiny_v4


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _as_head(params: dict) -> dict:
    """``params`` whose stored head is the copy's dequantised values (and no copy)."""
    out = {k: v for k, v in params.items() if not k.startswith("draft_head")}
    out["head"] = dequant_fp8_block(params["draft_head"], params["draft_head_scale"], DRAFT_HEAD_BLOCK)
    return out


def _reads_the_copy(draft_logits: Callable[[dict], torch.Tensor], params: dict, seed: int) -> None:
    """A drafter given the copy drafts as with a head of the copy's values, not the stored head's."""
    withcopy = {**params, **draft_head_params(params["head"])}
    got = draft_logits(withcopy)
    assert torch.equal(got, draft_logits(_as_head(withcopy))), f"seed={seed}"
    assert not torch.equal(got, draft_logits(params)), f"seed={seed}: the copy was not read"


def test_the_copy_and_the_row_bound() -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(300, 256, generator=gen) * 0.05
    copy = draft_head_params(head)
    assert copy["draft_head"].dtype == torch.float8_e4m3fn and copy["draft_head"].shape == head.shape
    assert copy["draft_head_scale"].dtype == torch.float32 and copy["draft_head_scale"].shape == (3, 2)
    chunked = draft_head_params(head, rows=130)  # 128-row parts: the same bits as one pass
    assert torch.equal(chunked["draft_head"].view(torch.uint8), copy["draft_head"].view(torch.uint8))
    assert torch.equal(chunked["draft_head_scale"], copy["draft_head_scale"])
    deq = _as_head({"head": head, **copy})["head"]
    assert (deq - head).abs().max() <= head.abs().max() / 8, f"seed={seed}: the copy is not the head in fp8"
    assert DRAFT_HEAD_FP8_ROWS == FP8_MAX_ROWS  # the copy serves exactly the skinny FP8 kernel's rows
    params = {"head": head, **copy}
    for rows, draft, want in ((1, True, deq), (64, True, deq), (65, True, head), (8, False, head)):
        u = torch.randn(rows, 256, generator=gen)
        got = output_head(params, u, draft)
        assert torch.equal(got, u @ want.T), f"seed={seed}: {rows} rows, draft={draft}"
    u = torch.randn(2, 5, 256, generator=gen)  # a DSpark step's [blocks, used, D]: rows counted over both
    assert torch.equal(output_head(params, u, True), u @ deq.T)


def test_mtp_drafts_through_the_copy() -> None:
    seed = _seed()
    model = deepinfer_fx.random_model(config_from_dict(tiny_v4()).replace(fake_quant=False), seed=seed % 1000)
    c, params = model
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(seed))

    def draft_logits(p: dict) -> torch.Tensor:
        state = init_state(c, 16, torch.float32)
        _, X = forward(p, state, c, ids[:-1], 0)
        return mtp_forward(p, state, c, X, ids[1:], 0)[0]

    _reads_the_copy(draft_logits, params, seed)


@pytest.mark.parametrize("family", ["v41", "v4-0731"])
def test_dspark_drafts_through_the_copy(family: str) -> None:
    seed = _seed()
    model = _model(family, seed, fake_quant=False)
    c, params = model
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, c.vocab_size, (n,), generator=gen) for n in (13, 4)]
    state = init_state(c, 32, slots=2)
    nxt = _prefill(model, state, seqs, [0, 1])
    pos = torch.tensor([13, 4])

    def draft_logits(p: dict) -> torch.Tensor:
        return dspark_propose(p, state, c, nxt, pos, [0, 1]).logits

    _reads_the_copy(draft_logits, params, seed)


@pytest.mark.parametrize("kind", ["mtp-v4", "dspark-v41"])
def test_fp8_draft_head_is_lossless(kind: str) -> None:
    from test_spec_drafters import drafting

    seed = _seed()
    model = drafting(kind)
    prompts, params = _prompts(seed, 3), _params(3, seed)
    ref = [o.outputs[0].token_ids for o in make_llm(model, max_num_batched_tokens=16).generate(prompts, params)]
    llm = make_llm(model, max_num_batched_tokens=16, speculative_config={**spec(kind), "draft_head": "fp8"})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref, f"seed={seed}"
    assert llm.speculator.stats.accepted_tokens > 0, f"seed={seed}"
    assert llm.model.params["draft_head"].dtype == torch.float8_e4m3fn
    assert "draft_head" not in model.params  # the caller's tree is left as it was


def test_refusals() -> None:
    from test_spec_drafters import _random

    model = _random("mtp-v4")
    with pytest.raises(ValueError, match=r"draft_head'\] must be one of \('model', 'fp8'\)"):
        make_llm(model, speculative_config={**spec("mtp-v4"), "draft_head": "bf16"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['draft_head'\] for method 'ngram'"):
        make_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_head": "fp8"})
