"""A rank's parameter tree as DTensors on the world mesh, and the local views the steps run on.

On a multi-rank mesh each leaf of the tree a rank loads (its expert slots, every other tensor
whole) is wrapped as ``DTensor.from_local`` with the placements ``rules.placements`` gives, so a
researcher reads ``param.placements`` and ``param.shape`` (the whole tensor: stacked experts have
every physical slot) where they used to read only a local shard. Nothing is copied: the DTensor's
local tensor *is* the loaded one.

The compiled steps are explicit local regions, as the design card has them: data-parallel
attention, mHC, the shared expert and the head run on the rank's own tokens over whole weights,
and the MoE's routed experts go through the EP all-to-all (``sharding/ep.py``) on the rank's
slots. So the steps take ``local_tree(placed)``, the ``to_local()`` views, and an EPLB shuffle
that moves slots in place moves them under the DTensors too.

Leaves that are not tensors (V4.1's host-side Engram tables, ``graphs/engram.EngramTable``) stay as
they are, replicated; a tensor leaf with no spec is an error unless it is derived from the
config (``DERIVED``), which is replicated.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config import ModelConfig
from ..graphs.param_spec import ParamSpec, build_tree, iter_tree
from ..graphs.params import param_specs
from .eplb import ExpertPlacement
from .rules import global_shape, placements

DERIVED = frozenset({"engram_vocab"})  # built by the loader from the tokenizer: replicated
ExpertsOf = Callable[[ParamSpec], ExpertPlacement | None]  # a stacked spec -> its EPLB placement


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


def distribute_tree(params: dict, c: ModelConfig, mesh: DeviceMesh, experts: ExpertsOf) -> dict:
    """``params`` (this rank's local tree) with every tensor leaf a DTensor on ``mesh`` (the world
    mesh) under the rules' placements; ``experts`` gives a stacked spec's EPLB placement, whose
    physical slot count is the DTensor's global dim 0."""
    specs = {s.path: s for s in param_specs(c)}
    flat: dict[str, object] = {}
    for path, leaf in iter_tree(params):
        if not isinstance(leaf, torch.Tensor):
            flat[path] = leaf
            continue
        spec = specs.get(path)
        if spec is None:
            if path not in DERIVED:
                raise ValueError(f"parameter {path!r} has no spec in graphs/params.py: no placement to give it")
            shape, where = tuple(leaf.shape), placements(_replicated(path, leaf), mesh)
        else:
            shape = global_shape(spec, experts(spec) if spec.stacked else None)
            where = placements(spec, mesh)
        flat[path] = DTensor.from_local(
            leaf, mesh, where, run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
        )
    return build_tree(flat)


def _replicated(path: str, leaf: torch.Tensor) -> ParamSpec:
    return ParamSpec(path, path, tuple(leaf.shape), (None,) * leaf.dim())


def local_tree(placed: dict) -> dict:
    """Every DTensor leaf of ``placed`` as its ``to_local()`` view (same storage); other leaves as
    they are."""
    return build_tree({p: v.to_local() if isinstance(v, DTensor) else v for p, v in iter_tree(placed)})


def placement_rows(placed: dict) -> list[tuple[str, int, str, tuple[int, ...], tuple[int, ...]]]:
    """``(path pattern, count, placements, global shape, local shape)`` per kind of leaf: layer
    and expert indices are folded into ``*`` so a 43-layer tree reads as a few dozen rows."""
    rows: dict[tuple, int] = defaultdict(int)
    for path, leaf in iter_tree(placed):
        pattern = re.sub(r"\.\d+\.", ".*.", path)
        if isinstance(leaf, DTensor):
            where = (
                "("
                + ", ".join(f"{a}:{_short(p)}" for a, p in zip(leaf.device_mesh.mesh_dim_names, leaf.placements))
                + ")"
            )
            key = (pattern, where, tuple(leaf.shape), tuple(leaf.to_local().shape))
        else:
            key = (pattern, f"not a DTensor ({type(leaf).__name__}, replicated)", (), ())
        rows[key] += 1
    return sorted(((p, n, w, g, lo) for (p, w, g, lo), n in rows.items()), key=lambda r: (r[0], r[3]))


def _short(p: object) -> str:
    return f"S({p.dim})" if hasattr(p, "dim") else "R"


def placement_summary(placed: dict) -> str:
    """The rows of ``placement_rows`` as text: what the dry run prints and ``LLM`` shows."""
    lines = ["parameter placements (mesh axes dp, cp, ep; S(d): dim d sharded, R: replicated):"]
    for pattern, n, where, whole, local in placement_rows(placed):
        count = f" x{n}" if n > 1 else ""
        shapes = f" global {list(whole)} local {list(local)}" if whole else ""
        lines.append(f"  {pattern}{count}: {where}{shapes}")
    return "\n".join(lines)
