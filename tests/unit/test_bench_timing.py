"""``bench/timing.py``: ``advances`` charges a step's kernel spans by how far each pushes the
timeline, so that overlapping (PDL) kernels and idle gaps add up to the step exactly;
``step_spans`` cuts back-to-back steps at their input copies and measures what lies between."""

from __future__ import annotations

import os
import random

import pytest

from deepinfer_fx.bench.timing import advances, step_spans


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


def test_step_spans_cut_at_each_copy() -> None:
    # three steps: a copy, then kernels that overlap (PDL); the second step starts late
    spans = [
        ("Memcpy HtoD (Pinned -> Device)", 0.0, 1.0),
        ("k1", 2.0, 10.0),
        ("k2", 9.0, 12.0),
        ("Memcpy HtoD (Pinned -> Device)", 13.0, 14.0),
        ("k1", 17.0, 25.0),
        ("k2", 20.0, 23.0),
        ("Memcpy HtoD (Pinned -> Device)", 26.0, 27.0),
        ("k1", 28.0, 30.0),
    ]
    random.Random(int.from_bytes(os.urandom(4), "little")).shuffle(spans)  # charged in start order
    out = step_spans(spans)
    assert out["steps"] == 3
    assert out["span_us"] == pytest.approx((10.0 + 8.0 + 2.0) / 3, abs=0.01)
    assert out["between_us"] == pytest.approx((5.0 + 3.0) / 2) and out["between_max_us"] == 5.0


def test_step_spans_of_one_step_and_of_none() -> None:
    assert step_spans([("k", 1.0, 4.0)]) == {"steps": 1, "span_us": 3.0, "between_us": 0.0, "between_max_us": 0.0}
    assert step_spans([])["steps"] == 0
