"""What a user hands ``LLM``, checked without coercion: prompts, token ids, devices, options.

A value of the wrong kind is refused with a one-line ``ValueError`` that names it and the fix; it
is never converted: a float token id is not truncated, a bytes prompt is not read as byte ids,
``0`` is not "unset", a device string is not guessed at.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..passes.manager import parse_pass_list, resolve_disabled
from ..settings import EngineConfig
from ..sharding.mesh import parse_mesh

PROMPT = "a str or a list of token ids (ints)"
PROMPTS = (
    "a str, a list of token ids (ints), a dict {'prompt': ..., 'multi_modal_data': {'image': ...}}, or a list of those"
)
TOKEN_IDS = "token ids are ints (Python, NumPy or torch integer scalars; not bool, float, str or bytes)"
DEVICES = "'cpu', 'cuda', 'cuda:N' or 'npu' (Ascend, with torch_npu)"


def is_token_id(v: Any) -> bool:
    """A Python int, a NumPy integer or a 0-d torch integer tensor; never a bool (an int subclass)."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _what(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {list(v.shape)}"
    return f"{v!r} ({type(v).__name__})"


def _not_a_list(v: Any, where: str, kinds: str = PROMPT) -> ValueError | None:
    """The error for a non-str prompt (or list of prompts) that is not a list, or None."""
    if v is None:
        return ValueError(f"{where} is None; it must be {kinds}")
    if isinstance(v, (bytes, bytearray)):
        return ValueError(
            f"{where} is bytes, which would read as byte values; decode it ({where}.decode()) or pass token ids"
        )
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return ValueError(f"{where} is a {type(v).__name__}; pass a list of ints ({where}.tolist())")
    if not isinstance(v, Sequence) or isinstance(v, str):
        return ValueError(f"{where} is {_what(v)}; it must be {kinds}")
    return None


def _prompt_shaped(v: Any) -> bool:
    """Whether ``v`` is (meant as) one prompt rather than one token id."""
    return (
        v is None
        or isinstance(v, (str, bytes, bytearray, Sequence, np.ndarray, dict))
        or (isinstance(v, torch.Tensor) and v.dim() > 0)
    )


def prompt_list(prompts: Any) -> tuple[list, list[str]]:
    """``generate``'s ``prompts`` as a list of prompts and the name of each for messages: a str or
    a list of token ids is one prompt, a list of those is several."""
    if prompts is None:
        raise ValueError(f"generate() needs prompts: {PROMPTS} (None is only for a COMPLETION engine)")
    if isinstance(prompts, (str, dict)):  # a dict is one prompt with its images (vLLM's shape)
        return [prompts], ["prompts"]
    err = _not_a_list(prompts, "prompts", PROMPTS)
    if err is not None:
        raise err
    if len(prompts) and not _prompt_shaped(prompts[0]):  # ids, one prompt (each id is checked later)
        return [prompts], ["prompts"]
    return list(prompts), [f"prompts[{i}]" for i in range(len(prompts))]


def token_ids(prompt: Any, where: str, vocab_size: int) -> list[int]:
    """A non-str prompt as a list of ints in ``[0, vocab_size)``, or an error naming ``where``."""
    err = _not_a_list(prompt, where)
    if err is not None:
        raise err
    if not len(prompt):
        raise ValueError(f"{where} is empty; a prompt needs at least one token")
    for i, t in enumerate(prompt):
        if not is_token_id(t):
            raise ValueError(f"{where}[{i}] is {_what(t)}, not a token id; {TOKEN_IDS}")
    ids = [int(t) for t in prompt]
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"{where}: token ids must lie in [0, {vocab_size}) (the model's vocabulary); {where}[{i}] is {t}"
            )
    return ids


def count(name: str, value: Any, low: int = 1, optional: bool = False) -> None:
    """``value`` is an int >= ``low`` (or None where ``optional``); bool is refused."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{' or None' if optional else ''}, got {value!r}")


def flag(name: str, value: Any, optional: bool = False) -> None:
    """``value`` is a bool (or None where ``optional``); 1 and "yes" are refused."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ValueError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")


def eager_setting(eager: bool | None, **compiled_options: Any) -> bool | None:
    """``eager`` once the options that act on compiled steps only (``cuda_graphs``, ``inductor``,
    ``dump_graphs``, ``disable_passes``) are taken into account: asking for one asks for compiled
    steps, on the CPU too; with ``eager=True`` it is an error naming the conflict."""
    asked = [
        name
        for name, v in compiled_options.items()
        if (bool(v) if isinstance(v, (str, list, tuple)) else v is not None)
    ]
    if not asked:
        return eager
    if eager is True:
        raise ValueError(
            f"{', '.join(asked)} act on compiled steps, which eager=True (--eager) turns off; drop one or the other"
        )
    return False


def disabled_passes(disable_passes: str | Sequence[str] | None, settings: EngineConfig) -> tuple[str, ...]:
    """The passes switched off: the argument's names (a list, or comma-separated) and then the
    settings' ``DEEPINFER_DISABLE_PASSES``, checked against the registry here, before the model
    loads, not at the first compile in the middle of a run."""
    names = parse_pass_list(disable_passes) if isinstance(disable_passes, str) else disable_passes or ()
    both = {n.strip() for n in names if n.strip()} | parse_pass_list(settings.disable_passes)
    resolve_disabled(both, environ={})  # the settings are already in: read no environment again
    return tuple(sorted(both))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on (None: CUDA where available, else the CPU), or an error that says
    why ``device`` cannot be used here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a str or torch.device, got {_what(device)}; use {DEVICES}")
    if str(device).startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the npu device type)
        except ImportError:
            raise ValueError(
                f"device {str(device)!r} needs torch_npu (Ascend), which is not installed; use 'cpu' or 'cuda'"
            ) from None
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {str(device)!r} is not a device; use {DEVICES}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r}: this machine has no usable CUDA device (torch.cuda.is_available() is False); use 'cpu'"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device {str(device)!r}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    elif dev.type == "npu":
        if not torch.npu.is_available():
            raise ValueError(f"device {str(device)!r}: torch_npu sees no Ascend device; use 'cpu'")
    elif dev.type != "cpu":
        raise ValueError(f"device {str(device)!r}: the engine runs on {DEVICES}")
    return dev


def check_launch(mesh: str | None) -> None:
    """A mesh of several ranks needs the world torchrun sets up; refuse one started without it."""
    spec = parse_mesh(mesh) if mesh else None
    if (
        spec is None
        or spec.world_size == 1
        or "WORLD_SIZE" in os.environ
        or (dist.is_available() and dist.is_initialized())
    ):
        return
    n = spec.world_size
    raise ValueError(
        f"mesh {spec} has {n} ranks but this process was not started by torchrun; "
        f"launch it under torchrun --nproc-per-node {n} (e.g. torchrun --nproc-per-node {n} -m deepinfer_fx.generate --mesh {spec} ...)"
    )
