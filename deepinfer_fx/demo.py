"""The built-in tiny demo model: a V4 config at toy widths with a real tokenizer and RANDOM
weights (its text is gibberish), written on first use to ``DEEPINFER_DEMO_DIR`` (default
``~/.cache/deepinfer_fx/demo-v4-tiny``). The CLI and ``LLM(model="demo")`` both run it."""

from __future__ import annotations

from pathlib import Path

from .config.tiny import tiny_v4
from .settings import setting

# tiny_v4 at twice the width, block-FP8 dense weights and MXFP4 experts as the released V4-Flash
# stores them, and a 1024-token vocabulary for its tokenizer
DEMO_CONFIG = tiny_v4(
    vocab_size=1024,
    hidden_size=128,
    q_lora_rank=64,
    o_lora_rank=32,
    moe_intermediate_size=64,
    sliding_window=16,
    compress_ratios=[0, 4, 128, 4, 0],
    index_topk=8,
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    torch_dtype="bfloat16",
    expert_dtype="fp4",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
)


def demo_dir() -> Path:
    """Where the demo checkpoint lives (read when asked, so a changed setting is seen)."""
    return Path(setting("DEEPINFER_DEMO_DIR") or Path.home() / ".cache" / "deepinfer_fx" / "demo-v4-tiny")


def demo_model_dir() -> Path:
    """The demo checkpoint's directory, written first if it is not there yet."""
    path = demo_dir()
    if not (path / "model.safetensors.index.json").exists():
        from .io.writer import write_random_checkpoint

        write_random_checkpoint(path, DEMO_CONFIG, seed=0)
    return path
