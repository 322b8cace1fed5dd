"""Scoring hand-made generation files whose right answers are known: exact Pass@1."""

from __future__ import annotations

import json
import math

import pytest

from deepinfer_fx.eval.__main__ import main
from deepinfer_fx.eval.grading import extract_hle, extract_letter, last_boxed
from deepinfer_fx.eval.scoring import pass_at_1, read_gen, score

CFG = {"task": "aime"}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_boxed_nested_braces():
    assert last_boxed(r"x \boxed{\frac{1}{2}} then \boxed{ {12} }") == " {12} "
    assert last_boxed(r"\boxed{unclosed") is None


AIME = [  # (response, answer, correct)
    (r"so the answer is \boxed{204}.", 204, True),
    (r"first \boxed{5}, no wait: \boxed{ 070 }", 70, True),  # last box, leading zero, spaces
    (r"\boxed{\text{1,024}}", 1024, True),  # nested braces + thousands comma
    (r"The answer is 33.", 33, False),  # unboxed: no answer
    (r"\boxed{34}", 33, False),  # wrong
    ("", 33, False),  # missing
]


def test_aime_pass_at_1(tmp_path):
    # two items: item a gets 3 of 4 samples right, item b 0 of 2 -> (0.75 + 0) / 2
    recs = [
        {"id": "a" if i < 4 else "b", "sample": i % 4, "response": r, "answer": ans, "config": CFG}
        for i, (r, ans, _) in enumerate(AIME)
    ]
    got = score("aime", read_gen(_write(tmp_path / "g.jsonl", recs), "aime"))
    assert [g["correct"] for g in got["graded"]] == [ok for *_, ok in AIME]
    assert got["pass@1"] == 0.375
    assert got["stderr"] == pytest.approx(math.sqrt(((0.75 - 0.375) ** 2 + 0.375**2) / 1 / 2))
    assert got["no_answer"] == 2


@pytest.mark.parametrize(
    "response,letter",
    [
        ("Reasoning...\nAnswer: C", "C"),
        ("**Answer:** (B)", "B"),
        ("I think the answer is D because ...", "D"),
        ("Answer: A\nOn reflection, Answer: B", "B"),  # the last one counts
        (r"so \boxed{C}", "C"),
        ("The best option is\n(A)", "A"),
        ("A big question. Maybe", None),  # a capital A inside a sentence is no choice
        ("", None),
    ],
)
def test_letter_positions(response, letter):
    assert extract_letter(response) == letter


def test_gpqa_pass_at_1(tmp_path):
    rows = [("Answer: C", "C"), ("answer is (B)", "C"), ("", "A"), ("Answer: D", "D")]
    recs = [
        {"id": str(i // 2), "sample": i % 2, "response": r, "correct_letter": c, "choices": ["w", "x", "y", "z"]}
        for i, (r, c) in enumerate(rows)
    ]
    got = score("gpqa", read_gen(_write(tmp_path / "g.jsonl", recs), "gpqa"))
    assert got["pass@1"] == 0.5 and got["per_item"] == {"0": 0.5, "1": 0.5} and got["stderr"] == 0.0


def test_hle_exact_and_choice(tmp_path):
    rows = [
        ("Explanation: easy\nAnswer: **Paris.**\nConfidence: 90%", "paris", "exactMatch", True),
        ("Answer: $\\boxed{42}$", "42", "exactMatch", True),
        ("Answer: London", "Paris", "exactMatch", False),
        ("Paris", "Paris", "exactMatch", False),  # no Answer: line
        ("Explanation: ...\nAnswer: B. Because\nConfidence: 3%", "B", "multipleChoice", True),
        ("Answer: (E)", "D", "multipleChoice", False),
    ]
    recs = [
        {"id": str(i), "sample": 0, "response": r, "answer": a, "answer_type": t} for i, (r, a, t, _) in enumerate(rows)
    ]
    got = score("hle", read_gen(_write(tmp_path / "g.jsonl", recs), "hle"))
    assert [g["correct"] for g in got["graded"]] == [ok for *_, ok in rows]
    assert got["pass@1"] == pytest.approx(0.5)
    assert extract_hle("Answer:   \n") is None


def test_pass_at_1_one_item():
    assert pass_at_1({"x": [True, False, True, True]}) == (0.75, 0.0)


def test_bad_gen_files_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "sample": 0, "response": "", "answer": 3}\nnot json\n', encoding="utf-8")
    assert main(["score", "--task", "aime", "--gen", str(bad), "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{bad}:2: not a JSON line" in err
    bad.write_text('{"id": "1", "sample": 0, "response": ""}\n', encoding="utf-8")
    assert main(["score", "--task", "aime", "--gen", str(bad), "--out", str(tmp_path / "s.json")]) == 2
    assert f"{bad}:1: missing field(s) 'answer'" in capsys.readouterr().err
    assert main(["score", "--task", "mmlu", "--gen", str(bad), "--out", str(tmp_path / "s.json")]) == 2
    assert "unknown task 'mmlu'" in capsys.readouterr().err
