"""``python -m deepinfer_fx.generate --image FILE`` on a random V4.1 checkpoint with a vision tower."""

from __future__ import annotations

import pytest
from tiny_vision import IMAGE_TOKEN, fresh_seed, random_image, tiny_vision_config

import deepinfer_fx
from deepinfer_fx.generate import main

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41_vision")
    deepinfer_fx.write_random_checkpoint(path, tiny_vision_config(for_writer=True), seed=fresh_seed())
    return path


def test_image_flag_generates(checkpoint, tmp_path, capsys) -> None:
    png = tmp_path / "a.png"
    random_image(80, 50, fresh_seed()).save(png)
    argv = [
        "--model",
        str(checkpoint),
        "--prompt",
        "look",
        "--image",
        str(png),
        "--image",
        str(png),
        "--max-tokens",
        "2",
        "--ignore-eos",
        "--eager",
        "--dtype",
        "float32",
    ]  # random weights may pick EOS first
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--- request 0 (length)" in out and "prefill:" in out


def test_placeholders_go_after_the_bos(checkpoint) -> None:
    from deepinfer_fx import LLM
    from deepinfer_fx.cli.arguments import with_images
    from deepinfer_fx.io.tokenizer import encode

    llm = LLM(model=str(checkpoint), eager=True, max_num_seqs=1, memory_budget=16 << 20)
    got = with_images(llm, "look", ["a.png", "b.png"])
    text = encode(llm.tokenizer, "look", add_bos=False)
    bos = encode(llm.tokenizer, "")
    assert got["prompt"] == bos + [IMAGE_TOKEN, IMAGE_TOKEN] + text and got["multi_modal_data"]["image"] == [
        "a.png",
        "b.png",
    ]


def test_image_flag_errors(checkpoint, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff broken")
    assert main(["--model", str(checkpoint), "--prompt", "x", "--image", str(bad), "--max-tokens", "1", "--eager"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: prompts[0]: multi_modal_data['image'][0]: not a readable image") and "\n" not in err
    with pytest.raises(SystemExit):
        main(["--model", str(checkpoint), "--prompt", "a", "--prompt", "b", "--image", str(bad)])
    assert "the images go with one prompt" in capsys.readouterr().err
