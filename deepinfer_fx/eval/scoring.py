"""Stage two: grade a generation file and report Pass@1 with its standard error.

Pass@1 is the mean over items of each item's mean correctness over its samples; the standard
error is that of the item means (sample standard deviation / sqrt(items)), the spread a
re-draw of the questions would show. Everything needed to grade is in the generation file.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .errors import EvalError, json_objects
from .grading import grade_aime, grade_hle, grade_letter
from .tasks import check_task

NEEDS = {"aime": ("answer",), "gpqa": ("correct_letter", "choices"), "hle": ("answer", "answer_type")}


def read_gen(path: str | Path, task: str) -> list[dict[str, Any]]:
    check_task(task)
    path = Path(path)
    records = []
    for n, rec in json_objects(path):
        if rec.get("config", {}).get("task", task) != task:
            raise EvalError(f"{path}:{n}: generated for task {rec['config']['task']!r}, not {task!r}")
        missing = [f for f in ("id", "sample", "response", *NEEDS[task]) if f not in rec]
        if missing:
            raise EvalError(f"{path}:{n}: missing field(s) {', '.join(map(repr, missing))} for task {task}")
        records.append(rec)
    if not records:
        raise EvalError(f"{path}: no generation records")
    return records


def grade(task: str, rec: dict[str, Any]) -> tuple[bool, Any]:
    response = rec["response"] or ""
    if task == "aime":
        return grade_aime(response, rec["answer"])
    if task == "gpqa":
        return grade_letter(response, rec["correct_letter"])
    return grade_hle(response, str(rec["answer"]), rec["answer_type"])


def pass_at_1(per_item: dict[str, list[bool]]) -> tuple[float, float]:
    """(mean over items of the per-item sample mean, its standard error)."""
    means = [sum(v) / len(v) for v in per_item.values()]
    n = len(means)
    mean = sum(means) / n
    if n < 2:
        return mean, 0.0
    var = sum((m - mean) ** 2 for m in means) / (n - 1)
    return mean, math.sqrt(var / n)


def score(task: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    per_item: dict[str, list[bool]] = defaultdict(list)
    seen: set[tuple[str, int]] = set()
    graded, missing = [], 0
    for rec in records:
        key = (str(rec["id"]), int(rec["sample"]))
        if key in seen:  # a pair written twice (two runs into one file): count it once
            continue
        seen.add(key)
        ok, got = grade(task, rec)
        missing += got is None
        per_item[key[0]].append(ok)
        graded.append({"id": key[0], "sample": key[1], "extracted": got, "correct": ok})
    mean, se = pass_at_1(per_item)
    return {
        "task": task,
        "pass@1": mean,
        "stderr": se,
        "items": len(per_item),
        "samples": len(graded),
        "no_answer": missing,
        "per_item": {k: sum(v) / len(v) for k, v in per_item.items()},
        "graded": graded,
    }
