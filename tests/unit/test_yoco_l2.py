"""examples/yoco/l2.py on a tiny random V4.1 checkpoint (CPU fp32): at the exact bound compact
and exact agree to the noise floor; at KEEP = the window the drift per position is reported."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "yoco"))
sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
import l2  # noqa: E402
from tiny import tiny_v41  # noqa: E402

import deepinfer_fx  # noqa: E402


def test_l2_reports_drift_per_position(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = tiny_v41()
    del cfg["engram_compressed_vocab_size"], cfg["engram_num_embeddings"]  # the writer derives them from its tokenizer
    deepinfer_fx.write_random_checkpoint(ckpt, cfg, seed=4)
    common = ["--model", str(ckpt), "--prompt-len", "40", "--decode", "3", "--chunk", "16"]
    exact = l2.main([*common, "--keep", "29", "--out", str(tmp_path / "l2.json")])  # window 8 + 3 x 7: exact
    assert len(exact["rows"]) == 4 and (tmp_path / "l2.json").exists()
    assert exact["max_abs"] <= max(10 * exact["noise_max_abs"], 1e-4), exact["max_abs"]
    bounded = l2.main([*common, "--keep", "8"])
    assert 0 < bounded["max_abs"] < 5.0
