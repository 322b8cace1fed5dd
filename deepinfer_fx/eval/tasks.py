"""The three tasks: their input fields, prompts and multiple-choice shuffles.

Input is JSONL, one item a line, in the fields the upstream sets use (README.md has a converter
for each). A bad line is an ``EvalError`` naming the file and line.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EvalError, json_objects
from .grading import LETTERS

TASKS = ("aime", "gpqa", "hle")
FIELDS = {
    "aime": ("id", "problem", "answer"),
    "gpqa": ("id", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
    "hle": ("id", "question", "answer", "answer_type"),
}
HLE_TYPES = ("exactMatch", "multipleChoice")
# The released tokenizer's image placeholder; an image question's prompt holds it before the
# question, and its token ids carry the config's image_token_id there (generation.image_prompt_ids).
IMAGE_MARKER = "<｜deepseek_image｜>"

AIME_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
GPQA_PROMPT = (
    "Answer the following multiple choice question. The last line of your response should be of the form "
    "'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering.\n\n"
    "{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)
HLE_PROMPT = (
    "{question}\n\nYour response should be in the following format:\nExplanation: {{your explanation for your answer choice}}\n"
    "Answer: {{your chosen answer}}\nConfidence: {{your confidence score between 0% and 100% for your answer}}"
)


def check_task(task: str) -> str:
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return task


@dataclass
class Loaded:
    items: list[dict[str, Any]]
    skipped_images: int  # HLE questions with an image, left out when the model has no vision tower


def load_items(task: str, path: str | Path, vision: bool = False) -> Loaded:
    """Read and check every line of ``path`` before anything runs. ``vision``: the model has a
    vision tower, so HLE's image questions are kept (else skipped and counted)."""
    check_task(task)
    path = Path(path)
    items, seen, skipped = [], set(), 0
    for n, item in json_objects(path):
        missing = [f for f in FIELDS[task] if f not in item]
        if missing:
            raise EvalError(f"{path}:{n}: missing field(s) {', '.join(map(repr, missing))} for task {task}")
        item["id"] = str(item["id"])
        if item["id"] in seen:
            raise EvalError(f"{path}:{n}: duplicate id {item['id']!r}")
        seen.add(item["id"])
        _check_values(task, item, f"{path}:{n}")
        if task == "hle" and item.get("image") and not vision:
            skipped += 1
            continue
        items.append(item)
    if not items:
        raise EvalError(f"{path}: no items to evaluate" + (f" ({skipped} image questions skipped)" if skipped else ""))
    return Loaded(items, skipped)


def _check_values(task: str, item: dict, where: str) -> None:
    if task == "aime":
        try:
            item["answer"] = int(str(item["answer"]).strip())
        except ValueError:
            raise EvalError(f"{where}: AIME 'answer' must be an integer, got {item['answer']!r}") from None
    elif task == "hle" and item["answer_type"] not in HLE_TYPES:
        raise EvalError(f"{where}: 'answer_type' must be one of {', '.join(HLE_TYPES)}, got {item['answer_type']!r}")
    for f in FIELDS[task][1:]:
        if task == "aime" and f == "answer":
            continue
        if not isinstance(item[f], str) or not item[f].strip():
            raise EvalError(f"{where}: field {f!r} must be a non-empty string")


def shuffle_seed(seed: int, item_id: str, sample: int) -> int:
    """A seed per (item, sample), stable across runs and Python versions (no ``hash()``)."""
    digest = hashlib.sha256(f"{seed}:{item_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63: fits SamplingParams.seq_seed too


def gpqa_choices(item: dict, seed: int) -> tuple[list[str], str]:
    """The four answers in a seeded order, and the letter the correct one landed on."""
    answers = [
        item["Correct Answer"],
        item["Incorrect Answer 1"],
        item["Incorrect Answer 2"],
        item["Incorrect Answer 3"],
    ]
    order = list(range(4))
    random.Random(seed).shuffle(order)
    choices = [answers[i].strip() for i in order]
    return choices, LETTERS[order.index(0)]


def user_prompt(task: str, item: dict, choices: list[str] | None = None) -> str:
    if task == "aime":
        return AIME_PROMPT.format(problem=item["problem"].strip())
    if task == "gpqa":
        return GPQA_PROMPT.format(question=item["Question"].strip(), **dict(zip(LETTERS, choices)))
    text = HLE_PROMPT.format(question=item["question"].strip())
    return f"{IMAGE_MARKER}\n{text}" if item.get("image") else text
