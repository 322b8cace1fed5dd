"""Stage one: generate every (item, sample) into a JSONL file, resuming where a run stopped.

A line is written (and flushed to disk) once its batch finishes, so an interrupted run loses at
most one batch; a torn last line is cut off on resume. Each pair samples with its own seed
(``tasks.shuffle_seed``), so a resumed run writes what an uninterrupted one would have written.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .chat import ChatTemplate
from .errors import EvalError
from .model import prompt_ids
from .tasks import Loaded, gpqa_choices, shuffle_seed, user_prompt


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
            rec["prompt"] = template.render(user_prompt(config.task, item, choices))
            rec["chat_template"] = template.source
            records.append(rec)
    return records


def run(llm: Any, tokenizer: Any, records: list[dict[str, Any]], config: GenConfig, out: Path, batch: int,
        progress: bool = True) -> int:
    """Generate the records not in ``out`` yet, appending them; returns how many were written."""
    from tqdm import tqdm

    from ..engine import SamplingParams

    done = read_done(out, config)
    todo = [r for r in records if (r["id"], r["sample"]) not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc=f"{config.task} generate", unit="sample",
                                                    disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(todo), batch):
            part = todo[start:start + batch]
            ids = [prompt_ids(tokenizer, r["prompt"]) for r in part]
            params = [SamplingParams(temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens,
                                     seq_seed=r["seed"]) for r in part]
            for rec, o in zip(part, llm.generate(ids, params)):
                c = o.outputs[0]
                f.write(json.dumps({**rec, "response": c.text, "finish_reason": c.finish_reason,
                                    "num_tokens": len(c.token_ids), "config": asdict(config)}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(part))
    return len(todo)
