"""deepinfer_fx.graphs.engram_hash: the compressed vocabulary, the released bucket layout, and
hash ids against an independent plain-Python computation (own prime search, explicit 64-bit
wraparound); chunked hashing == one-shot hashing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from deepinfer_fx.config import ConfigError, ModelConfig, config_from_dict, load_config
from deepinfer_fx.config import released_config
from deepinfer_fx.graphs.engram_hash import (
    check_engram_rows,
    compressed_vocab,
    engram_hash,
    engram_history_after,
    engram_layout,
    engram_start_history,
    is_prime,
)
from deepinfer_fx.io.tokenizer import build_demo_tokenizer

MASK64 = (1 << 64) - 1


def _released() -> ModelConfig:
    return load_config(released_config("deepseek_v41_flash"))


def _seed() -> tuple[int, random.Random]:
    seed = random.SystemRandom().randrange(2**31)
    return seed, random.Random(seed)


# --------------------------------------------------------------------------- an independent reference


def _trial_division_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def _ref_primes(start: int, count: int) -> list[int]:
    out, n = [], start
    while len(out) < count:
        if _trial_division_prime(n):
            out.append(n)
        n += 1
    return out


def _signed64(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def _ref_multipliers(layer_id: int, n: int, vocab: int) -> list[int]:
    bound = max(1, ((2**63 - 1) // vocab) // 2)
    return [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer_id).integers(0, bound, size=n, dtype=np.int64)]


def _ref_hash(seq: list[int], pad: int, layer_pos: int, cfg: ModelConfig, vocab: int) -> list[list[int]]:
    """Row ids for every position of ``seq`` (a whole sequence from its start), plain ints."""
    n, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
    per_layer = (n - 1) * heads
    primes = _ref_primes(cfg.engram_vocab_size, per_layer * len(cfg.engram_layer_ids))[
        layer_pos * per_layer : (layer_pos + 1) * per_layer
    ]
    mult = _ref_multipliers(cfg.engram_layer_ids[layer_pos], n, vocab)
    out = []
    for t in range(len(seq)):
        c = [seq[t - k] if t - k >= 0 else pad for k in range(n)]
        rho = _signed64(c[0] * mult[0])
        row, offset = [], 0
        for k in range(1, n):
            rho = _signed64(rho ^ _signed64(c[k] * mult[k]))
            for h in range(heads):
                p = primes[(k - 1) * heads + h]
                row.append(rho % p + offset)  # Python's % is floor-mod, like torch.remainder
                offset += p
        out.append(row)
    return out


def _tiny_cfg(rng: random.Random, vocab: int) -> ModelConfig:
    layers = sorted(rng.sample(range(8), rng.randrange(1, 4)))
    n, heads = rng.randrange(2, 6), rng.randrange(1, 5)
    return config_from_dict(
        {
            "model_type": "deepseek_v41_text",
            "vocab_size": 256,
            "hidden_size": 64,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 32,
            "o_groups": 2,
            "o_lora_rank": 16,
            "sliding_window": 16,
            "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
            "kv_source_layer_ids": [2, 5],
            "index_source_layer_ids": [2, 5, 7],
            "index_n_heads": 16,
            "index_head_dim": 32,
            "index_topk": 4,
            "rms_norm_eps": 1e-20,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "routed_scaling_factor": 1.5,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": layers,
            "engram_num_embeddings": [1] * len(layers),
            "engram_max_ngram_size": n,
            "engram_n_heads": heads,
            "engram_head_dim": 32,
            "engram_vocab_size": rng.randrange(2, 5000),
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": vocab,
        }
    )


# --------------------------------------------------------------------------- primes and layout


def test_is_prime_matches_trial_division_and_hard_cases():
    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if _trial_division_prime(n)]
    seed, rng = _seed()
    for n in (rng.randrange(10**6, 10**9) for _ in range(300)):
        assert is_prime(n) == _trial_division_prime(n), f"seed={seed} n={n}"
    # Carmichael numbers and strong pseudoprimes to several small bases are composite
    for n in (561, 1105, 2047, 3215031751, 2152302898747, 3474749660383, 341550071728321, 3825123056546413051):
        assert not is_prime(n), n
    for p in (2**31 - 1, 2**61 - 1, 18446744073709551557):  # the largest prime below 2**64
        assert is_prime(p), p


def test_released_layout_primes_offsets_rows():
    c = _released()
    layout = engram_layout(c)
    assert layout.rows == (384006168, 384016682) == c.engram_num_embeddings
    check_engram_rows(c, layout)
    expected = _ref_primes(16_000_000, 48)
    assert expected[0] == 16000057
    for i in range(2):
        flat = [p for per_n in layout.primes[i] for p in per_n]
        assert flat == expected[24 * i : 24 * (i + 1)]
        offsets = [o for per_n in layout.offsets[i] for o in per_n]
        assert offsets == [sum(flat[:j]) for j in range(24)]
        assert len(layout.primes[i]) == 3 and all(len(per_n) == 8 for per_n in layout.primes[i])
        assert list(layout.multipliers[i]) == _ref_multipliers((1, 14)[i], 4, 99092)
        assert all(m % 2 == 1 and m < (2**63 - 1) // 99092 for m in layout.multipliers[i])
    assert layout.layer_ids == (1, 14) and layout.n_columns == 24 and layout.compressed_vocab_size == 99092


def test_layout_errors():
    c = _released()
    with pytest.raises(ConfigError, match="engram_num_embeddings") as ei:
        check_engram_rows(c.replace(engram_num_embeddings=(384006168, 384016683)), engram_layout(c))
    assert "384016682" in str(ei.value)
    with pytest.raises(ConfigError, match="engram_num_embeddings"):  # a different bucket start re-lays the table
        check_engram_rows(c, engram_layout(c.replace(engram_vocab_size=16_000_100)))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        engram_layout(c, compressed_vocab_size=99091)
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        engram_layout(c.replace(engram_compressed_vocab_size=None))
    assert engram_layout(c.replace(engram_compressed_vocab_size=None), 99092) == engram_layout(c)


# --------------------------------------------------------------------------- hashing


def test_hash_matches_independent_reference_released():
    seed, rng = _seed()
    c = _released()
    layout = engram_layout(c)
    pad = rng.randrange(99092)
    seq = [rng.randrange(99092) for _ in range(rng.randrange(1, 12))]
    for i in range(2):
        got = engram_hash(torch.tensor(seq), engram_start_history(layout, pad), layout, i)
        assert got.dtype == torch.int64 and got.shape == (len(seq), 24)
        assert got.tolist() == _ref_hash(seq, pad, i, c, 99092), f"seed={seed}"
        assert ((got >= 0) & (got < layout.rows[i])).all()


def test_hash_matches_reference_on_random_tiny_layouts():
    seed, rng = _seed()
    for _ in range(10):
        vocab = rng.randrange(2, 200)
        c = _tiny_cfg(rng, vocab)
        layout = engram_layout(c)
        pad = rng.randrange(vocab)
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        for i in range(len(c.engram_layer_ids)):
            got = engram_hash(torch.tensor(seq), engram_start_history(layout, pad), layout, i)
            assert got.tolist() == _ref_hash(seq, pad, i, c, vocab), f"seed={seed}"


def test_hash_wraps_like_int64_when_products_overflow():
    """Ids beyond the compressed vocabulary make the products overflow; the result is still the
    two's-complement wraparound (and floor-mod), not an error or a float."""
    seed, rng = _seed()
    c = _released()
    layout = engram_layout(c)
    seq = [rng.randrange(2**20, 2**40) for _ in range(8)]
    pad = rng.randrange(2**20, 2**40)
    assert any(_signed64(x * m) != x * m for x in seq for m in layout.multipliers[0]), "no product overflowed"
    got = engram_hash(torch.tensor(seq), engram_start_history(layout, pad), layout, 0)
    assert got.tolist() == _ref_hash(seq, pad, 0, c, 99092), f"seed={seed}"


def test_chunked_equals_one_shot_and_batched():
    seed, rng = _seed()
    c = _released()
    layout = engram_layout(c)
    pad = 7
    seq = torch.tensor([rng.randrange(99092) for _ in range(rng.randrange(3, 40))])
    whole = engram_hash(seq, engram_start_history(layout, pad), layout, 1)
    cuts = sorted(rng.sample(range(1, len(seq)), min(len(seq) - 1, rng.randrange(1, 6))))
    history, parts = engram_start_history(layout, pad), []
    for chunk in torch.tensor_split(seq, cuts):
        parts.append(engram_hash(chunk, history, layout, 1))
        history = engram_history_after(chunk, history)
    assert torch.equal(torch.cat(parts), whole), f"seed={seed} cuts={cuts}"
    # token-by-token decode, and a chunk shorter than the history
    history, steps = engram_start_history(layout, pad), []
    for t in range(len(seq)):
        steps.append(engram_hash(seq[t : t + 1], history, layout, 1))
        history = engram_history_after(seq[t : t + 1], history)
    assert torch.equal(torch.cat(steps), whole), f"seed={seed}"
    assert torch.equal(history, seq[-3:])
    # leading batch dims: rows hash independently
    other = torch.tensor([rng.randrange(99092) for _ in range(len(seq))])
    batched = engram_hash(torch.stack([seq, other]), engram_start_history(layout, pad, (2,)), layout, 1)
    assert torch.equal(batched[0], whole)
    assert torch.equal(batched[1], engram_hash(other, engram_start_history(layout, pad), layout, 1))


def test_sequence_start_uses_pad_class():
    c = _released()
    layout = engram_layout(c)
    a = engram_hash(torch.tensor([5, 6]), engram_start_history(layout, 3), layout, 0)
    b = engram_hash(torch.tensor([3, 3, 3, 5, 6]), engram_start_history(layout, 3), layout, 0)
    assert torch.equal(a, b[3:])
    with pytest.raises(ValueError, match="max_ngram_size"):
        engram_hash(torch.tensor([5]), torch.tensor([3, 3]), layout, 0)


# --------------------------------------------------------------------------- compressed vocabulary


def test_compressed_vocab_merges_case_accents_and_spaces():
    tokens = [
        "<pad>",
        "Café",
        "cafe",
        " cafe",
        "CAFE\n",
        "cafe\u0301",
        "\ufb01",
        "fi",
        " ",
        "  ",
        "\t\n",
        "x",
        "X",
        "\u0301",
        "\u3000b",
    ]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    classes, n = compressed_vocab(tok)
    assert classes.dtype == np.int64 and classes.shape == (len(tokens),)
    of = dict(zip(tokens, classes.tolist()))
    assert of["Café"] == of["cafe"] == of[" cafe"] == of["CAFE\n"] == of["cafe\u0301"] == 1
    assert of["\ufb01"] == of["fi"]  # NFKC folds the ligature
    assert of[" "] == of["  "] == of["\t\n"]  # whitespace-only tokens: one class, kept apart from ...
    assert of["\u0301"] not in (of[" "], of["<pad>"])  # ... a token that normalises to nothing
    assert of["x"] == of["X"] and of["\u3000b"] not in (of["x"], of[" "])
    assert n == len(set(of.values())) == 7
    assert classes.tolist() == [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 6]  # first-seen order


def test_compressed_vocab_demo_tokenizer():
    tok = build_demo_tokenizer(512)
    classes, n = compressed_vocab(tok)
    again, n_again = compressed_vocab(build_demo_tokenizer(512))
    assert n == n_again and np.array_equal(classes, again)
    assert classes.shape == (tok.get_vocab_size(with_added_tokens=True),) and 1 < n < len(classes)
    # class ids are dense and numbered in first-seen order
    first_seen = np.maximum.accumulate(classes)
    assert classes[0] == 0 and np.all(np.diff(first_seen) <= 1) and first_seen[-1] == n - 1
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(len(classes))]
    by_text = {t: i for i, t in enumerate(texts)}
    # " t" / "t" / "T" (and every other word the demo vocabulary has with and without a leading
    # space or capital) share a class
    pairs = [
        (t, t.strip().lower()) for t in texts if t.strip() and t != t.strip().lower() and t.strip().lower() in by_text
    ]
    assert len(pairs) > 20, pairs
    for text, plain in pairs:
        assert classes[by_text[text]] == classes[by_text[plain]], (text, plain)
    # byte fragments (decode to U+FFFD) are keyed by their raw token strings: all distinct
    fragments = [i for i, t in enumerate(texts) if "\ufffd" in t]
    assert len(fragments) > 50 and len({int(classes[i]) for i in fragments}) == len(fragments)
    # specials stay distinct
    assert len({int(classes[i]) for i in (0, 1, 2)}) == 3
