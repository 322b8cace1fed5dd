"""The engine's options: built once from the ``LLM`` arguments and the ``DEEPINFER_*`` settings,
typed and frozen, and handed down (the runner and the step graphs read ``StepOptions``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import ModelConfig
from ..graphs.yoco import min_keep_tokens
from ..passes import saved_steps
from ..settings import PREFIX, EngineConfig


def check_batch_invariant(
    settings: EngineConfig,
    device: torch.device,
    *,
    speculative: bool,
    compiled: bool,
    inductor: bool,
) -> None:
    """Batch-invariant inference (``passes/batch_invariant.py``) is built for V4 and V4.1 on the
    CPU and on CUDA (its Triton kernels, ``kernels/ops_bi.py``), in one process or on any mesh,
    eagerly, on aot_eager, and under Inductor on CUDA; asked for anywhere else it refuses,
    naming what is missing."""
    if not settings.batch_invariant:
        return
    asked = f"batch_invariant=True / {PREFIX}BATCH_INVARIANT=1"
    missing = []
    if device.type not in ("cpu", "cuda"):
        missing.append(f"on {device.type}: its kernels exist for the CPU and CUDA only")
    if device.type == "cuda":
        from ..kernels.triton import register_nvidia_kernels

        if not register_nvidia_kernels():
            missing.append("on cuda without Triton: its CUDA kernels are Triton kernels (pip install triton)")
    if speculative:
        missing.append("with speculative decoding: verify steps are not checked for it")
    if compiled and inductor and device.type != "cuda":
        missing.append(
            f"under Inductor on {device.type}: Inductor's C++ kernels are not checked for it "
            "(inductor=False runs aot_eager)"
        )
    if missing:
        raise ValueError(f"{asked} is not built " + "; ".join(missing))


def compact_keep(
    c: ModelConfig,
    settings: EngineConfig,
    mode: str | None = None,
    keep: int | None = None,
    max_draft: int = 0,
    cp: bool = False,
    drafter: str | None = None,
) -> int | None:
    """V4.1 compact prefill's KEEP, or None for exact prefill (spec §8.2). ``mode`` / ``keep``: the
    ``LLM`` arguments, else ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE`` / ``_KEEP_TOKENS``; the
    mode's default is compact for V4.1 (as DeepInfer) and off for V4 and on context-parallel
    meshes, whose split steps are not built for it. ``max_draft``: the longest speculative draft,
    ``drafter`` its ``speculative_config`` method (named in a refusal)."""
    mode_var, keep_var = f"{PREFIX}YOCO_PREFILL_TRUNCATION_MODE", f"{PREFIX}YOCO_PREFILL_KEEP_TOKENS"
    if mode not in (None, "compact", "off"):
        raise ValueError(f"yoco_mode must be 'compact' or 'off', got {mode!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"yoco_keep_tokens must be a positive integer, got {keep!r}")
    asked = mode or settings.yoco_mode
    if asked is None:
        asked = "compact" if c.is_v41 and not cp else "off"
    if asked == "off":
        return None
    if not c.is_v41:
        raise ValueError(
            f"compact prefill (yoco_mode / {mode_var}) replays V4.1's CED decoder; {c.model_type} has none: "
            "set it to 'off' or leave it unset"
        )
    if cp:
        raise ValueError(
            f"compact prefill (yoco_mode / {mode_var}) is not built for context parallelism; set it to 'off'"
        )
    keep = settings.yoco_keep_tokens if keep is None else keep
    need = min_keep_tokens(c, max_draft)
    if keep < need:
        readers = "the decoder's rings" + (" and DSpark's context windows" if drafter == "dspark" else "")
        why = f"the sliding window ({c.sliding_window} rows, which {readers} read back)" + (
            f" plus the longest rollback (a {max_draft}-token draft + 1)" if max_draft else ""
        )
        spec = f" with speculative_config method {drafter!r} ({max_draft} drafts)" if drafter else ""
        raise ValueError(
            f"yoco_keep_tokens / {keep_var} = {keep} is below the minimum {need}{spec}: the kept rows must cover "
            f"{why}; raise it to {need} or pass yoco_mode='off'"
        )
    return keep


@dataclass(frozen=True)
class StepOptions:
    """How the steps run: compiled per bucket (and captured as graphs where the device has
    them) or the same step functions eagerly."""

    compiled: bool
    max_requests: int  # the largest decode bucket and prefill chunk count
    max_tokens: int  # the largest prefill chunk
    accelerator: str | None = None
    cuda_graphs: bool | None = None  # None: where the device has graphs
    inductor: bool = False  # False: our passes on aot_eager
    dump_dir: str | None = None
    disabled_passes: tuple[str, ...] = ()
    keep: int | None = None  # V4.1 compact prefill's KEEP (rows the decoder replays); None: exact prefill
    batch_invariant: bool = False  # passes/batch_invariant.py's table at every place
    engram_tables: str = "auto"  # where compiled steps hold V4.1's Engram tables (engine/engram_tables.py)
    engram_device_gib: float | None = None  # their device budget; None: an eighth of the device's memory
    # where Inductor-compiled steps are saved ahead of time for a later start (passes/saved_steps.py)
    saved_dir: str | None = None


@dataclass(frozen=True)
class EngineOptions:
    steps: StepOptions
    settings: EngineConfig
    max_num_seqs: int
    max_num_batched_tokens: int
    overlap: bool  # launch step N+1 before reading step N
    warmup: bool  # compile and capture the steps when the engine is built
    cache_dir: Path  # Inductor's, the FX graph cache's and Triton's caches


def default_cache_dir(settings: EngineConfig) -> Path:
    return Path(settings.cache_dir) if settings.cache_dir else Path.home() / ".cache" / "deepinfer_fx" / "compile"


def build_options(
    settings: EngineConfig,
    device: torch.device,
    *,
    eager: bool | None,
    overlap: bool,
    warmup: bool | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    cuda_graphs: bool | None,
    inductor: bool | None,
    dump_graphs: str | os.PathLike | None,
    disable_passes: str | Sequence[str] | None,
    keep: int | None = None,
) -> EngineOptions:
    """Resolve the arguments together (``engine/inputs.py`` has checked each one). ``eager``
    None compiles on GPUs; ``warmup`` None warms up compiled steps."""
    names = disable_passes.split(",") if isinstance(disable_passes, str) else list(disable_passes or ())
    disabled = tuple(n.strip() for n in names if n.strip())
    compiled = device.type != "cpu" if eager is None else not eager
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
    if warmup and not compiled:
        raise ValueError(
            "warmup=True compiles and captures the steps ahead of time; these steps run eagerly (nothing to warm up)"
        )
    inductor = device.type == "cuda" if inductor is None else inductor
    cache_dir = default_cache_dir(settings)
    steps = StepOptions(
        compiled=compiled,
        max_requests=max_num_seqs,
        max_tokens=max_num_batched_tokens,
        accelerator=settings.accelerator,
        cuda_graphs=cuda_graphs,
        inductor=inductor,
        dump_dir=None if dump_graphs is None else str(dump_graphs),
        disabled_passes=disabled,
        keep=keep,
        batch_invariant=settings.batch_invariant,
        engram_tables=settings.engram_tables,
        engram_device_gib=settings.engram_device_gib,
        saved_dir=str(cache_dir / "steps") if compiled and inductor and saved_steps.supported() else None,
    )
    return EngineOptions(
        steps,
        settings,
        max_num_seqs,
        max_num_batched_tokens,
        overlap,
        compiled if warmup is None else warmup,
        cache_dir,
    )


def llm_options(
    c: ModelConfig,
    settings: EngineConfig,
    device: torch.device,
    *,
    yoco_mode: str | None,
    yoco_keep_tokens: int | None,
    max_drafts: int,
    drafter: str | None,
    cp: bool,
    **build: Any,
) -> EngineOptions:
    """``LLM``'s options: compact prefill's KEEP (``compact_keep``; ``drafter``: the speculative
    method, None without), the rest from ``build_options``'s keywords, checked for batch invariance."""
    keep = compact_keep(c, settings, yoco_mode, yoco_keep_tokens, max_draft=max_drafts, cp=cp, drafter=drafter)
    opts = build_options(settings, device, keep=keep, **build)
    check_batch_invariant(
        settings,
        device,
        speculative=drafter is not None,
        compiled=opts.steps.compiled,
        inductor=opts.steps.inductor,
    )
    return opts
