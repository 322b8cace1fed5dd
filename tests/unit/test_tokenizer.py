"""Tests for the offline demo tokenizer (deepinfer_fx.io.tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from deepinfer_fx.io.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    PAD_TOKEN,
    build_demo_tokenizer,
    decode,
    encode,
    load_tokenizer,
    save_tokenizer,
)

VOCAB_SIZES = (300, 1024)
FIXED_TEXTS = (
    "naïve café 東京 🙂",
    "Hello, world! The weather is cold.",
    "  leading and trailing spaces  \n\ttabs\r\n",
    "",
    "x[i] = y{j}; 100% $19.99 Ω≈ç√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🇯🇵 👩‍👩‍👧",
)


@pytest.fixture(scope="module", params=VOCAB_SIZES)
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return build_demo_tokenizer(request.param)


def _random_unicode(rng: random.Random, max_len: int = 40) -> str:
    # Mix of scripts so byte-level fallback (multi-byte UTF-8) is exercised;
    # surrogates are excluded since they are not encodable as UTF-8.
    ranges = [
        (0x20, 0x7E),  # ASCII printable
        (0x09, 0x0D),  # whitespace controls
        (0xA0, 0x24F),  # Latin-1 + Latin Extended
        (0x370, 0x3FF),  # Greek
        (0x400, 0x4FF),  # Cyrillic
        (0x4E00, 0x9FFF),  # CJK
        (0x1F300, 0x1F64F),  # emoji
        (0x10000, 0x10FFFF),  # anything astral
    ]
    chars = []
    for _ in range(rng.randint(0, max_len)):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_exact_vocab_size_and_special_ids(tok: Tokenizer) -> None:
    assert tok.get_vocab_size() in VOCAB_SIZES
    assert tok.token_to_id(BOS_TOKEN) == 0
    assert tok.token_to_id(EOS_TOKEN) == 1
    assert tok.token_to_id(PAD_TOKEN) == 2


@pytest.mark.parametrize("size", [MIN_VOCAB_SIZE, 512])
def test_other_sizes_exact(size: int) -> None:
    assert build_demo_tokenizer(size).get_vocab_size() == size


def test_vocab_size_too_small_raises() -> None:
    with pytest.raises(ValueError, match=str(MIN_VOCAB_SIZE)):
        build_demo_tokenizer(MIN_VOCAB_SIZE - 1)


def test_vocab_size_too_large_raises() -> None:
    with pytest.raises(ValueError, match="maximum supported vocab_size is [0-9]+"):
        build_demo_tokenizer(1_000_000)


def test_round_trip_fixed(tok: Tokenizer) -> None:
    for text in FIXED_TEXTS:
        ids = encode(tok, text)
        assert ids[0] == 0
        assert decode(tok, ids) == text
        no_bos = encode(tok, text, add_bos=False)
        assert no_bos == ids[1:]
        assert decode(tok, no_bos) == text


def test_round_trip_random(tok: Tokenizer) -> None:
    seed = random.SystemRandom().randrange(2**63)
    rng = random.Random(seed)
    for _ in range(200):
        text = _random_unicode(rng)
        ids = encode(tok, text)
        assert all(0 <= i < tok.get_vocab_size() for i in ids)
        assert decode(tok, ids) == text, f"round trip failed (seed={seed}) for {text!r}"


def test_decode_keeps_specials_when_asked(tok: Tokenizer) -> None:
    ids = encode(tok, "hi") + [1]
    assert decode(tok, ids, skip_special_tokens=False) == f"{BOS_TOKEN}hi{EOS_TOKEN}"
    assert decode(tok, ids) == "hi"


def test_deterministic() -> None:
    assert build_demo_tokenizer(1024).to_str() == build_demo_tokenizer(1024).to_str()


def test_saved_files_byte_identical(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    save_tokenizer(build_demo_tokenizer(300), a)
    save_tokenizer(build_demo_tokenizer(300), b)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_save_load_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    save_tokenizer(tok, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert (tmp_path / "tokenizer_config.json").is_file()
    loaded = load_tokenizer(tmp_path)
    assert loaded.to_str() == tok.to_str()
    # tokenizers' own loader must also accept the file directly.
    direct = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in FIXED_TEXTS:
        assert encode(loaded, text) == encode(tok, text) == encode(direct, text)


def test_hf_auto_tokenizer_loads(tok: Tokenizer, tmp_path: Path) -> None:
    import transformers

    save_tokenizer(tok, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(hf) == tok.get_vocab_size()
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    rng = random.Random(random.SystemRandom().randrange(2**63))
    texts = list(FIXED_TEXTS) + [_random_unicode(rng) for _ in range(20)]
    for text in texts:
        ours = encode(tok, text, add_bos=False)
        theirs = hf.encode(text, add_special_tokens=False)
        assert theirs == ours
        # With specials, HF should add exactly the BOS we add (nothing else).
        assert hf.encode(text) == encode(tok, text)
        assert hf.decode(theirs) == text
    prompt = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(BOS_TOKEN) and "hi" in prompt


def test_missing_tokenizer_json_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg
    assert "no tokenizer.json" in msg
    assert "token ids" in msg
