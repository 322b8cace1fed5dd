"""A plain clone carries what it needs: no path outside the repository in its code, docs or build
files, and the released configs as package data behind one API."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from deepinfer_fx.config import load_config
from deepinfer_fx.config import RELEASED, released_config
from deepinfer_fx.config.releases import RELEASED_DIR

REPO = Path(__file__).resolve().parents[2]
SCANNED = (".py", ".toml", ".md")
SKIP_DIRS = {".git", "__pycache__", "build", "dist", ".venv", ".pytest_cache"}
# Machine-specific roots and ways of climbing out of the checkout (this file spells them, so it is exempt).
OUTSIDE = re.compile(
    r"/work/|/home/[A-Za-z]|/Users/|/root/|\.\./shared|shared/spec|[\"']shared[\"']\s*/|\.parents\[\d+\]\.parent\b"
)


def _files() -> list[Path]:
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix in SCANNED or rel.as_posix() == ".ci/run":
            out.append(p)
    return out


def test_no_absolute_or_out_of_repo_paths() -> None:
    me = Path(__file__).resolve()
    hits = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in _files()
        if p != me
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert len(_files()) > 50, "the scan found almost nothing: wrong repository root?"
    assert not hits, "paths outside the repository (a plain clone has none of them):\n" + "\n".join(hits)


def test_released_configs_are_package_data() -> None:
    assert set(RELEASED) >= {
        "deepseek_v4_flash",
        "deepseek_v4_pro",
        "deepseek_v4_flash_0731_dspark",
        "deepseek_v41_flash",
    }
    for name in RELEASED:
        assert released_config(name).parent == RELEASED_DIR and json.loads(released_config(name).read_text())
    assert load_config(released_config("deepseek_v41_flash")).model_type.startswith("deepseek_v41")
    # what `pip install` and a wheel copy: the package-data globs must cover every packaged file
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["deepinfer_fx.config"]
    base = RELEASED_DIR.parent
    assert {p for g in globs for p in base.glob(g)} == set(RELEASED_DIR.glob("*.json"))


def test_unknown_release_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no released config named 'deepseek_v5'; known: .*deepseek_v41_flash"):
        released_config("deepseek_v5")
