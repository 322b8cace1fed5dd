"""Start-up: the compile caches' directory, and the steps compiled and captured before the
first request, so that ``generate`` never stalls on a compile for a shape the warm-up covered.

Covered: every decode bucket in every sampler mode, and for each prefill length bucket up to
``max_num_batched_tokens`` one chunk, and as many chunks of that bucket as the token budget
holds (the steps a batch of similar prompts makes), in every mode; with speculative decoding,
every verify bucket (a request count, chunks padded to k + 1 rows). Other prefill shapes (a few chunks of mixed
lengths) still compile on first use.

The caches (Inductor's FX graph and AOT autograd caches, its autotuning results, Triton's
kernels) live under one directory; their keys hold the graph, the compiler's settings and our
pipeline's id (each pass's source hash, ``passes/compiler.py``), so a second start of the same
model and settings reuses them and a changed pass misses. Inductor-compiled model parts are also
saved whole under ``steps/`` (``passes/saved_steps.py``) and a later start loads them without
tracing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .graph_runner import StepGraphs
from .options import EngineOptions
from .runner import ModelRunner
from .sampler import MODES
from .step_inputs import Layout

CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use_cache_dir(root: Path) -> None:
    """Point the compilers' caches under ``root`` unless the user pointed them elsewhere.
    Importing ``torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR`` to Inductor's default (and an
    earlier compile ``TRITON_CACHE_DIR`` to a folder inside it): a value there counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor_default = os.path.abspath(default_cache_dir())
    for var, sub in CACHE_VARIABLES.items():
        now = os.environ.get(var)
        if not now or os.path.abspath(now) == inductor_default or now.startswith(inductor_default + os.sep):
            path = root / sub
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(path)


def warmup_layouts(steps: StepGraphs, opts: EngineOptions) -> list[Layout]:
    """The buckets the warm-up compiles (see the module docstring)."""
    budget, seqs = opts.max_num_batched_tokens, opts.max_num_seqs
    out = [Layout("decode", b) for b in steps.decode_buckets]
    smallest = steps.length_buckets[0]
    for length in steps.length_buckets:
        if length > max(budget, smallest):
            break
        # the chunks of a bucket are longer than half of it (any length at the smallest)
        shortest = 1 if length == smallest else length // 2 + 1
        for n in sorted({1, min(seqs, max(budget // shortest, 1))}):
            layout = steps.prefill_layout(n, length)
            if layout not in out:
                out.append(layout)
    out += [Layout("verify", r, length) for r in steps.request_buckets for length in steps.verify_buckets]
    return out


def warm_up(runner: ModelRunner, opts: EngineOptions, show: bool = True) -> float:
    """Compile and capture the warm-up's steps; prints progress and the total on stderr."""
    steps = runner.steps
    keys = [(layout, mode) for layout in warmup_layouts(steps, opts) for mode in MODES]
    t0 = time.perf_counter()
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(keys), desc="warm-up", unit="graph", dynamic_ncols=True, file=sys.stderr)

    def tick(name: str) -> None:
        if bar is not None:
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)

    try:
        runner.warm_up(keys, tick)
    finally:
        if bar is not None:
            bar.close()
    total = time.perf_counter() - t0
    if show:
        saved = steps.functions.saved
        loaded = "" if saved is None else f", {len(saved.loaded)} model parts loaded as saved"
        print(
            f"warm-up: {len(keys)} step graphs compiled and captured in {total:.1f} s{loaded} (caches: {opts.cache_dir})",
            file=sys.stderr,
            flush=True,
        )
    return total
