"""What ``bench/mesh.py`` sets up before it runs: the meshes checked against the launched world,
each rank's device, the model's widths, the prompts; NVLink multicast off; memory freed between engines."""

from __future__ import annotations

import gc
import os
import random

import torch

from ..config import ModelConfig, config_from_dict
from ..demo import DEMO_CONFIG
from ..sharding.mesh import MeshSpec, parse_mesh
from .p8 import P8, p8_config

# the device README: NVLink multicast stays off on the lent machines
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (``--prompt-lens 7,33``)."""
    return [int(x) for x in text.split(",") if x.strip()]


def world_meshes(texts: list[str]) -> list[MeshSpec]:
    """The meshes asked for, checked against the launched world; one-line errors."""
    try:
        specs = [parse_mesh(t) for t in texts]
    except ValueError as e:
        raise SystemExit(f"mesh bench: {e}") from None
    sizes = sorted({s.world_size for s in specs})
    if sizes[0] == 1:
        raise SystemExit("mesh bench: every mesh needs 2+ ranks (the one-process reference runs on rank 0 by itself)")
    if len(sizes) > 1:
        raise SystemExit(
            f"mesh bench: meshes {' '.join(texts)} need different world sizes {sizes}; launch once per world size"
        )
    n = sizes[0]
    launched = os.environ.get("WORLD_SIZE")
    if launched is None:
        raise SystemExit(
            f"mesh bench: mesh {specs[0]} needs {n} processes; launch with torchrun --nproc-per-node {n} -m deepinfer_fx.bench.mesh ..."
        )
    if int(launched) != n:
        raise SystemExit(
            f"mesh bench: mesh {specs[0]} needs {n} ranks but torchrun started {launched}; use --nproc-per-node {n}"
        )
    return specs


def rank_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise SystemExit(
            f"mesh bench: local rank {local} has no GPU ({torch.cuda.device_count()} visible); lower --nproc-per-node"
        )
    return torch.device("cuda", local)


def model_config(tiny: bool, layers: int) -> ModelConfig:
    base = {k: v for k, v in DEMO_CONFIG.items() if k not in ("quantization_config", "expert_dtype")} if tiny else P8
    most = base["num_hidden_layers"]
    if not 1 <= layers <= most:
        raise SystemExit(
            f"mesh bench: --layers must lie in [1, {most}] for the {'demo' if tiny else 'P8'} widths, got {layers}"
        )
    cut = {
        "num_hidden_layers": layers,
        "compress_ratios": base["compress_ratios"][:layers],
        "num_hash_layers": min(base["num_hash_layers"], layers),
        "num_nextn_predict_layers": 0,
    }
    return (
        p8_config(**cut)
        if not tiny
        else config_from_dict({**base, **cut}, where="demo widths").replace(fake_quant=False)
    )


def make_prompts(n: int, lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lens[i % len(lens)])] for i in range(n)]


def free_memory(device: torch.device) -> None:
    """Drop a finished engine's memory before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
