"""Stage one: generate every (item, sample) into a JSONL file, resuming where a run stopped.

A line is written (and flushed to disk) once its batch finishes, so an interrupted run loses at
most one batch; a torn last line is cut off on resume. Each pair samples with its own seed
(``tasks.shuffle_seed``), so a resumed run writes what an uninterrupted one would have written.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .chat import ChatTemplate
from .errors import EvalError
from .model import prompt_ids
from .tasks import IMAGE_MARKER, Loaded, gpqa_choices, shuffle_seed, user_prompt


@dataclass(frozen=True)
class GenConfig:
    """What a generation file was made with; a resume with different settings is refused."""

    task: str
    model: str
    temperature: float
    top_p: float
    max_tokens: int
    seed: int


def read_done(path: Path, config: GenConfig) -> set[tuple[str, int]]:
    """The (id, sample) pairs already in ``path``; cuts a torn last line off the file."""
    if not path.exists():
        return set()
    raw = path.read_bytes()
    keep = len(raw) if raw.endswith(b"\n") or not raw else raw.rfind(b"\n") + 1
    if keep < len(raw):  # the run was killed mid-write: that pair is generated again
        with open(path, "r+b") as f:
            f.truncate(keep)
    done = set()
    for n, line in enumerate(raw[:keep].decode("utf-8").splitlines(), 1):
        try:
            rec = json.loads(line)
            key = (str(rec["id"]), int(rec["sample"]))
            old = rec["config"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise EvalError(f"{path}:{n}: not a generation record; pass a new --out or delete the file") from None
        if old != asdict(config):
            changed = ", ".join(f"{k}: {old.get(k)!r} -> {v!r}" for k, v in asdict(config).items() if old.get(k) != v)
            raise EvalError(f"{path}:{n}: written with other settings ({changed}); pass a new --out to start afresh")
        done.add(key)
    return done


def plan(loaded: Loaded, config: GenConfig, samples: int, template: ChatTemplate) -> list[dict[str, Any]]:
    """Every (item, sample) record but its response, in a fixed order."""
    records = []
    for item in loaded.items:
        for s in range(samples):
            seed = shuffle_seed(config.seed, item["id"], s)
            rec: dict[str, Any] = {"id": item["id"], "sample": s, "seed": seed}
            choices = None
            if config.task == "gpqa":
                choices, correct = gpqa_choices(item, seed)
                rec.update(choices=choices, correct_letter=correct)
            else:
                rec["answer"] = item["answer"]
            if config.task == "hle":
                rec["answer_type"] = item["answer_type"]
                if item.get("image"):
                    rec["has_image"] = True
            rec["prompt"] = template.render(user_prompt(config.task, item, choices))
            rec["chat_template"] = template.source
            records.append(rec)
    return records


def image_bytes(value: str, where: str) -> bytes:
    """An HLE ``image`` field: a data URI (``data:image/png;base64,...``) or bare base64."""
    payload = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EvalError(f"{where}: its image is neither a base64 data URI nor base64") from None


def image_prompt_ids(tokenizer: Any, text: str, image_token_id: int) -> list[int]:
    """Token ids of a rendered prompt that holds ``IMAGE_MARKER``: the text on either side
    tokenized apart and ``image_token_id`` between, whether or not the tokenizer knows the
    marker as one token."""
    from ..io.tokenizer import encode

    before, after = text.split(IMAGE_MARKER, 1)
    return prompt_ids(tokenizer, before) + [image_token_id] + encode(tokenizer, after, add_bos=False)


def run(
    llm: Any,
    tokenizer: Any,
    records: list[dict[str, Any]],
    config: GenConfig,
    out: Path,
    batch: int,
    progress: bool = True,
    images: dict[str, str] | None = None,
) -> int:
    """Generate the records not in ``out`` yet, appending them; returns how many were written.
    ``images``: item id -> its image field, for the records with ``has_image``."""
    from tqdm import tqdm

    from ..engine import SamplingParams

    done = read_done(out, config)
    todo = [r for r in records if (r["id"], r["sample"]) not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out, "a", encoding="utf-8") as f,
        tqdm(
            total=len(todo), desc=f"{config.task} generate", unit="sample", disable=not progress, dynamic_ncols=True
        ) as bar,
    ):
        for start in range(0, len(todo), batch):
            part = todo[start : start + batch]
            ids = [_prompt(llm, tokenizer, r, images or {}) for r in part]
            params = [
                SamplingParams(
                    temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens, seq_seed=r["seed"]
                )
                for r in part
            ]
            for rec, o in zip(part, llm.generate(ids, params)):
                c = o.outputs[0]
                f.write(
                    json.dumps(
                        {
                            **rec,
                            "response": c.text,
                            "finish_reason": c.finish_reason,
                            "num_tokens": len(c.token_ids),
                            "config": asdict(config),
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(part))
    return len(todo)


def _prompt(llm: Any, tokenizer: Any, rec: dict[str, Any], images: dict[str, str]) -> Any:
    """A record's engine prompt: its token ids, or with an image vLLM's dict around them."""
    if not rec.get("has_image"):
        return prompt_ids(tokenizer, rec["prompt"])
    if rec["id"] not in images:
        raise EvalError(f"item {rec['id']!r}: an image question without its image field")
    ids = image_prompt_ids(tokenizer, rec["prompt"], llm.model.config.image_token_id)
    return {"prompt": ids, "multi_modal_data": {"image": image_bytes(images[rec["id"]], f"item {rec['id']!r}")}}
