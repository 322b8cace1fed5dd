"""Mesh strings: ``ep64``, ``ep8``, ``ep2,dp8``, ``ep2,cp8``, ``dp2,ep4``.

Parsing and validation only, so every entry point (CLI ``--mesh``, ``LLM(mesh=...)``,
``examples/offline_inference.py --ep/--dp/--cp``) rejects bad meshes the same way. Building the
``DeviceMesh`` itself belongs to the sharding work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AXES = ("dp", "cp", "ep")


@dataclass(frozen=True)
class MeshSpec:
    dp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        # one world mesh with named axes: its size is the product of the degrees
        return self.dp * self.cp * self.ep

    def __str__(self) -> str:
        return ",".join(f"{a}{getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "1"


def mesh_from_degrees(dp: int = 1, cp: int = 1, ep: int = 1) -> MeshSpec:
    for name, v in (("dp", dp), ("cp", cp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"mesh degree {name} must be a positive integer, got {v!r}")
    return MeshSpec(dp, cp, ep)


def parse_mesh(text: str) -> MeshSpec:
    """``"ep2,dp8"`` -> MeshSpec(dp=8, ep=2...) with a clear error for anything malformed."""
    text = text.strip().lower()
    if text in ("", "1"):
        return MeshSpec()
    degrees: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"(dp|cp|ep)(\d+)", part.strip())
        if m is None:
            raise ValueError(f"bad mesh {text!r}: each part is an axis (dp, cp, ep) and a degree, e.g. 'ep8' or 'ep2,dp4'")
        axis, deg = m.group(1), int(m.group(2))
        if axis in degrees:
            raise ValueError(f"bad mesh {text!r}: axis {axis} given twice")
        degrees[axis] = deg
    return mesh_from_degrees(**degrees)
