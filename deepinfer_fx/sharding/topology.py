"""The hardware that expert placement runs on: hosts, GPUs per host, link bandwidths.

This plays the role DeepInfer's ``deep_cluster/`` plays: a small, explicit description that the
EPLB placement (``eplb.plan_placement``) consults instead of guessing from the process group.

What placement uses today, and what it may use later:

- **ranks-per-host grouping** (used): EP ranks are numbered so that rank ``r`` lives on host
  ``r // gpus_per_host``. This holds because ``ep`` is the innermost axis of the world mesh
  (see ``world.MESH_AXES``), so the ranks of one EP group are consecutive world ranks, and
  torchrun hands out consecutive ranks per host. Placement spreads the replicas of one hot expert
  over different hosts first, so every host keeps a copy reachable over NVLink and a future
  locality-aware router can avoid the network for it.
- **bandwidths** (recorded, not yet used): NVLink inside a host and the network between hosts.
  A bandwidth-aware cost (bytes of all-to-all per link) can be added without changing callers.

Sources, in order: an explicit ``Topology``; ``topology_for(path)`` reading a JSON file (the
engine's EPLB passes ``DEEPINFER_TOPOLOGY_FILE``); otherwise ``Topology.default(world)``: hosts
of 8 GPUs (one host for world sizes up to 8), H200-class links.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config.fields import read_json_object

TOPOLOGY_ENV = "DEEPINFER_TOPOLOGY_FILE"  # EngineConfig.topology_file

# Per-GPU unidirectional bandwidths in GB/s of an H200 node: NVLink 4 (18 links x 25 GB/s) and one
# 400 Gb/s NIC per GPU. Only ratios matter to a placement cost, so round numbers are fine.
_NVLINK_GBPS = 450.0
_NETWORK_GBPS = 50.0


@dataclass(frozen=True)
class Topology:
    hosts: int = 1
    gpus_per_host: int = 8
    nvlink_gbps: float = _NVLINK_GBPS  # inside a host
    network_gbps: float = _NETWORK_GBPS  # between hosts

    def __post_init__(self) -> None:
        # validate at construction so a bad JSON file fails where it is read, not mid-placement
        for name in ("hosts", "gpus_per_host"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"topology: '{name}' must be a positive integer, got {v!r}")
        for name in ("nvlink_gbps", "network_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"topology: '{name}' must be a positive number, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.hosts * self.gpus_per_host

    @classmethod
    def default(cls, world_size: int = 8) -> "Topology":
        """Hosts of 8 GPUs: one host up to 8 ranks, ceil(world / 8) hosts beyond (ep64 -> 8 hosts)."""
        if world_size < 1:
            raise ValueError(f"topology: world size must be positive, got {world_size}")
        per_host = min(8, world_size)
        return cls(hosts=math.ceil(world_size / per_host), gpus_per_host=per_host)

    def host_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this topology ({self.hosts} hosts x {self.gpus_per_host} GPUs)")
        return rank // self.gpus_per_host

    def ranks_of_host(self, host: int) -> range:
        return range(host * self.gpus_per_host, (host + 1) * self.gpus_per_host)

    def bandwidth(self, a: int, b: int) -> float:
        """GB/s between two ranks; a rank to itself is a local copy (reported as infinite)."""
        if a == b:
            return math.inf
        return self.nvlink_gbps if self.host_of(a) == self.host_of(b) else self.network_gbps

    def check_covers(self, ranks: int) -> None:
        """An EP group of ``ranks`` must fit on this hardware; say so plainly when it does not."""
        if ranks > self.world_size:
            raise ValueError(
                f"topology describes {self.world_size} GPUs ({self.hosts} hosts x {self.gpus_per_host}) "
                f"but the EP degree is {ranks}; describe the cluster in ${TOPOLOGY_ENV} (JSON)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "topology") -> "Topology":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def load_topology(path: str | os.PathLike) -> Topology:
    """A topology from a JSON file such as ``{"hosts": 8, "gpus_per_host": 8}``."""
    p = Path(path)
    return Topology.from_dict(read_json_object(p, "topology file not found"), where=str(p))


def topology_for(path: str | os.PathLike | None, world_size: int = 8) -> Topology:
    """The topology in the JSON file ``path`` (the engine passes ``DEEPINFER_TOPOLOGY_FILE``),
    else the default for ``world_size`` ranks."""
    if path:
        return load_topology(path)
    return Topology.default(world_size)
