"""HLE's image questions run through the eval harness when the model has a vision tower."""

from __future__ import annotations

import base64
import io
import json

import pytest
from tiny_vision import IMAGE_TOKEN, fresh_seed, random_image, tiny_vision_config

import deepinfer_fx
from deepinfer_fx.eval.__main__ import main
from deepinfer_fx.eval.generation import image_prompt_ids
from deepinfer_fx.eval.tasks import IMAGE_MARKER
from deepinfer_fx.io.tokenizer import load_tokenizer

pytest.importorskip("PIL")


def test_hle_image_questions_run(tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    deepinfer_fx.write_random_checkpoint(ckpt, tiny_vision_config(for_writer=True), seed=fresh_seed())
    png = io.BytesIO()
    random_image(70, 40, fresh_seed()).save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    data = tmp_path / "hle.jsonl"
    lines = [
        {"id": "t", "question": "2+2?", "answer": "4", "answer_type": "exactMatch", "image": ""},
        {"id": "i", "question": "What is drawn?", "answer": "noise", "answer_type": "exactMatch", "image": uri},
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    out = tmp_path / "gen.jsonl"
    argv = [
        "generate",
        "--task",
        "hle",
        "--data",
        str(data),
        "--model",
        str(ckpt),
        "--out",
        str(out),
        "--max-tokens",
        "2",
        "--num-threads",
        "1",
        "--no-progress",
        "--temperature",
        "0",
    ]
    assert main(argv) == 0
    assert "skipped" not in capsys.readouterr().err
    recs = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert set(recs) == {"t", "i"} and recs["i"]["has_image"] and "has_image" not in recs["t"]
    assert recs["i"]["prompt"].count(IMAGE_MARKER) == 1
    # two tokens, or one where the random model's greedy text hits its EOS (a stop, not an error)
    i = recs["i"]
    assert i["num_tokens"] == 2 or (i["num_tokens"] == 1 and i["finish_reason"] == "stop"), i
    ids = image_prompt_ids(load_tokenizer(ckpt), recs["i"]["prompt"], IMAGE_TOKEN)
    assert ids.count(IMAGE_TOKEN) == 1


def test_hle_image_questions_skipped_without_vision(tmp_path, capsys) -> None:
    data = tmp_path / "hle.jsonl"
    rows = [
        {"id": "t", "question": "q", "answer": "a", "answer_type": "exactMatch"},
        {"id": "i", "question": "q", "answer": "a", "answer_type": "exactMatch", "image": "data:image/png;base64,AAAA"},
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in rows), encoding="utf-8")
    out = tmp_path / "gen.jsonl"
    assert (
        main(
            [
                "generate",
                "--task",
                "hle",
                "--data",
                str(data),
                "--model",
                "demo",
                "--out",
                str(out),
                "--max-tokens",
                "1",
                "--num-threads",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "skipped 1 image question(s) (the model has no vision tower)" in capsys.readouterr().err
