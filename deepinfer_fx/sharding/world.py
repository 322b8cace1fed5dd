"""The world DeviceMesh and its views, and a fake world for one-process dry runs.

One mesh for the whole job, axes in the fixed order ``MESH_AXES = ("dp", "cp", "ep")``, outermost
to innermost; every axis is present (size 1 when the mesh string leaves it out), so code can
always ask for ``mesh["ep"]`` and placements always have three entries.

Why this order: a rank's world index is ``(dp_i * cp + cp_i) * ep + ep_i``. ``ep`` innermost makes
the ranks of one EP group consecutive, which torchrun puts on one host as far as possible: the
MoE all-to-all, the heaviest collective, then stays on NVLink (and ``topology`` can map an EP rank
to its host as ``ep_rank // gpus_per_host``). ``cp`` next: the context-parallel exchange of KV
happens every attention layer of a long prefill. ``dp`` outermost: data-parallel attention has no
collective of its own.

Views (torchtitan's "one world mesh, sliced into views"):
- ``attention_view(mesh)``: the 2-D ``(dp, cp)`` submesh a rank's attention runs on;
- ``moe_view(mesh)``: the 1-D ``ep`` submesh the experts are sharded over.

Every process group the engine creates (the default group ``init_world`` joins, the mesh's
groups, the lock-step's) waits at most ``DEEPINFER_DIST_TIMEOUT`` seconds for a peer in any
collective, so a rank that stalls or dies ends the job instead of hanging it (gloo then raises
in the waiting ranks, which ``lockstep.LockStep`` turns into a message naming the silent ranks;
NCCL's watchdog ends the process after the same timeout).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..settings import DEFAULTS
from .mesh import AXES, MeshSpec

MESH_AXES: tuple[str, ...] = AXES  # ("dp", "cp", "ep"), outermost first; see the module docstring
ATTENTION_AXES: tuple[str, ...] = ("dp", "cp")
MOE_AXES: tuple[str, ...] = ("ep",)
TIMEOUT_VAR = "DEEPINFER_DIST_TIMEOUT"


def dist_timeout(seconds: float = DEFAULTS.dist_timeout) -> timedelta:
    """The collective timeout of every group the engine creates (it passes its
    ``DEEPINFER_DIST_TIMEOUT``; default 300 s)."""
    return timedelta(seconds=seconds)


def _with_timeout(device_type: str, timeout: timedelta) -> object | None:
    """Backend options that carry ``timeout`` for a mesh dimension's groups: DeviceMesh creates
    them with the backend's default (30 min gloo, 10 min NCCL) unless the options say otherwise.
    None for a backend whose options we do not know (its groups keep their default)."""
    backend = dist.get_backend()
    if device_type == "cuda" and backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()  # NCCL groups refuse options of another type
        opts._timeout = timeout
        return opts
    if device_type == "cpu" and backend == "gloo":
        return C10dBackend.Options("gloo", timeout)  # the type DeviceMesh's backend_override takes
    return None  # the fake group of a dry run, or a backend we did not start


def _launch_hint(n: int) -> str:
    return f"launch with torchrun --nproc-per-node {n} (or use fake_world({n}, rank) for a dry run)"


def build_mesh(spec: MeshSpec, device_type: str = "cpu", timeout: float = DEFAULTS.dist_timeout) -> DeviceMesh:
    """The world mesh of ``spec`` over the already initialised default process group; the groups
    it creates wait ``timeout`` seconds at most."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"mesh {spec} needs an initialised process group of {spec.world_size} ranks; {_launch_hint(spec.world_size)}"
        )
    world = dist.get_world_size()
    if world != spec.world_size:
        raise ValueError(
            f"mesh {spec} needs world size {spec.world_size} (dp {spec.dp} x cp {spec.cp} x ep {spec.ep}) "
            f"but the process group has {world} ranks; {_launch_hint(spec.world_size)}"
        )
    shape = tuple(getattr(spec, a) for a in MESH_AXES)
    opts = _with_timeout(device_type, dist_timeout(timeout))
    # an axis spanning the whole world reuses the default group (whose timeout init_world set, or
    # the caller's who initialised it): an override there would build a second world communicator
    override = {a: opts for a, n in zip(MESH_AXES, shape) if n != math.prod(shape)} if opts is not None else None
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES, backend_override=override or None)


def init_world(spec: MeshSpec, device_type: str = "cpu", timeout: float = DEFAULTS.dist_timeout) -> DeviceMesh:
    """The world mesh of a multi-rank run: joins the process group torchrun describes in the
    environment (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...) unless one is already up, with NCCL
    on GPUs (each rank on GPU ``LOCAL_RANK``) and gloo on the CPU, waiting ``timeout`` seconds at
    most in any collective (the engine passes ``DEEPINFER_DIST_TIMEOUT``); then ``build_mesh``."""
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=dist_timeout(timeout))
    return build_mesh(spec, device_type, timeout)


def attention_view(mesh: DeviceMesh) -> DeviceMesh:
    return mesh[ATTENTION_AXES]


def moe_view(mesh: DeviceMesh) -> DeviceMesh:
    return mesh[MOE_AXES[0]]


def mesh_spec_of(mesh: DeviceMesh) -> MeshSpec:
    """The MeshSpec a world mesh was built from (the inverse of ``build_mesh``)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != MESH_AXES:
        raise ValueError(f"not a world mesh: axes {names}, expected {MESH_AXES}")
    return MeshSpec(**dict(zip(MESH_AXES, mesh.shape)))


def rank_coordinate(spec: MeshSpec, rank: int) -> dict[str, int]:
    """``{"dp": i, "cp": j, "ep": k}`` of a world rank, without a process group (the loader and
    the dry run use it to ask what another rank would hold)."""
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} is outside mesh {spec} (world size {spec.world_size})")
    coord: dict[str, int] = {}
    for axis in reversed(MESH_AXES):  # innermost axis varies fastest
        size = getattr(spec, axis)
        coord[axis] = rank % size
        rank //= size
    return {a: coord[a] for a in MESH_AXES}


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks in this one process, as ``rank``.

    Collectives complete without moving data, so their values are NOT real: this is for building
    meshes, checking placements and tracing graphs (the ep64 dry run), never for numerics.
    """
    # the import registers the "fake" backend; it lives in torch's testing tree on 2.11 and 2.13
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank {rank} is outside world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
