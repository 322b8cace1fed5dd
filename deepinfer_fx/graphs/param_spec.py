"""``ParamSpec``, one parameter's declaration, and the nested parameter tree built from specs.

A spec names the tree path the model functions read, the checkpoint key (DeepSeek's own
spelling), the logical shape, the storage class, the logical axes the sharding rules map to
mesh axes, the initialiser for random models and the quantised format the checkpoint uses.
The specs themselves are listed in ``params.py`` (text model) and ``vision/params.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class ParamSpec:
    path: str  # tree path, e.g. "layers.3.attn.wq_a"
    key: str  # checkpoint key; "{e}" marks a per-expert key stacked on dim 0
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis per dim
    init: str = "normal"  # normal (fan-in scaled) | ones (1 + noise) | zeros (small noise)
    fp32: bool = False  # kept in float32 whatever the activation dtype (mHC, sinks, biases, ape)
    quant: str | None = None  # checkpoint storage: "fp8" (block), "fp4" (MXFP4) or None
    integer: bool = False
    high: int | None = None  # integer tensors: every value lies in [0, high) (checked at load)
    # Held in memory as stored rather than dequantised: "fp8" (a float8_e4m3fn weight, whose fp32
    # block scales are the spec at ``scale_path(path)``), "fp4" (MXFP4: uint8 bytes of two e2m1
    # codes, the even k in the low nibble, with ue8m0 byte scales per 32 at ``scale_path``) or
    # "scale" (those scales).
    held: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return "{e}" in self.key

    def dtype(self, run: torch.dtype) -> torch.dtype:
        """The tensor's dtype in a tree whose activations are ``run``."""
        if self.integer:
            return torch.long
        if self.held == "fp8":
            return torch.float8_e4m3fn
        if self.held == "fp4" or (self.held == "scale" and not self.fp32):
            return torch.uint8
        return torch.float32 if self.fp32 else run

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The shape of the tensor in memory: ``shape`` but for MXFP4's two values a byte."""
        return (*self.shape[:-1], self.shape[-1] // 2) if self.held == "fp4" else self.shape


def scale_path(path: str) -> str:
    """The tree path of the scales of a weight held as stored (``...experts.w1_scale``)."""
    return f"{path}_scale"


def init_param(spec: ParamSpec, gen: torch.Generator, dtype: torch.dtype, n_experts: int) -> torch.Tensor:
    """Random value for a spec. Every parameter gets a non-trivial value (norm weights and biases
    too), so a checkpoint key mapped to the wrong place changes the logits and tests notice."""
    dev = gen.device
    if spec.integer:  # hash routing table: distinct experts for each token id
        k = spec.shape[1]
        return torch.argsort(torch.rand(spec.shape[0], n_experts, generator=gen, device=dev), dim=1)[:, :k].contiguous()
    noise = torch.randn(spec.shape, generator=gen, device=dev)
    if spec.init == "normal":
        value = noise * spec.shape[-1] ** -0.5  # fan-in scaling keeps tiny random models well conditioned
    elif spec.init == "ones":
        value = 1.0 + 0.1 * noise
    else:
        value = 0.1 * noise
    return value.to(torch.float32 if spec.fp32 else dtype)


# --- trees -------------------------------------------------------------------------------------


def set_path(tree: dict, path: str, value: object) -> None:
    parts = path.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = int(part)
            while len(node) <= idx:
                node.append({} if not nxt.isdigit() else [])
            node = node[idx]
        else:
            node = node.setdefault(part, [] if nxt.isdigit() else {})
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last)
        while len(node) <= idx:
            node.append(None)
        node[idx] = value
    else:
        node[last] = value


def build_tree(values: dict[str, object]) -> dict:
    """Nested dicts (numeric components become lists) from flat tree paths."""
    tree: dict = {}
    for path in sorted(values, key=_natural):
        set_path(tree, path, values[path])
    return tree


def iter_tree(tree: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_tree(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from iter_tree(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _natural(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))
