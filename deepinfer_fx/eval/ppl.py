"""Decode-perplexity regression: per-sample PPL of fixed prompts, teacher-forced on the engine's
own greedy output, checked exactly against ``tests/models/offline_decode_ppl.json``.

A sample's PPL is ``exp(-mean log p)`` over its generated tokens, where the log-probabilities come
from a second pass that prefills prompt + generation (``prompt_logprobs``): a decode path that
drifts changes the greedy tokens or their scores, and so the number. The file maps platform ->
workload -> samples; a platform is accelerator (with the CPU ISA and vendor, or GPU name) + dtype + kernel set,
since each computes different floats. Refreshes rewrite it under an exclusive ``flock``, reading it
again inside the lock, so concurrent refreshes of different workloads all land.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

from .errors import EvalError
from .workloads import Workload, workload

BASELINE = Path(__file__).resolve().parents[2] / "tests" / "models" / "offline_decode_ppl.json"


def platform_of(llm: Any) -> str:
    import torch

    device = llm.model.device
    if device.type == "cuda":
        accel = f"nvidia:{torch.cuda.get_device_name(device).replace(' ', '_')}"
    else:
        accel = f"cpu:{torch.backends.cpu.get_cpu_capability()}:{_cpu_vendor()}"
    steps = llm.options.steps
    kernels = ("inductor" if steps.inductor else "aot_eager") if steps.compiled else "eager"
    if steps.disabled_passes:
        kernels += "-no:" + ",".join(sorted(steps.disabled_passes))
    return f"{accel}/{str(llm.model.dtype).removeprefix('torch.')}/{kernels}"


def _cpu_vendor() -> str:
    """The CPU's vendor id: the same ISA rounds differently across vendors (the CPU kernels
    dispatch by it), so a baseline from an Intel AVX-512 machine does not hold on an AMD one."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="ignore").splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def measure(w: Workload) -> tuple[str, list[dict[str, Any]]]:
    """(platform, one record per prompt: generated ids and decode PPL)."""
    import torch

    from ..engine import LLM, SamplingParams

    longest = max(map(len, w.prompts)) + w.max_tokens + 1
    # one thread on the CPU: the same reduction order on every run (and far faster on a shared machine)
    threads = 1 if not torch.cuda.is_available() else None
    llm = LLM(model=str(w.model_dir()), max_model_len=longest, max_num_seqs=len(w.prompts), num_threads=threads, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    outs = llm.generate(w.prompts, greedy)
    forced = [p + list(o.outputs[0].token_ids) for p, o in zip(w.prompts, outs)]
    scored = llm.generate(forced, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    samples = []
    for prompt, ids, o in zip(w.prompts, forced, scored):
        gen = range(len(prompt), len(ids))
        lps = [o.prompt_logprobs[j][ids[j]] for j in gen]
        samples.append({"output_ids": ids[len(prompt) :], "ppl": math.exp(-math.fsum(lps) / len(lps))})
    return platform_of(llm), samples


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    except json.JSONDecodeError as e:
        raise EvalError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def compare(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> list[str]:
    """What differs, one line per sample (empty: all equal, exactly)."""
    if len(expected) != len(got):
        return [f"{len(got)} samples, baseline has {len(expected)}"]
    bad = []
    for i, (e, g) in enumerate(zip(expected, got)):
        if e["output_ids"] != g["output_ids"]:
            first = next(j for j, (a, b) in enumerate(zip(e["output_ids"], g["output_ids"])) if a != b)
            bad.append(f"sample {i}: greedy output differs from token {first} on (ppl {g['ppl']!r} vs {e['ppl']!r})")
        elif e["ppl"] != g["ppl"]:
            bad.append(f"sample {i}: ppl {g['ppl']!r} != baseline {e['ppl']!r} (diff {g['ppl'] - e['ppl']:.3g})")
    return bad


def check(name: str, path: Path = BASELINE) -> tuple[bool, str]:
    platform, got = measure(workload(name))
    entry = _read(path).get(platform, {}).get(name)
    if entry is None:
        return False, (
            f"{path}: no baseline for platform {platform!r}, workload {name!r}; "
            f"run `python -m deepinfer_fx.eval ppl --workload {name} --refresh` on this platform"
        )
    bad = compare(entry["samples"], got)
    if bad:
        return False, f"{name} on {platform}: {len(bad)} of {len(got)} samples differ\n  " + "\n  ".join(bad)
    return True, f"{name} on {platform}: all {len(got)} samples equal the baseline"


def _commit() -> str | None:
    if os.environ.get("DEEPINFER_COMMIT"):
        return os.environ["DEEPINFER_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def store(path: Path, platform: str, name: str, entry: dict[str, Any]) -> None:
    """Read-modify-write ``path`` under an exclusive lock on the file itself (written in place, so
    every process locks the same inode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            text = f.read()
            try:
                data = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError as e:
                raise EvalError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix or delete it") from None
            data.setdefault(platform, {})[name] = entry
            f.seek(0)
            f.truncate()
            f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def refresh(name: str, path: Path = BASELINE) -> str:
    w = workload(name)
    platform, samples = measure(w)  # outside the lock: only the file update is serialised
    store(path, platform, name, {"commit": _commit(), "max_tokens": w.max_tokens, "samples": samples})
    return f"{path}: wrote {len(samples)} samples of {name} for {platform}"
