"""``bench/timing.py::advances``: a step's kernel spans charged by how far each pushes the
timeline, so that overlapping (PDL) kernels and idle gaps add up to the step exactly."""

from __future__ import annotations

import os
import random

import pytest

from deepinfer_fx.bench.timing import advances


def test_overlaps_gaps_and_nested_spans() -> None:
    # out of order on purpose: charged in start order
    rows = advances([("c", 15.0, 20.0), ("a", 0.0, 10.0), ("b", 5.0, 12.0), ("d", 16.0, 18.0)])
    assert [r["kernel"] for r in rows] == ["a", "b", "c", "d"]
    assert [(r["advance"], r["gap"]) for r in rows] == [(10.0, 0.0), (2.0, 0.0), (5.0, 3.0), (0.0, 0.0)]
    assert [r["us"] for r in rows] == [10.0, 7.0, 5.0, 2.0]


@pytest.mark.parametrize("n", [1, 7, 300])
def test_advances_and_gaps_add_up_to_the_span(n: int) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    spans = []
    for i in range(n):
        start = rng.uniform(0, 100)
        spans.append((f"k{i}", start, start + rng.uniform(0, 10)))
    rows = advances(spans)
    total = sum(r["advance"] + r["gap"] for r in rows)
    span = max(e for _, _, e in spans) - min(s for _, s, _ in spans)
    assert total == pytest.approx(span, abs=1e-9), f"seed {seed}"
    assert all(r["advance"] >= 0 and r["gap"] >= 0 and r["advance"] <= r["us"] + 1e-12 for r in rows), f"seed {seed}"
