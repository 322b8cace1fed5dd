"""Engram n-gram hashing for DeepSeek-V4.1 (spec §7.7): which table rows each position reads.

Three pieces, all integer arithmetic with no parameters:

1. ``compressed_vocab``: the tokenizer-derived map from token id to "compressed" class id, so that
   spellings that differ only in case, accents, Unicode form or surrounding whitespace share
   their n-gram rows.
2. ``engram_layout``: per Engram layer the hash multipliers, the prime bucket sizes of every
   (n-gram size, head) pair, their offsets inside the layer's table and the table's row count.
   These are fixed by training; a different value re-addresses the whole pretrained table.
3. ``engram_hash``: the row ids of the 2..N-grams ending at every position of a chunk, given the
   compressed ids before the chunk (``engram_history_after`` carries them across chunks, so
   chunked prefill and decode hash exactly like one-shot prefill).

Checked against HF transformers' ``deepseek_v41`` implementation (the only public one of the
recipe); the choices it settles where the spec is vague are listed in ``compressed_vocab``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from deepinfer_fx.config import ConfigError, ModelConfig

_INT64_MAX = int(np.iinfo(np.int64).max)
DEAD = -1  # the history's class id of an image-span position (spec §7.7: image tokens are DEAD)
_SEED_PER_LAYER = 10007  # layer ℓ's multipliers come from numpy default_rng(10007 * ℓ)
# Private-use character standing in for a single space while the key is stripped.
_SPACE_SENTINEL = "\ue000"
# Everything but the final strip. Runs in the tokenizers library (Rust) on purpose: its
# lowercasing and whitespace rules differ from Python's str methods in corner cases (a final
# sigma, the \x1c..\x1f separators), and training built the map with this library.
_FOLD = normalizers.Sequence(
    [
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ]
)
_STRIP = normalizers.Strip()
# Deterministic Miller-Rabin bases: correct for every n < 3.3e24, far above int64.
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


# --------------------------------------------------------------------------- compressed vocabulary


def _class_key(text: str) -> str:
    folded = _FOLD.normalize_str(text)
    # A token that is only whitespace folds to " "; stripping it would make it "" and merge it with
    # every token that normalises to nothing, so the single space is carried through the strip.
    key = _STRIP.normalize_str(_SPACE_SENTINEL if folded == " " else folded).replace(_SPACE_SENTINEL, " ")
    return key or text


def compressed_vocab(tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed class id (int64 ``[vocab]``, vocab counting added tokens) and the
    number of classes (the released tokenizer must give ``engram_compressed_vocab_size`` = 99092).

    A token's key is its decoded text (special tokens included) after NFKC -> NFD -> drop
    combining marks -> lowercase -> collapse runs of space/tab/CR/LF to one space -> strip, except:
    a token that folds to exactly one space keeps " "; a key that ends up empty falls back to the
    decoded text; a token whose decoded text contains U+FFFD (a byte fragment of a multi-byte
    character) is keyed by its raw token string. Equal keys share a class; classes are numbered
    in order of first appearance by token id.

    Points the spec leaves open, settled as HF transformers' ``deepseek_v41`` does:
    - only space, tab, CR and LF runs collapse (other Unicode spaces mostly become " " under NFKC
      first; vertical tab and form feed stay and are stripped only at the ends);
    - "strip accents" removes every combining mark (Mn, Mc, Me), as the tokenizers library does;
    - raw-string keys of byte fragments share one key space with normalised texts, so a fragment
      whose raw spelling equals some token's normalised text joins that class;
    - a literal U+E000 inside a token's text becomes a space (HF's sentinel replacement covers
      the whole key).
    Unverified here: that the DeepSeek-V4.1 tokenizer yields exactly 99092 classes (the tokenizer
    is not available offline); ``engram_layout`` refuses a size that differs from the config's.
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    classes: dict[str | None, int] = {}
    token_to_class = np.empty(size, dtype=np.int64)
    for token_id, text in enumerate(texts):
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else _class_key(text)
        token_to_class[token_id] = classes.setdefault(key, len(classes))
    return token_to_class, len(classes)


# --------------------------------------------------------------------------- layout


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for every 64-bit n)."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The ``count`` smallest primes >= ``start``, ascending."""
    primes, n = [], max(start, 2)
    while len(primes) < count:
        if is_prime(n):
            primes.append(n)
        n += 1
    return primes


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """Layer ``layer_id``'s odd multipliers; entry k multiplies the class id k positions back.

    They are below INT64_MAX // compressed_vocab_size, so a class id times its multiplier never
    overflows int64 (and XOR of non-negative values stays non-negative)."""
    bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    draws = np.random.default_rng(_SEED_PER_LAYER * layer_id).integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return tuple(2 * int(v) + 1 for v in draws)


@dataclass(frozen=True)
class EngramLayout:
    """Hash constants of every Engram layer; index 0..len(layer_ids)-1 is the layer's position in
    ``engram_layer_ids``. Columns of a layer's hash ids run over (n-gram size n = 2..N, head h)
    in that order."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int  # N: n-grams of size 2..N are hashed
    n_heads: int
    compressed_vocab_size: int
    multipliers: tuple[tuple[int, ...], ...]  # [layer][k], k = 0..N-1
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][n - 2][h]: bucket size (rows)
    offsets: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][n - 2][h]: first row of the bucket
    rows: tuple[int, ...]  # [layer]: rows of the layer's table (sum of its primes)

    @property
    def n_columns(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads


def engram_layout(config: ModelConfig, compressed_vocab_size: int | None = None) -> EngramLayout:
    """The layout of ``config``'s Engram layers. ``compressed_vocab_size`` is the tokenizer-derived
    class count (``compressed_vocab``); it must equal the config's value when both are known, since
    the multipliers depend on it."""
    stated = config.engram_compressed_vocab_size
    if compressed_vocab_size is not None and stated is not None and compressed_vocab_size != stated:
        raise ConfigError(
            f"'engram_compressed_vocab_size' is {stated} but the tokenizer gives {compressed_vocab_size} classes; "
            "the hashes would address the Engram tables at random"
        )
    vocab = compressed_vocab_size if compressed_vocab_size is not None else stated
    if vocab is None or vocab < 1:
        raise ConfigError(
            "'engram_compressed_vocab_size' is not in the config: pass the tokenizer-derived size "
            "(compressed_vocab(tokenizer)[1])"
        )
    n, heads, layer_ids = config.engram_max_ngram_size, config.engram_n_heads, config.engram_layer_ids
    per_layer = (n - 1) * heads
    # Primes are handed out walking layers, then n-gram sizes, then heads, each the next unused
    # prime >= engram_vocab_size: i.e. consecutive runs of the ascending primes.
    all_primes = _primes_from(config.engram_vocab_size, per_layer * len(layer_ids))
    primes, offsets, rows = [], [], []
    for i in range(len(layer_ids)):
        flat = all_primes[i * per_layer : (i + 1) * per_layer]
        starts = [0, *itertools.accumulate(flat[:-1])]  # buckets sit back to back in (n, h) order
        primes.append(tuple(tuple(flat[g * heads : (g + 1) * heads]) for g in range(n - 1)))
        offsets.append(tuple(tuple(starts[g * heads : (g + 1) * heads]) for g in range(n - 1)))
        rows.append(sum(flat))
    return EngramLayout(
        layer_ids=tuple(layer_ids),
        max_ngram_size=n,
        n_heads=heads,
        compressed_vocab_size=vocab,
        multipliers=tuple(hash_multipliers(layer, n, vocab) for layer in layer_ids),
        primes=tuple(primes),
        offsets=tuple(offsets),
        rows=tuple(rows),
    )


def check_engram_rows(config: ModelConfig, layout: EngramLayout) -> None:
    """Raise ConfigError unless the config's table sizes are the ones its hash layout addresses."""
    stated = tuple(config.engram_num_embeddings)
    if stated != layout.rows:
        raise ConfigError(
            f"'engram_num_embeddings' is {list(stated)} but the hash layout of engram layers "
            f"{list(layout.layer_ids)} (engram_vocab_size {config.engram_vocab_size}, "
            f"{config.engram_max_ngram_size}-grams x {config.engram_n_heads} heads) addresses {list(layout.rows)} rows"
        )


# --------------------------------------------------------------------------- hashing


def engram_start_history(layout: EngramLayout, pad_class: int, batch_shape: tuple[int, ...] = ()) -> torch.Tensor:
    """History of a fresh sequence: every position before the start is the pad class
    (``token_to_class[config.engram_pad_token_id]``). Shape ``[*batch_shape, N - 1]``."""
    return torch.full((*batch_shape, layout.max_ngram_size - 1), pad_class, dtype=torch.int64)


def engram_history_after(comp_ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The history to hash the next chunk with: the last N - 1 class ids up to the end of this one."""
    return torch.cat([history, comp_ids], dim=-1)[..., -history.shape[-1] :]


def engram_hash(
    comp_ids: torch.Tensor,
    history: torch.Tensor,
    layout: EngramLayout,
    layer_index: int,
    pad_class: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Table row ids of Engram layer ``layout.layer_ids[layer_index]`` for a chunk.

    ``comp_ids``: int64 ``[..., T]`` compressed class ids; ``history``: int64 ``[..., N - 1]`` the
    class ids of the N - 1 positions before the chunk, oldest first. Returns int64
    ``[..., T, (N - 1) * n_heads]`` with, for position t, n-gram size n and head h::

        rho_1 = c_t * M[0];   rho_n = rho_{n-1} XOR (c_{t-n+1} * M[n-1])
        id[n, h] = rho_n mod P[n][h] + offset[n][h]

    Products are int64 with two's-complement wraparound and ``mod`` is floor-mod (torch
    semantics, the same as numpy's); for class ids below ``compressed_vocab_size`` nothing
    overflows (see ``hash_multipliers``). With ``pad_class``, an id of ``DEAD`` (an image-span
    position) is a barrier: it and every older id of the window read as the pad class.
    """
    n = layout.max_ngram_size
    if history.shape[-1] != n - 1:
        raise ValueError(f"history has {history.shape[-1]} entries; expected max_ngram_size - 1 = {n - 1}")
    device = comp_ids.device
    # The layout's constants enter as Python ints, never as tensors made inside the step: a tensor
    # built there is a host constant copied to the GPU at every call, which a CUDA graph of an
    # aot_eager step cannot capture (integer arithmetic: the same ids either way).
    multipliers = [int(m) for m in layout.multipliers[layer_index]]
    primes, offsets = layout.primes[layer_index], layout.offsets[layer_index]
    seq = torch.cat([history.to(device=device, dtype=torch.int64), comp_ids.to(torch.int64)], dim=-1)
    # back[..., t, k] = c_{t-k}: each window of N consecutive ids, newest first.
    back = seq.unfold(-1, n, 1).flip(-1)
    if pad_class is not None:
        dead = (back == DEAD).int().cummax(-1).values.bool()
        pad = pad_class.to(device=device, dtype=torch.int64) if isinstance(pad_class, torch.Tensor) else int(pad_class)
        back = torch.where(dead, pad, back)
    rho = back[..., 0] * multipliers[0]
    columns = []
    for k in range(1, n):
        rho = torch.bitwise_xor(rho, back[..., k] * multipliers[k])
        columns.extend(torch.remainder(rho, int(p)) + int(o) for p, o in zip(primes[k - 1], offsets[k - 1]))
    return torch.stack(columns, dim=-1)
