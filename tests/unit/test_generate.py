"""The minimal CLI: the demo model runs, and greedy decoding through the cache state picks the
same tokens as teacher-forced logits over the generated text."""

from __future__ import annotations

import torch

import deepinfer_fx
from deepinfer_fx import generate


def test_demo_generate_and_greedy_consistency(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(generate, "DEMO_DIR", tmp_path / "demo")
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    assert generate.main(["--prompt", "Hello there", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "[demo]" in out and "random weights" in out and "decode:" in out

    # fake-quant off: its rounding steps could split a near-tie differently in the two passes
    model = deepinfer_fx.load_model(tmp_path / "demo", dtype=torch.float32, fake_quant=False)
    prompt = [0, 17, 42, 99, 7]
    gen, _, _ = generate.greedy(model, prompt, 8, eos=())
    full = deepinfer_fx.logits(model, prompt + gen[:-1])
    assert gen == full[len(prompt) - 1 :].argmax(-1).tolist()


def test_bad_arguments(capsys) -> None:
    assert generate.main(["--model", "/nonexistent/dir", "--max-tokens", "2"]) == 2
    assert "no such directory" in capsys.readouterr().err
