"""Draft acceptance keeps the target's distribution (a chi-square test that a wrong rule fails),
the n-gram drafter, and speculative_config's refusals."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2
from test_dspark import v41_dspark
from tiny import tiny_v4, tiny_v41

import deepinfer_fx
from deepinfer_fx import LLM
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.drafters import NgramDrafter
from deepinfer_fx.engine.sampler import exponentials, row_key
from deepinfer_fx.engine.spec_accept import accept, accept_rows, uniform
from deepinfer_fx.engine.step_inputs import float_bits

V, N = 6, 40000
P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])  # a draft distribution far from P


def chi_square_p(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = p.double() * tokens.numel()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(p) - 1))


def _rows():
    seed = torch.arange(N, dtype=torch.long) * 7919 + 3
    position = torch.full((N,), 17, dtype=torch.long)
    draft = torch.multinomial(Q, N, replacement=True, generator=torch.Generator().manual_seed(0))
    return seed, position, draft


def test_general_rule_keeps_the_target_distribution() -> None:
    seed, position, draft = _rows()
    ok, token = accept(P.expand(N, V), Q.expand(N, V), draft, seed, position, torch.arange(V))
    assert chi_square_p(token, P) > 1e-3
    # acceptance rate of the rule: sum_x min(p, q)
    assert abs(ok.double().mean() - torch.minimum(P, Q).sum()) < 0.01


def test_wrong_rule_fails_the_test() -> None:
    """Resampling a rejected draft from p itself, not from the residual max(0, p - q): biased
    towards q's tokens, and the same chi-square test catches it."""
    seed, position, draft = _rows()
    pd, qd = P[draft], Q[draft]
    ok = uniform(seed, position, V) * qd < pd
    key = row_key(seed, position).unsqueeze(-1)
    from_p = (P.expand(N, V) / exponentials(key, torch.arange(V).unsqueeze(0))).argmax(-1)
    token = torch.where(ok, draft, from_p)
    assert chi_square_p(token, P) < 1e-6


def _verify_rows(draft: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """N one-draft verify chunks over the same logits (log P), one seed each."""
    L = 2
    logits = torch.log(P).repeat(N * L, 1)
    ids = torch.tensor([0, draft]).repeat(N)
    lens = torch.full((N,), L)
    seeds = torch.arange(N) * 104729 + 11
    sampling = torch.stack(
        [
            torch.zeros(N, dtype=torch.long),
            torch.arange(N),
            torch.full((N,), float_bits(temperature)),
            torch.zeros(N, dtype=torch.long),
            torch.full((N,), float_bits(1.0)),
            torch.zeros(N, dtype=torch.long),
            seeds,
            torch.full((N,), 5),
        ]
    )
    next_token = torch.zeros(N + 1, dtype=torch.long)
    tokens, accepted = accept_rows(logits, next_token, ids, lens, sampling, "plain", torch.arange(V))
    return tokens, accepted


def test_point_mass_drafts_keep_the_distribution() -> None:
    """An n-gram draft d is a point mass: accepted with probability p(d); the first emitted
    token is distributed as p whatever d is."""
    for draft in (0, 4):
        tokens, accepted = _verify_rows(draft, 1.0)
        assert chi_square_p(tokens[:, 0], P) > 1e-3
        assert abs(accepted.double().mean() - P[draft]) < 0.01


def test_ngram_drafter() -> None:
    d = NgramDrafter(3, 1, 3)
    assert d.propose([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1]  # the suffix [1, 2] recurs: what followed it
    assert d.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert d.propose([5, 1, 9, 1], 5) == [9, 1, 9]  # the latest earlier match of [1], continued with its period 2
    assert NgramDrafter(5, 1, 3).propose([4, 6, 7, 8, 6, 7, 8], 9) == [6, 7, 8, 6, 7]  # a loop of three drafts five
    assert d.propose([1, 2, 3], 5) == []
    assert NgramDrafter(3, 2, 3).propose([7, 1, 8, 1], 5) == []  # only [1] recurs, below the minimum


@pytest.fixture(scope="module")
def v4():
    return deepinfer_fx.random_model(config_from_dict(tiny_v4()).replace(fake_quant=False), seed=1)


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method.*must be one of"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens.*int >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens.*int >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key.*draft_model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
        ({"method": "mtp", "num_speculative_tokens": 9}, "chains at most the block's window"),  # tiny window: 8
        ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "unknown key.*prompt_lookup_max"),
        ({"method": "dspark", "num_speculative_tokens": 1}, "needs a DSpark drafter"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config(v4, cfg, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(v4, device="cpu", eager=True, max_model_len=32, speculative_config=cfg)


def test_missing_draft_weights_are_named() -> None:
    c, params = deepinfer_fx.random_model(config_from_dict(tiny_v4()), seed=1)
    with pytest.raises(ValueError, match=r"'mtp' needs the draft weights.*missing: mtp\.0\."):
        LLM(
            deepinfer_fx.api.Model(c, {k: v for k, v in params.items() if k != "mtp"}),
            device="cpu",
            eager=True,
            max_model_len=32,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )
    v41 = deepinfer_fx.random_model(config_from_dict(tiny_v41()), seed=1)
    with pytest.raises(ValueError, match="'mtp' needs.*no mtp"):
        LLM(
            v41,
            device="cpu",
            eager=True,
            max_model_len=32,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )
    dspark = deepinfer_fx.random_model(config_from_dict(v41_dspark()), seed=1)
    three = {"method": "dspark", "num_speculative_tokens": 3}
    # V4.1's default compact prefill serves the drafter; a KEEP below window + rollback names it
    assert LLM(dspark, device="cpu", eager=True, max_model_len=32, speculative_config=three).options.steps.keep == 140
    with pytest.raises(
        ValueError,
        match=r"= 11 is below the minimum 12 with speculative_config method 'dspark' \(3 drafts\): the kept rows "
        r"must cover the sliding window \(8 rows, which the decoder's rings and DSpark's context windows read back\) "
        r"plus the longest rollback \(a 3-token draft \+ 1\); raise it to 12 or pass yoco_mode='off'",
    ):
        LLM(dspark, device="cpu", eager=True, max_model_len=32, yoco_keep_tokens=11, speculative_config=three)
    with pytest.raises(ValueError, match="DSpark drafts blocks of 5 tokens"):
        LLM(
            dspark,
            device="cpu",
            eager=True,
            max_model_len=32,
            speculative_config={"method": "dspark", "num_speculative_tokens": 6},
        )


def test_deepinfer_variables(v4, monkeypatch) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert (
        LLM(v4, device="cpu", eager=True, max_model_len=32, speculative_config=ngram).speculative.num_speculative_tokens
        == 2
    )
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE.*speculative decoding, which is off"):
        LLM(v4, device="cpu", eager=True, max_model_len=32)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")  # DeepInfer's off value: plain decoding, and no config
    assert LLM(v4, device="cpu", eager=True, max_model_len=32).speculative is None
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE=0 turns speculative decoding off"):
        LLM(v4, device="cpu", eager=True, max_model_len=32, speculative_config=ngram)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    with pytest.raises(ValueError, match="DEEPINFER_ENABLE_MTP_VARLEN.*DSpark's confidence head"):
        LLM(v4, device="cpu", eager=True, max_model_len=32, speculative_config=ngram)


def test_cli_refusals(capsys) -> None:
    from deepinfer_fx import generate

    with pytest.raises(SystemExit):
        generate.main(["--num-speculative-tokens", "2"])
    assert "--num-speculative-tokens: needs --speculative-method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--speculative-method", "ngram", "--draft-head", "fp8"])
    assert "--draft-head: the head of a model drafter" in capsys.readouterr().err
    assert (
        generate.main(["--speculative-method", "dspark", "--eager", "--max-tokens", "2"]) == 2
    )  # the demo has no DSpark
    assert "needs a DSpark drafter" in capsys.readouterr().err
