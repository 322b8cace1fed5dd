"""``--dump-graphs DIR``: every compiled graph, as captured and after each pass, on disk.

Layout, for a graph named by its caller (kind and bucket, e.g. ``decode-t64-r8``)::

    DIR/index.json, DIR/index.md          every graph dumped under DIR
    DIR/decode-t64-r8/00-captured.py      the graph Dynamo captured (torch level)
    DIR/decode-t64-r8/01-aten.py          the ATen graph the passes receive
    DIR/decode-t64-r8/02-rms_norm_fusion.py   after that pass
    DIR/decode-t64-r8/02-rms_norm_fusion.diff unified diff against the stage before
    ...
    DIR/decode-t64-r8/index.json, index.md    the stages, rewrites per pass, pass uuids

A name compiled more than once (a graph break, a recompile) gets ``name.1``, ``name.2``, ...
Indexes are rewritten after every stage, so a compile that crashes midway still leaves a
readable dump of how far it got.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.fx

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def graph_name(kind: str, **bucket: int) -> str:
    """``graph_name("decode", t=64, r=8)`` -> ``"decode-t64-r8"``: the dump (and log) name of
    one graph key; bucket fields in the order given."""
    return "-".join([kind, *(f"{k}{v}" for k, v in bucket.items())])


def graph_text(gm: torch.fx.GraphModule) -> str:
    """Readable Python for the graph, with shapes and dtypes where the nodes carry them."""
    return gm.print_readable(print_output=False)


@dataclass
class Stage:
    file: str
    label: str
    diff: str | None = None  # the unified diff file (pass stages only)
    rewrites: int | None = None
    uuid: str | None = None
    declined: tuple[str, ...] = ()  # why the pass left calls to the reference (kernel swaps)


@dataclass
class GraphDump:
    """The dump of one compiled graph; ``stage`` is called once per stage, in order."""

    root: Path
    name: str
    pipeline: dict = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)
    _last_text: str | None = None

    @property
    def dir(self) -> Path:
        return self.root / self.name

    def stage(
        self,
        label: str,
        gm: torch.fx.GraphModule,
        *,
        rewrites: int | None = None,
        uuid: str | None = None,
        diff: bool = True,
        declined: tuple[str, ...] = (),
    ) -> None:
        """Write the graph after ``label``; with ``diff``, also its unified diff against the
        previous stage (passes get one; the first stages have nothing comparable before)."""
        text = graph_text(gm)
        stem = f"{len(self.stages):02d}-{_SAFE.sub('_', label)}"
        (self.dir / f"{stem}.py").write_text(text)
        diff_file = None
        if diff and self._last_text is not None:
            prev = self.stages[-1].file
            lines = difflib.unified_diff(
                self._last_text.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=prev,
                tofile=f"{stem}.py",
            )
            diff_file = f"{stem}.diff"
            (self.dir / diff_file).write_text("".join(lines))
        self.stages.append(Stage(f"{stem}.py", label, diff_file, rewrites, uuid, tuple(declined)))
        self._last_text = text
        self._write_index()

    def _write_index(self) -> None:
        data = {"name": self.name, "pipeline": self.pipeline, "stages": [asdict(s) for s in self.stages]}
        (self.dir / "index.json").write_text(json.dumps(data, indent=2) + "\n")
        rows = [f"# {self.name}", ""]
        if self.pipeline:
            rows += [f"pipeline: `{json.dumps(self.pipeline)}`", ""]
        rows += ["| stage | graph | diff | rewrites | declined |", "|---|---|---|---|---|"]
        for s in self.stages:
            diff = f"[{s.diff}]({s.diff})" if s.diff else ""
            rewrites = "" if s.rewrites is None else str(s.rewrites)
            rows.append(f"| {s.label} | [{s.file}]({s.file}) | {diff} | {rewrites} | {'; '.join(s.declined)} |")
        (self.dir / "index.md").write_text("\n".join(rows) + "\n")
        _write_root_index(self.root)


def start_dump(root: str | Path, name: str, pipeline: dict | None = None) -> GraphDump:
    """A fresh dump directory for graph ``name`` under ``root`` (suffixed if taken)."""
    root = Path(root)
    base = _SAFE.sub("_", name) or "graph"
    chosen, i = base, 0
    while (root / chosen).exists():
        i += 1
        chosen = f"{base}.{i}"
    (root / chosen).mkdir(parents=True)
    return GraphDump(root, chosen, dict(pipeline or {}))


def _write_root_index(root: Path) -> None:
    """Rebuilt from the per-graph indexes, so several backends may share one dump dir."""
    graphs = []
    for idx in sorted(root.glob("*/index.json")):
        data = json.loads(idx.read_text())
        graphs.append({"name": data["name"], "stages": [s["label"] for s in data["stages"]]})
    (root / "index.json").write_text(json.dumps({"graphs": graphs}, indent=2) + "\n")
    rows = ["# graph dumps", "", "| graph | stages |", "|---|---|"]
    rows += [f"| [{g['name']}]({g['name']}/index.md) | {' → '.join(g['stages'])} |" for g in graphs]
    (root / "index.md").write_text("\n".join(rows) + "\n")
