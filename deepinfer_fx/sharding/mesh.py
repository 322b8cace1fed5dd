"""Mesh strings: ``ep64``, ``ep8``, ``ep2,dp8``, ``ep2,cp8``, ``dp2,ep4``.

Parsing and validation only, so every entry point (CLI ``--mesh``, ``LLM(mesh=...)``,
``examples/offline_inference.py --ep/--dp/--cp``) rejects bad meshes the same way, each with a
one-line error; ``world.build_mesh`` then checks the degrees against the launched world size.

The one rule between axes: **cp and ep must nest** (one divides the other). The issue asks for
DeepInfer's benchmark rule (cp divides the EP degree) and also lists ``ep2,cp8`` (ep divides cp);
nesting admits both. What it keeps possible: whichever degree is smaller splits the larger one into
equal blocks, so the context-parallel work can pair CP groups with EP groups block for block (EP
groups made of whole CP groups, or CP groups made of whole EP groups). ``cp3`` with ``ep4`` has no
such pairing and is refused.
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

    def __post_init__(self) -> None:
        for name in AXES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"bad mesh: degree {name} must be a positive integer, got {v!r}")
        if self.cp % self.ep and self.ep % self.cp:
            raise ValueError(
                f"bad mesh {self}: cp{self.cp} and ep{self.ep} must nest (one divides the other): DeepInfer's benchmark "
                f"rule is cp dividing ep, meshes like ep2,cp8 have ep dividing cp, and a pair doing neither cannot be "
                f"split into equal blocks of the smaller group"
            )

    @property
    def world_size(self) -> int:
        # one world mesh with named axes: its size is the product of the degrees
        return self.dp * self.cp * self.ep

    def __str__(self) -> str:
        return ",".join(f"{a}{getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "1"


def mesh_from_degrees(dp: int = 1, cp: int = 1, ep: int = 1) -> MeshSpec:
    """The ``--dp/--cp/--ep`` form of a mesh (``MeshSpec`` checks the degrees)."""
    return MeshSpec(dp, cp, ep)


def parse_mesh(text: str) -> MeshSpec:
    """``"ep2,dp8"`` -> MeshSpec(dp=8, ep=2...) with a one-line error for anything malformed."""
    text = text.strip().lower()
    if text in ("", "1"):
        return MeshSpec()
    degrees: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"([a-z]+)(\d+)", part.strip())
        if m is None:
            raise ValueError(
                f"bad mesh {text!r}: each part is an axis (dp, cp, ep) and a degree, e.g. 'ep8' or 'ep2,dp4'"
            )
        axis, deg = m.group(1), int(m.group(2))
        if axis not in AXES:
            raise ValueError(f"bad mesh {text!r}: unknown axis {axis!r} (the axes are dp, cp, ep)")
        if axis in degrees:
            raise ValueError(f"bad mesh {text!r}: axis {axis} given twice")
        degrees[axis] = deg
    return mesh_from_degrees(**degrees)
