"""``LLM(speculative_config=...)``: which drafter proposes tokens and how many, checked once.

vLLM's shape: ``{"method": "ngram" | "mtp" | "dspark", "num_speculative_tokens": k, ...}``;
``ngram`` also takes ``prompt_lookup_min`` / ``prompt_lookup_max``; ``mtp`` and ``dspark`` take
``draft_head``: "model" (the default: drafts read the output head as stored) or "fp8" (drafts
of up to 64 rows read a block-FP8 copy made at load, half the bytes of the bf16 head the chained
drafter streams once a draft; outputs are the target's either way). DeepInfer's variables join
it: ``DEEPINFER_USE_NEXTN_DECODE`` caps k (unset: no cap; 0 is off, and refuses a config) and
``DEEPINFER_ENABLE_MTP_VARLEN`` asks for confidence-scheduled variable-length verification.
What is not built refuses here, with the reason, so that nothing silently runs plain decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..graphs.params import mtp_specs
from ..io.quant import quant_fp8_block, ue8m0_to_float
from ..settings import PREFIX, EngineConfig
from ..sharding.mesh import MeshSpec

METHODS = ("ngram", "mtp", "dspark")
KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
    "mtp": ("method", "num_speculative_tokens", "draft_head"),
    "dspark": ("method", "num_speculative_tokens", "draft_head"),
}
DRAFT_HEADS = ("model", "fp8")
DRAFT_HEAD_BLOCK = 128  # the copy's FP8 block: V4's, a k tile of the skinny FP8 kernel
NEXTN = f"{PREFIX}USE_NEXTN_DECODE"
VARLEN = f"{PREFIX}ENABLE_MTP_VARLEN"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts proposed per verify step (after the NEXTN cap)
    prompt_lookup_min: int = 1  # ngram: the shortest suffix that is looked up in the context
    prompt_lookup_max: int = 4  # ngram: the longest one (tried first)
    varlen: bool = False  # DEEPINFER_ENABLE_MTP_VARLEN: confidence-scheduled draft lengths (dspark)
    draft_head: str = "model"  # mtp, dspark: "fp8" drafts through a block-FP8 copy of the head


def _int(cfg: Mapping[str, Any], key: str, default: int, low: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"speculative_config[{key!r}] must be an int >= {low}, got {v!r}")
    return v


def parse_speculative_config(
    cfg: Mapping[str, Any] | None,
    settings: EngineConfig,
    c: ModelConfig,
    params: dict,
) -> SpeculativeConfig | None:
    """The checked config, or None for plain decoding. Refuses unknown keys and methods, k < 1,
    a method whose weights the checkpoint lacks, and every part that is not built yet."""
    nextn_set = settings.nextn_decode is not None
    if settings.mtp_varlen and (cfg is None or not isinstance(cfg, Mapping) or cfg.get("method") != "dspark"):
        raise ValueError(
            f"{VARLEN}=1 asks for confidence-scheduled variable-length verification, which reads DSpark's "
            "confidence head: pass speculative_config={'method': 'dspark', ...} (V4.1, V4-Flash-0731), or "
            f"unset {VARLEN} (fixed-length drafts)"
        )
    if cfg is None:
        if nextn_set and settings.nextn_decode > 0:
            raise ValueError(
                f"{NEXTN}={settings.nextn_decode} caps the draft length of speculative decoding, which is off: pass "
                "LLM(speculative_config={'method': 'ngram' or 'mtp', 'num_speculative_tokens': k}), or unset "
                f"{NEXTN}"
            )
        return None
    if not isinstance(cfg, Mapping):
        raise ValueError(
            f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 3}}, got {cfg!r}"
        )
    method = cfg.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
    unknown = sorted(set(cfg) - set(KEYS[method]))
    if unknown:
        raise ValueError(
            f"speculative_config has unknown key(s) {unknown} for method {method!r}; allowed: {list(KEYS[method])}"
        )
    if "num_speculative_tokens" not in cfg:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (the drafts per step, an int >= 1)")
    k = _int(cfg, "num_speculative_tokens", 0, 1)
    if nextn_set:
        if settings.nextn_decode == 0:
            raise ValueError(
                f"{NEXTN}=0 turns speculative decoding off, and speculative_config asks for it: unset {NEXTN} "
                "or drop speculative_config"
            )
        k = min(k, settings.nextn_decode)
    if method in ("mtp", "dspark"):
        _check_draft_weights(method, c, params)
    if method == "dspark" and k > c.dspark_block_size:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {k}: DSpark drafts blocks of {c.dspark_block_size} "
            f"tokens; ask for at most {c.dspark_block_size}"
        )
    if method == "mtp" and k > c.sliding_window:
        raise ValueError(
            f"speculative_config['num_speculative_tokens'] = {k}: the MTP drafter chains at most the "
            f"block's window ({c.sliding_window}) drafts"
        )
    if method in ("mtp", "dspark"):
        draft_head = cfg.get("draft_head", "model")
        if draft_head not in DRAFT_HEADS:
            raise ValueError(
                f"speculative_config['draft_head'] must be one of {DRAFT_HEADS} (the head as stored, or a block-FP8 "
                f"copy for the drafter), got {draft_head!r}"
            )
        return SpeculativeConfig(method, k, varlen=settings.mtp_varlen, draft_head=draft_head)
    lo = _int(cfg, "prompt_lookup_min", 1, 1)
    hi = _int(cfg, "prompt_lookup_max", max(lo, 4), 1)
    if hi < lo:
        raise ValueError(f"speculative_config: prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})")
    return SpeculativeConfig(method, k, lo, hi)


def _check_draft_weights(method: str, c: ModelConfig, params: dict) -> None:
    """A method that needs ``mtp.*`` weights on a model that has the wrong drafter or none."""
    if method == "mtp" and c.dspark_stages:
        raise ValueError(
            "speculative_config method 'mtp' needs an MTP-1 block; this checkpoint's mtp.* holds a DSpark "
            "drafter: use method 'dspark'"
        )
    if method == "dspark" and not c.dspark_stages:
        raise ValueError(
            "speculative_config method 'dspark' needs a DSpark drafter (V4.1-Flash, V4-Flash-0731); this "
            "model's config has none"
        )
    if not params.get("mtp"):
        keys = [s.key for s in mtp_specs(c)]
        shown = ", ".join(keys[:4]) + (f", ... ({len(keys)} tensors)" if len(keys) > 4 else "")
        raise ValueError(
            f"speculative_config method {method!r} needs the draft weights, and this checkpoint has no mtp.* "
            f"tensors (missing: {shown or 'mtp.0.*: the config declares no draft layers'}); use method "
            "'ngram' (no weights) or a checkpoint with them"
        )


def check_mesh(spec: SpeculativeConfig, mesh: MeshSpec) -> None:
    """Speculation on a multi-rank ``mesh``: its verify and rollback steps run in the ranks' lock
    step (``ModelRunner._plan``) for every method on dp and ep meshes (a DSpark drafter with its
    own expert count on an EP group of its own, ``Ranks.start_ep``); what is not built refuses here."""
    if mesh.cp > 1:
        raise ValueError(
            f"speculative_config method {spec.method!r} on mesh {mesh}: speculation is not built with context "
            f"parallelism (a cp{mesh.cp} step splits its prompt chunks over the group, statically when compiled and "
            "on the host when eager, and verify and rollback steps have no such split); meshes of dp and ep "
            "speculate, or drop speculative_config"
        )


def draft_head_params(head: torch.Tensor, rows: int = 8192) -> dict[str, torch.Tensor]:
    """``draft_head`` / ``draft_head_scale``: ``head`` ``[vocab, D]`` in block FP8 (e4m3 and fp32
    scales of ``DRAFT_HEAD_BLOCK`` squares, as a held dense weight), quantised ``rows`` rows at a
    time so the fp32 temporaries stay small beside a loaded model."""
    step = rows - rows % DRAFT_HEAD_BLOCK
    parts = [quant_fp8_block(head[i : i + step], DRAFT_HEAD_BLOCK) for i in range(0, head.shape[0], step)]
    return {
        "draft_head": torch.cat([w for w, _ in parts]),
        "draft_head_scale": ue8m0_to_float(torch.cat([s for _, s in parts])),
    }
