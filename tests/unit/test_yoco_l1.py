"""examples/yoco/l1.py: compact prefill's pivot, keys, ring slots and compressed-entry ranges
agree with the independent computation over many lengths, chunkings and KEEP values, and a
deliberately shifted pivot is caught."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "yoco"))
import l1  # noqa: E402


def test_l1_passes_on_a_grid(capsys) -> None:
    # window 8 so that short prompts cross it many times; ratio 1 and 2 (a pooled first decoder layer)
    for ratio in ("1", "2"):
        assert (
            l1.main(
                [
                    "--lens",
                    "1,7,8,9,10,23,40",
                    "--chunks",
                    "whole,1,3,8,13",
                    "--keep",
                    "8,9,14,30",
                    "--window",
                    "8",
                    "--ratio",
                    ratio,
                ]
            )
            == 0
        )
    assert l1.main(["--lens", "129,300", "--chunks", "whole,100", "--keep", "128,140"]) == 0
    assert "0 mismatching case(s)" in capsys.readouterr().out


def test_l1_catches_a_shifted_pivot(capsys) -> None:
    for shift in ("1", "-1"):
        assert (
            l1.main(["--lens", "40", "--chunks", "whole,13", "--keep", "9", "--window", "8", "--shift-pivot", shift])
            == 1
        )
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "pivot 32" in out
