"""The one table from logical axes (``ParamSpec.axes``) to mesh axes, and what it implies.

Every parameter is declared once in ``graphs/params.py`` with a logical axis per dim; this module
turns that into DTensor placements on the world mesh (``world.build_mesh``) and into the slice of
the checkpoint each rank reads. Changing how a model is sharded means editing ``RULES`` only.

Today's choices (DeepInfer's layout for DeepSeek-V4):
- routed experts are sharded over ``ep``; with redundant experts (EPLB) the stacked tensors hold
  *physical* slots, and the experts a rank loads come from the placement's phys->logical map;
- everything else is replicated: attention is data parallel (each rank serves its own requests,
  so it holds every head), embeddings/head/shared experts/norms run on the rank's own tokens.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..graphs.param_spec import ParamSpec
from .eplb import ExpertPlacement
from .mesh import MeshSpec
from .world import MESH_AXES

# logical axis -> mesh axis, None = replicated. An axis missing here is an error, so a new logical
# axis in params.py forces a decision instead of silently replicating.
RULES: dict[str, str | None] = {
    "experts": "ep",  # routed experts: each EP rank holds its slots of the stacked tensors
    "expert_mlp": None,  # no tensor parallelism inside an expert
    "embed": None,
    "vocab": None,  # embedding and head: each DP rank embeds / samples its own tokens
    "heads": None,  # data-parallel attention: every rank holds all heads
    "mlp": None,  # shared expert: runs on the rank's own tokens before the combine
    "compress": None,
}

# Axes that shard only the stacked per-expert tensors (checkpoint key with "{e}"). The router's
# gate weight and biases also carry "experts", but that dim indexes routing *scores*: every rank
# routes its own tokens over all experts before the dispatch, so those stay replicated.
STACKED_ONLY = frozenset({"experts"})

MeshLike = Union[DeviceMesh, MeshSpec]
Coord = Union[Mapping[str, int], Sequence[int], None]


def mesh_axis(spec: ParamSpec, dim: int) -> str | None:
    """The mesh axis that shards ``dim`` of ``spec`` (None: replicated)."""
    logical = spec.axes[dim]
    if logical is None:
        return None
    if logical not in RULES:
        raise KeyError(f"{spec.path}: logical axis {logical!r} (dim {dim}) has no entry in sharding.rules.RULES")
    if logical in STACKED_ONLY and not spec.stacked:
        return None
    return RULES[logical]


def _axis_sizes(mesh: MeshLike) -> dict[str, int]:
    if isinstance(mesh, MeshSpec):
        return {a: getattr(mesh, a) for a in MESH_AXES}
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("sharding rules need a mesh with named axes (build it with world.build_mesh)")
    return dict(zip(names, mesh.shape))


def _sharded_dims(spec: ParamSpec, sizes: dict[str, int]) -> dict[int, str]:
    """tensor dim -> mesh axis, for the dims that are actually split (axis size > 1 is not
    required: a size-1 axis is a trivial Shard, which keeps placements independent of degrees)."""
    if len(spec.axes) != len(spec.shape):
        raise ValueError(f"{spec.path}: {len(spec.axes)} logical axes for a {len(spec.shape)}-d shape {spec.shape}")
    out: dict[int, str] = {}
    for d in range(len(spec.shape)):
        axis = mesh_axis(spec, d)
        if axis is None:
            continue
        if axis not in sizes:
            raise ValueError(
                f"{spec.path}: dim {d} shards on mesh axis {axis!r}, which mesh {tuple(sizes)} does not have"
            )
        if axis in out.values():
            raise ValueError(f"{spec.path}: two dims shard on the same mesh axis {axis!r}")
        out[d] = axis
    return out


def placements(spec: ParamSpec, mesh: MeshLike) -> tuple[Placement, ...]:
    """DTensor placements of ``spec`` on ``mesh``, one per mesh dim (in the mesh's axis order)."""
    sizes = _axis_sizes(mesh)
    by_axis = {axis: d for d, axis in _sharded_dims(spec, sizes).items()}
    return tuple(Shard(by_axis[a]) if a in by_axis else Replicate() for a in sizes)


def _check_experts(spec: ParamSpec, d: int, sizes: dict[str, int], axis: str, experts: ExpertPlacement) -> None:
    if experts.n_logical != spec.shape[d]:
        raise ValueError(
            f"{spec.path}: expert placement is for {experts.n_logical} experts, the parameter has {spec.shape[d]}"
        )
    if experts.ep_degree != sizes[axis]:
        raise ValueError(
            f"{spec.path}: expert placement is for ep{experts.ep_degree}, the mesh has {axis}{sizes[axis]}"
        )


def global_shape(spec: ParamSpec, experts: ExpertPlacement | None = None) -> tuple[int, ...]:
    """The shape of the whole (DTensor) parameter: stacked experts have ``n_physical`` rows when
    redundant experts are on."""
    if experts is None or not spec.stacked:
        return spec.held_shape
    return (experts.n_physical,) + spec.held_shape[1:]


def local_shape(
    spec: ParamSpec, mesh: MeshLike, coord: Coord = None, experts: ExpertPlacement | None = None
) -> tuple[int, ...]:
    """The shape of this rank's shard. Every split must be even (static shapes for graph capture);
    otherwise the error names the parameter, the dim and both sizes. ``coord`` is accepted for
    symmetry with ``local_slice``: even splits make the shape the same on every rank."""
    sizes = _axis_sizes(mesh)
    shape = list(global_shape(spec, experts))
    for d, axis in _sharded_dims(spec, sizes).items():
        if experts is not None and spec.stacked and d == 0:
            _check_experts(spec, d, sizes, axis, experts)
        n = sizes[axis]
        if shape[d] % n:
            hint = (
                " (redundant experts round the count up to a multiple of the EP degree)"
                if d == 0 and spec.stacked
                else ""
            )
            raise ValueError(
                f"{spec.path}: dim {d} ({spec.axes[d]}) has size {shape[d]}, not divisible by mesh axis "
                f"{axis!r} of size {n}{hint}"
            )
        shape[d] //= n
    return tuple(shape)


def _coord_dict(mesh: MeshLike, coord: Coord) -> dict[str, int]:
    names = tuple(_axis_sizes(mesh))
    if coord is None:
        if isinstance(mesh, MeshSpec):
            raise ValueError("a MeshSpec has no own rank: pass coord={'ep': i, ...}")
        mine = mesh.get_coordinate()
        if mine is None:
            raise ValueError("this rank is not part of the mesh; pass coord explicitly")
        return dict(zip(names, mine))
    if isinstance(coord, Mapping):
        return dict(coord)
    if len(coord) != len(names):
        raise ValueError(f"coordinate {tuple(coord)} does not match mesh axes {names}")
    return dict(zip(names, coord))


def local_slice(
    spec: ParamSpec, mesh: MeshLike, coord: Coord = None, experts: ExpertPlacement | None = None
) -> tuple[slice, ...]:
    """This rank's block of the global tensor, one slice per dim. For stacked experts the slice
    on dim 0 is over *physical* slots; ``expert_ids`` says which checkpoint experts fill them."""
    sizes = _axis_sizes(mesh)
    where = _coord_dict(mesh, coord)
    local = local_shape(spec, mesh, coord, experts)
    out = [slice(0, n) for n in local]
    for d, axis in _sharded_dims(spec, sizes).items():
        if axis not in where:
            raise ValueError(f"{spec.path}: coordinate {where} lacks mesh axis {axis!r}, which shards dim {d}")
        i = where[axis]
        if not 0 <= i < sizes[axis]:
            raise ValueError(f"{spec.path}: coordinate {axis}={i} is outside the axis (size {sizes[axis]})")
        out[d] = slice(i * local[d], (i + 1) * local[d])
    return tuple(out)


def expert_ids(
    spec: ParamSpec, mesh: MeshLike, coord: Coord = None, experts: ExpertPlacement | None = None
) -> list[int]:
    """The logical experts whose checkpoint tensors (``spec.key.format(e=i)``) this rank loads, in
    slot order; a replicated expert appears once per slot it fills. Goes through the EPLB
    placement's phys->logical map when one is given."""
    if not spec.stacked:
        raise ValueError(f"{spec.path}: not a stacked expert tensor")
    slots = local_slice(spec, mesh, coord, experts)[0]
    if experts is None:
        return list(range(slots.start, slots.stop))
    return list(experts.phys_to_logical[slots])
