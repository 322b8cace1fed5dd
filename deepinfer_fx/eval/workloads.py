"""Fixed decode-PPL workloads: a random tiny checkpoint (fixed config and seed) and fixed prompts.

Each workload writes its checkpoint once into ``~/.cache/deepinfer_fx/eval-ppl/`` (a directory
named by the config's digest, so an edited config never reads a stale one). Prompts are token ids:
no tokenizer stands between the workload and the numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..config.tiny import tiny_v4
from .errors import EvalError

# every layer kind the tiny widths allow: SWA, CSA (ratio 4, indexer top-k) and HCA (ratio 8)
TINY = tiny_v4(num_hidden_layers=3, compress_ratios=[0, 4, 8], num_nextn_predict_layers=0)


def _prompt(length: int, salt: int) -> list[int]:
    # deterministic, varied ids in [3, 300): no special tokens (0-2) inside a prompt
    return [3 + (salt * 131 + i * 37 + (i * i) % 17) % 297 for i in range(length)]


@dataclass(frozen=True)
class Workload:
    name: str
    config: dict
    seed: int
    prompts: list[list[int]] = field(hash=False)
    max_tokens: int = 16

    def model_dir(self) -> Path:
        """The checkpoint, written on first use (atomically: concurrent runs may race here)."""
        digest = hashlib.sha256(json.dumps([self.config, self.seed], sort_keys=True).encode()).hexdigest()[:12]
        root = Path.home() / ".cache" / "deepinfer_fx" / "eval-ppl"
        final = root / f"{self.name}-{digest}"
        if not (final / "model.safetensors.index.json").exists():
            from ..io.writer import write_random_checkpoint

            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{self.name}-"))
            write_random_checkpoint(tmp, self.config, seed=self.seed, mtp=False)
            try:
                os.replace(tmp, final)
            except OSError:  # another process got there first: its copy is the same
                shutil.rmtree(tmp, ignore_errors=True)
        return final


WORKLOADS = {
    w.name: w
    for w in (
        # four prompts of different lengths decoded together: batching, ring wrap-around, a few entries
        Workload(
            "cpu-tiny", TINY, seed=0, prompts=[_prompt(n, s) for s, n in enumerate((5, 12, 23, 40))], max_tokens=16
        ),
        # two longer prompts: the compressed entries and indexer top-k carry most of the context
        Workload(
            "cpu-tiny-long", TINY, seed=1, prompts=[_prompt(n, 7 + s) for s, n in enumerate((180, 257))], max_tokens=8
        ),
    )
}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise EvalError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
