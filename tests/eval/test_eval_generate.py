"""generate + score end to end on the demo model (random weights: accuracy ~0), resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_fx.eval.__main__ import main

DATA = Path(__file__).parent / "data"
FAST = ["--model", "demo", "--max-tokens", "4", "--num-threads", "1", "--no-progress", "--temperature", "1.0"]


def _generate(task: str, out: Path, samples: int = 2, *extra: str) -> int:
    return main(
        [
            "generate",
            "--task",
            task,
            "--data",
            str(DATA / f"{task}.jsonl"),
            "--samples",
            str(samples),
            "--out",
            str(out),
            *FAST,
            *extra,
        ]
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("task", ["aime", "gpqa", "hle"])
def test_generate_then_score(task, tmp_path, capsys):
    gen = tmp_path / "gen.jsonl"
    assert _generate(task, gen) == 0
    recs = _lines(gen)
    assert [(r["id"], r["sample"]) for r in recs] == [
        (i, s)
        for i in (["h1", "h2"] if task == "hle" else [ln["id"] for ln in _lines(DATA / f"{task}.jsonl")])
        for s in (0, 1)
    ]
    first = recs[0]
    assert first["prompt"].startswith("<｜begin▁of▁sentence｜><｜User｜>") and first["prompt"].endswith(
        "<｜Assistant｜>"
    )
    assert first["chat_template"] == "tokenizer_config" and first["num_tokens"] <= 4
    if task == "gpqa":
        for r in recs:
            assert sorted(r["choices"]) == sorted(
                ["photon", "gluon", "W boson", "graviton"] if r["id"] == "rec1" else ["7", "0", "14", "1"]
            )
            assert r["choices"]["ABCD".index(r["correct_letter"])] in ("photon", "7")
            assert f"{r['correct_letter']}) {r['choices']['ABCD'.index(r['correct_letter'])]}" in r["prompt"]
        assert recs[0]["seed"] != recs[1]["seed"]  # each sample its own shuffle
    if task == "hle":
        assert "skipped 1 image question" in capsys.readouterr().err
    scores = tmp_path / "scores.json"
    assert main(["score", "--task", task, "--gen", str(gen), "--out", str(scores)]) == 0
    result = json.loads(scores.read_text())
    assert result["samples"] == 4 and result["items"] == 2 and 0.0 <= result["pass@1"] <= 1.0


def test_resume_redoes_nothing(tmp_path, capsys):
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    assert _generate("aime", whole) == 0
    raw = whole.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(raw[:2]) + raw[2][:25])  # killed while writing the third line
    capsys.readouterr()
    assert _generate("aime", cut) == 0
    assert "2 new, 2 already there" in capsys.readouterr().out
    assert _lines(cut) == _lines(whole)  # per-pair seeds: the same responses as one uninterrupted run
    assert _generate("aime", cut) == 0 and "0 new, 4 already there" in capsys.readouterr().out
    assert _generate("aime", cut, 2, "--seed", "5") == 2  # other settings into the same file: refused
    assert "written with other settings (seed: 0 -> 5)" in capsys.readouterr().err


def test_bad_data_one_line(tmp_path, capsys):
    bad = tmp_path / "in.jsonl"
    cases = [
        ('{"id": 1, "problem": "p", "answer": 3}\n{oops\n', f"{bad}:2: not a JSON line"),
        ('{"id": 1, "problem": "p"}\n', f"{bad}:1: missing field(s) 'answer' for task aime"),
        ('{"id": 1, "problem": "p", "answer": "x"}\n', f"{bad}:1: AIME 'answer' must be an integer"),
        (
            '{"id": 1, "problem": "p", "answer": 1}\n{"id": 1, "problem": "q", "answer": 2}\n',
            f"{bad}:2: duplicate id '1'",
        ),
    ]
    for text, message in cases:
        bad.write_text(text, encoding="utf-8")
        assert main(["generate", "--task", "aime", "--data", str(bad), "--out", str(tmp_path / "g.jsonl"), *FAST]) == 2
        err = capsys.readouterr().err
        assert message in err and err.strip().count("\n") == 0
    assert main(["generate", "--task", "nope", "--data", str(bad), "--out", str(tmp_path / "g.jsonl"), *FAST]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["generate", "--task", "aime", "--data", str(bad), "--out", "x", "--samples", "0", *FAST]) == 2
    assert "--samples" in capsys.readouterr().err


def test_chat_template_fallback_and_errors(tmp_path):
    from deepinfer_fx.eval.chat import ChatTemplate
    from deepinfer_fx.eval.errors import EvalError

    assert ChatTemplate(tmp_path).render("hi") == "<｜User｜>hi<｜Assistant｜>"  # no tokenizer_config: fallback
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "chat_template": "{{ raise_exception('no user turns here') }}"})
    )
    with pytest.raises(EvalError, match="no user turns here"):
        ChatTemplate(tmp_path).render("hi")


def test_one_bos():
    from deepinfer_fx.eval.model import open_model, prompt_ids

    tok = open_model("demo").tokenizer
    for text in ("<｜begin▁of▁sentence｜><｜User｜>hi", "<｜User｜>hi"):  # a template's BOS, or none
        ids = prompt_ids(tok, text)
        assert ids[0] == 0 and ids.count(0) == 1
