"""The checkpoint an eval runs on: its directory, tokenizer, chat template and engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import ChatTemplate
from .errors import EvalError


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt with exactly one BOS: templates write their own, the
    fallback (or a template without one) gets the tokenizer's."""
    from ..io.tokenizer import encode

    ids = encode(tokenizer, text, add_bos=False)
    bos = encode(tokenizer, "", add_bos=True)  # what the post-processor prepends; [] if nothing
    return ids if ids[: len(bos)] == bos else bos + ids


@dataclass
class Opened:
    path: Path
    tokenizer: Any
    template: ChatTemplate

    @property
    def vision(self) -> bool:
        """Whether the checkpoint's config has a vision tower (then image questions run)."""
        from ..config import load_config

        return load_config(self.path).vision is not None

    def engine(self, records: list[dict[str, Any]], max_tokens: int, batch: int, num_threads: int | None = None) -> Any:
        """An ``LLM`` whose context fits the longest prompt plus ``max_tokens``."""
        from ..config import load_config
        from ..engine import LLM

        c = load_config(self.path)
        # an image's span takes at most max_image_tokens positions in place of its placeholder
        span = c.vision.max_image_tokens if c.vision is not None else 0
        longest = max(
            len(prompt_ids(self.tokenizer, r["prompt"])) + (span if r.get("has_image") else 0) for r in records
        )
        limit = c.max_position_embeddings
        if longest + max_tokens > limit:
            raise EvalError(
                f"{self.path}: the longest prompt ({longest} tokens) + --max-tokens {max_tokens} exceeds "
                f"the model's {limit} positions; lower --max-tokens"
            )
        return LLM(
            model=str(self.path), max_model_len=longest + max_tokens, max_num_seqs=batch, num_threads=num_threads
        )


def open_model(model: str) -> Opened:
    """``model``: a local checkpoint directory with tokenizer files, or ``demo``."""
    from ..io.tokenizer import load_tokenizer

    if model == "demo":
        from ..demo import demo_model_dir

        path = demo_model_dir()
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise EvalError(f"{path}: not a checkpoint directory (no config.json); pass a local path or 'demo'")
    if not (path / "tokenizer.json").is_file():
        raise EvalError(f"{path}: no tokenizer.json; the evals send text prompts")
    return Opened(path, load_tokenizer(path), ChatTemplate(path))
