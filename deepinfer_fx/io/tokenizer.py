"""Real (but tiny) tokenizer files for the random-weight demo/test checkpoints.

The demo checkpoints have random weights, so their outputs are meaningless, but
the surrounding plumbing (``AutoTokenizer.from_pretrained``, chat templates,
BOS/EOS handling, streaming decode) should still be exercised against genuine
tokenizer files instead of mocks.  We therefore train a small byte-level BPE
offline on an embedded corpus.  Byte-level means every UTF-8 string
round-trips, even text (emoji, CJK) that never appears in the corpus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .checkpoint import CheckpointError

# Same strings and ids as the DeepSeek tokenizers, so code that hard-codes the
# DeepSeek special tokens behaves identically against the demo checkpoints.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2

# 256 byte symbols + the special tokens: anything smaller cannot represent all
# of UTF-8, which would break the round-trip guarantee.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

DEMO_MODEL_MAX_LENGTH = 4096

# A plain-text chat template in the DeepSeek style.  The role markers are
# ordinary text for this tokenizer (not added tokens); that is fine for demos.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# Training corpus.  Kept in the module (not a data file) so building the
# tokenizer needs no network and no package data.  Its size bounds the largest
# achievable vocabulary: BPE stops once every word is a single token.
_DEMO_CORPUS = """\
An inference engine takes a trained model and turns it into a service that answers
requests quickly. Most of the work happens in a few places: loading the weights,
scheduling incoming prompts into batches, running the attention and feed-forward
layers, and sampling the next token. The scheduler decides which sequences share a
step, and the cache manager keeps the keys and values of earlier tokens so they are
not recomputed. When memory runs low, old pages are evicted or swapped to the host.
Good engines overlap data movement with computation, fuse small kernels together,
and avoid synchronizing the device unless the answer is truly needed right away.

Mixture-of-experts layers route every token to a handful of experts out of many.
The router produces scores, picks the top candidates, and the chosen experts process
the token in parallel. Balancing the load matters: if one expert receives most of the
traffic, the others sit idle while the busy one becomes the bottleneck. Quantized
weights in eight or four bits shrink the memory footprint, at the price of careful
scaling so that accuracy survives. Latency, throughput, and cost pull in different
directions, and every deployment chooses its own compromise between them.

The weather this morning was cold and grey, with a thin fog lying over the river.
By noon the wind turned westerly and pushed the clouds away, leaving a pale blue sky.
Forecasters expect light rain tomorrow evening, followed by a frosty night and a
bright, calm weekend. Farmers watch the soil temperature closely in early spring,
because seeds planted too soon may rot in damp ground. Sailors check the barometer:
a falling pressure warns of storms, thunder, hail, and sudden gusts near the coast.

To cook a simple vegetable soup, warm olive oil in a heavy pot and soften chopped
onions, carrots, and celery for about ten minutes. Add garlic, a bay leaf, thyme,
diced potatoes, and enough stock to cover everything. Simmer gently until the
potatoes are tender, then season with salt, pepper, and a squeeze of lemon juice.
Bread dough needs flour, water, yeast, and patience; knead it until smooth, let it
rise in a warm kitchen, shape the loaf, and bake it in a hot oven until golden.
Pancakes, omelettes, risotto, curry, dumplings, and roasted squash are favourites.

Libraries lend books, maps, journals, recordings, and puzzles to curious visitors.
A gardener prunes hedges, waters tulips, harvests cucumbers, and composts leaves.
Musicians rehearse symphonies; violinists tune strings, drummers practise rhythm,
and the conductor signals crescendos with expressive gestures. Astronomers measure
galaxies, comets, nebulae, and exoplanets through enormous telescopes on mountains.
Engineers design bridges, tunnels, railways, and turbines; chemists analyse crystals,
enzymes, polymers, and vapours; historians interpret manuscripts, treaties, and coins.

Numbers and symbols appear everywhere: 0 1 2 3 4 5 6 7 8 9, 42, 3.14159, 2024-05-17,
version 1.0.3, 100% done, $19.99, key=value, path/to/file.txt, (a + b) * c / d - e,
x[i] = y{j}; if (n > 0 && m < 10) { return n; } # comment @user ~home ^caret |pipe|.
Quick brown foxes jump over lazy dogs while zebras, yaks, and jaguars quietly wander.
"""


def build_demo_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the deterministic byte-level BPE demo tokenizer.

    Raises ValueError if ``vocab_size`` is below ``MIN_VOCAB_SIZE`` or above
    what the embedded corpus can support.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte tokens + "
            f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
        )

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x exactly; the GPT-2
    # regex split keeps merges from crossing word/punctuation boundaries.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()

    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        # Listed first so the trainer gives them ids 0, 1, 2.
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        # Seed all 256 byte symbols, not only those seen in the corpus, so any
        # input byte is representable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # A single in-memory "file" keeps the input order fixed; the trainer's
    # merge selection breaks ties deterministically, so output is reproducible.
    tok.train_from_iterator([_DEMO_CORPUS], trainer=trainer, length=1)

    got = tok.get_vocab_size()
    if got != vocab_size:
        # BPE ran out of pairs to merge: `got` is the largest size this corpus
        # can produce.
        raise ValueError(
            f"vocab_size={vocab_size} is too large for the embedded demo corpus; "
            f"the maximum supported vocab_size is {got}"
        )

    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = tok.token_to_id(token)
        if actual != expected_id:  # guards against a trainer ordering change
            raise RuntimeError(f"special token {token!r} got id {actual}, expected {expected_id}")

    # Prepend BOS in the tokenizer itself (as DeepSeek's tokenizer.json does) so
    # `tokenizers` and HF `AutoTokenizer` agree on add_special_tokens=True.
    bos_id = SPECIAL_TOKENS.index(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path, *, model_max_length: int = DEMO_MODEL_MAX_LENGTH) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into directory ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # pretty=True gives stable, diffable output; to_str/save are deterministic.
    tok.save(str(out / "tokenizer.json"), pretty=True)

    added_tokens_decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added_tokens_decoder,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    # sort_keys + fixed indent so repeated saves are byte-identical.
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a checkpoint directory (a damaged file: ``CheckpointError``
    naming it)."""
    directory = Path(path)
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"checkpoint directory {str(directory)!r} has no tokenizer.json; "
            "pass token ids instead of text, or copy the tokenizer files "
            "(tokenizer.json, tokenizer_config.json) into the checkpoint"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for bad UTF-8 and bad JSON alike
        raise CheckpointError(
            f"{file}: not a readable tokenizer ({exc}); re-download it or copy the checkpoint's tokenizer.json"
        ) from None


def encode(tok: Tokenizer, text: str, add_bos: bool = True) -> list[int]:
    """Encode ``text``; BOS comes from the tokenizer's post-processor."""
    return list(tok.encode(text, add_special_tokens=add_bos).ids)


def decode(tok: Tokenizer, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Decode ``ids`` back to text (ByteLevel decoder restores exact bytes)."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
