"""The ``DEEPINFER_*`` environment: every variable declared once, parsed and checked in one place.

``EngineConfig.from_env`` reads them all (CLI flags override), warns about a ``DEEPINFER_*``
name nobody declared (usually a typo) and refuses an invalid value with a message that names
the variable and the allowed values. The engine reads them once (``LLM`` builds one
``EngineConfig``) and hands each value to the function that needs it; library functions take
those values as arguments whose defaults are ``DEFAULTS`` (the table's defaults, never the
environment). ``setting(name)`` parses one variable, for entry points that take no config.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

PREFIX = "DEEPINFER_"


def _boolean(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("0 or 1")


def _count(raw: str) -> int:
    v = int(raw)  # ValueError -> the caller names the variable
    if v < 0:
        raise ValueError("a non-negative integer")
    return v


def _factor(raw: str) -> float:
    v = float(raw)
    if not v >= 0 or v == float("inf"):
        raise ValueError("a finite number >= 0")
    return v


def _seconds(raw: str) -> float:
    v = float(raw)
    if not 0 < v < float("inf"):  # 0 fails every collective at once, inf is the hang this bounds; NaN fails too
        raise ValueError("a positive number of seconds")
    return v


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        v = raw.strip().lower()
        if v not in allowed:
            raise ValueError(" or ".join(allowed))
        return v

    return parse


def _text(raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class Var:
    field: str
    parse: Callable[[str], Any]
    default: Any
    allowed: str  # how the error message describes valid values
    doc: str


VARIABLES: dict[str, Var] = {
    f"{PREFIX}ACCELERATOR": Var(
        "accelerator", _choice("nvidia", "ascend", "cpu"), None, "nvidia, ascend or cpu", "detected when unset"
    ),
    f"{PREFIX}HF_MODEL_DIR": Var("hf_model_dir", _text, None, "a directory", "local checkpoint instead of the hub"),
    f"{PREFIX}OVERRIDE_NUM_EXTRA_EXPERTS": Var(
        "extra_experts", _count, 32, "a non-negative integer", "redundant experts (a lower bound)"
    ),
    f"{PREFIX}EP_CAPACITY_FACTOR": Var(
        "ep_capacity_factor",
        _factor,
        0.0,
        "a finite number >= 0",
        "EP send capacity as a multiple of the average pairs per destination rank; 0 = worst case, never drops",
    ),
    f"{PREFIX}ENABLE_MTP_VARLEN": Var("mtp_varlen", _boolean, False, "0 or 1", "variable-length draft verification"),
    f"{PREFIX}USE_NEXTN_DECODE": Var(
        "nextn_decode",
        _count,
        None,
        "a non-negative integer",
        "caps the draft length of speculative decoding; 0 refuses it; unset: no cap",
    ),
    f"{PREFIX}YOCO_PREFILL_TRUNCATION_MODE": Var(
        "yoco_mode", _choice("compact", "off"), None, "compact or off", "compact for V4.1 when unset"
    ),
    f"{PREFIX}YOCO_PREFILL_KEEP_TOKENS": Var(
        "yoco_keep_tokens", _count, 140, "a non-negative integer", "decoder rows kept at prefill"
    ),
    f"{PREFIX}BATCH_INVARIANT": Var(
        "batch_invariant", _boolean, False, "0 or 1", "results independent of batch composition"
    ),
    f"{PREFIX}DISABLE_PASSES": Var(
        "disable_passes", _text, "", "comma-separated pass names", "graph passes switched off"
    ),
    f"{PREFIX}PDL": Var(
        "pdl",
        _boolean,
        True,
        "0 or 1",
        "programmatic dependent launch of every Triton kernel (ours and Inductor's, patched to wait first) on "
        "sm_90+ GPUs: each may start while the one before it finishes, and waits on the device for its results",
    ),
    f"{PREFIX}TOPOLOGY_FILE": Var(
        "topology_file", _text, None, "a JSON file", "hardware description for expert placement"
    ),
    f"{PREFIX}CACHE_DIR": Var(
        "cache_dir",
        _text,
        None,
        "a directory",
        "compile caches (Inductor, FX graph, AOT autograd, Triton); default ~/.cache/deepinfer_fx/compile",
    ),
    f"{PREFIX}DEMO_DIR": Var("demo_dir", _text, None, "a directory", "where the built-in demo model is written"),
    f"{PREFIX}EXPERT_FORMAT": Var(
        "expert_format",
        _choice("auto", "fp8", "fp4", "dequant"),
        "auto",
        "auto, fp8, fp4 or dequant",
        "routed experts of quantised checkpoints: fp8 (block FP8) and fp4 (MXFP4) keep them as stored, dequant "
        "converts them to the model dtype on load, auto keeps both as stored on CUDA and dequantises them elsewhere",
    ),
    f"{PREFIX}DENSE_FORMAT": Var(
        "dense_format",
        _choice("auto", "fp8", "dequant"),
        "auto",
        "auto, fp8 or dequant",
        "block-FP8 dense projections of quantised checkpoints: fp8 keeps them as stored (half the bytes; decode "
        "steps of <= 64 rows read them so on CUDA, larger steps dequantise them in the graph), dequant converts "
        "them to the model dtype on load, auto keeps them on CUDA with bf16 activations and converts them elsewhere",
    ),
    f"{PREFIX}KV_FORMAT": Var(
        "kv_format",
        _choice("auto", "model", "trained"),
        "auto",
        "auto, model or trained",
        "how the cache state holds window kv, compressed entries and index keys: trained keeps the fp8 / fp4 "
        "codes and scales the model's fake-quant points produce (2-4x fewer bytes, the same values), model keeps "
        "the values in the model dtype, auto = model (until kernels read the trained format)",
    ),
    f"{PREFIX}ENGRAM_TABLES": Var(
        "engram_tables",
        _choice("auto", "device", "host"),
        "auto",
        "auto, device or host",
        "where compiled steps read V4.1's Engram tables: device, host (pinned host memory read by the GPU, only "
        "the rows a step addresses), auto: on the device while they fit DEEPINFER_ENGRAM_DEVICE_GIB, else host",
    ),
    f"{PREFIX}ENGRAM_DEVICE_GIB": Var(
        "engram_device_gib",
        _factor,
        None,
        "a finite number >= 0",
        "GiB of Engram tables the device may hold (compiled steps); default an eighth of its memory",
    ),
    f"{PREFIX}DIST_TIMEOUT": Var(
        "dist_timeout",
        _seconds,
        300.0,
        "a positive number of seconds",
        "how long a rank waits for its peers in any collective or lock-step agreement before the job "
        "exits with an error naming the ranks that did not answer",
    ),
}

# Read by the benchmarks, not the engine: the commit a tree without .git was copied from.
BENCH_VARIABLES = frozenset({f"{PREFIX}COMMIT"})


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which containers and taskset
    narrow): the default of ``--threads`` / ``LLM(num_threads=...)``."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of one declared variable (its default when unset or empty)."""
    var = VARIABLES[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is invalid: expected {var.allowed} ({var.doc})") from None


def argument(name: str, value: str | None) -> Any:
    """An API argument that stands for variable ``name`` (``load_model(expert_format=...)``): None
    reads the variable; a value goes through the same parser, so both refuse alike."""
    if value is None:
        return setting(name)
    var = VARIABLES[name]
    try:
        return var.parse(str(value))
    except ValueError:
        raise ValueError(f"{var.field}={value!r} is invalid: expected {var.allowed} ({var.doc})") from None


@dataclass(frozen=True)
class EngineConfig:
    accelerator: str | None = None
    hf_model_dir: str | None = None
    extra_experts: int = 32
    ep_capacity_factor: float = 0.0
    mtp_varlen: bool = False
    nextn_decode: int | None = None
    yoco_mode: str | None = None
    yoco_keep_tokens: int = 140
    batch_invariant: bool = False
    disable_passes: str = ""
    topology_file: str | None = None
    cache_dir: str | None = None
    demo_dir: str | None = None
    expert_format: str = "auto"
    dense_format: str = "auto"
    kv_format: str = "auto"
    pdl: bool = True
    dist_timeout: float = 300.0
    engram_tables: str = "auto"
    engram_device_gib: float | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "EngineConfig":
        """Every declared variable from ``environ`` (default ``os.environ``); ``overrides`` (CLI
        flags, API arguments) win where not None. Unknown ``DEEPINFER_*`` names warn."""
        env = os.environ if environ is None else environ
        for name in sorted(k for k in env if k.startswith(PREFIX) and k not in VARIABLES and k not in BENCH_VARIABLES):
            warnings.warn(f"unknown setting {name} is ignored; known: {', '.join(sorted(VARIABLES))}", stacklevel=2)
        values = {v.field: setting(name, env) for name, v in VARIABLES.items()}
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"unknown engine setting(s) {bad}; known: {sorted(fields)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


DEFAULTS = EngineConfig()  # every setting at its declared default: what library functions assume
