"""Mesh strings: the issue's meshes parse, bad ones fail with one line that names the problem
(unknown axis, degrees that do not nest, a world size that does not match the launch)."""

from __future__ import annotations

import pytest

from deepinfer_fx.sharding.mesh import MeshSpec, mesh_from_degrees, parse_mesh
from deepinfer_fx.sharding.world import build_mesh, fake_world


@pytest.mark.parametrize(
    "text, degrees",
    [
        ("ep64", (1, 1, 64)),
        ("ep8", (1, 1, 8)),
        ("ep2,dp8", (8, 1, 2)),
        ("ep2,cp8", (1, 8, 2)),
        ("dp2,ep4", (2, 1, 4)),
        ("cp2,ep8", (1, 2, 8)),
        ("cp3", (1, 3, 1)),
        (" DP2 , EP4 ", (2, 1, 4)),
        ("1", (1, 1, 1)),
    ],
)
def test_good_meshes_parse(text: str, degrees: tuple[int, int, int]) -> None:
    spec = parse_mesh(text)
    assert (spec.dp, spec.cp, spec.ep) == degrees
    assert spec.world_size == degrees[0] * degrees[1] * degrees[2]
    assert parse_mesh(str(spec)) == spec == mesh_from_degrees(*degrees)


def _one_line_error(make, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as err:
        make()
    assert "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("cp3,ep4", r"bad mesh cp3,ep4: cp3 and ep4 must nest \(one divides the other\).*DeepInfer"),
        ("dp2,cp6,ep4", r"cp6 and ep4 must nest"),
        ("tp2", r"bad mesh 'tp2': unknown axis 'tp' \(the axes are dp, cp, ep\)"),
        ("ep2,pp4", r"unknown axis 'pp'"),
        ("ep0", r"degree ep must be a positive integer, got 0"),
        ("ep2,ep4", r"axis ep given twice"),
        ("ep", r"each part is an axis"),
        ("ep2;dp2", r"each part is an axis"),
    ],
)
def test_bad_mesh_strings(text: str, pattern: str) -> None:
    _one_line_error(lambda: parse_mesh(text), pattern)


def test_bad_degrees_fail_the_same_way_from_every_entry_point() -> None:
    _one_line_error(lambda: mesh_from_degrees(cp=3, ep=4), "cp3 and ep4 must nest")
    _one_line_error(lambda: MeshSpec(cp=4, ep=6), "cp4 and ep6 must nest")
    _one_line_error(lambda: mesh_from_degrees(dp=-1), "degree dp must be a positive integer")


def test_world_size_must_match_the_launch() -> None:
    with fake_world(4, 1):
        _one_line_error(
            lambda: build_mesh(parse_mesh("ep3")),
            r"mesh ep3 needs world size 3 \(dp 1 x cp 1 x ep 3\) but the process group has 4 ranks; launch with torchrun --nproc-per-node 3",
        )
        assert build_mesh(parse_mesh("dp2,ep2")).shape == (2, 1, 2)
