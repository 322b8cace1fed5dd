"""The released models' memory plans: the fewest GPUs each needs and its state bytes a token,
held as released (MXFP4 experts, block-FP8 dense weights, the state in its trained format)
against dequantised (bf16 weights, the state in the model dtype).

    python -m deepinfer_fx.bench.memory_plans
    python -m deepinfer_fx.bench.memory_plans --max-model-len 65536 --max-num-seqs 16

Only the packaged config.json files are read (``config/released``), through the engine's own
``memory_plan`` (``generate --plan`` prints one plan). For each model, format and GPU (H200
141 GiB, H100 80 GiB): the smallest expert-parallel mesh of ``--meshes`` on which the plan fits
``--max-num-seqs`` sequences of ``--max-model-len`` tokens with compiled steps, its weights a GPU
and the sequences its pool would hold; the state a token (compressed entries and index keys)
and a sequence (window and compressor rings) do not depend on the mesh. A model that fits no
mesh listed gets ``gpus: null``. Writes ``bench/results/latest/<--name>.json``.
"""

from __future__ import annotations

import argparse

import torch

from ..config import load_config, released_config
from ..engine.memory_plan import GiB, memory_plan
from ..sharding.mesh import parse_mesh
from .p8 import run_info, write_result

MODELS = ("deepseek_v4_flash", "deepseek_v4_flash_0731_dspark", "deepseek_v41_flash", "deepseek_v4_pro")
# how ``load_model`` / ``init_state`` hold each form (generate's --expert-format, --dense-format, --kv-format)
FORMATS = {
    "released": {"expert_format": "auto", "dense_format": "auto", "kv_format": "trained"},
    "dequantised": {"expert_format": "dequant", "dense_format": "dequant", "kv_format": "model"},
}
GPUS = {"h200": 141.0, "h100": 80.0}


def smallest_fit(
    name: str, form: str, gpu_gib: float, meshes: list[str], max_model_len: int, max_num_seqs: int
) -> dict:
    """The first mesh of ``meshes`` on which release ``name`` held as ``form`` fits, as a result row."""
    c = load_config(released_config(name))
    row: dict = {"model": name, "format": form, "gpu_gib": gpu_gib, **FORMATS[form]}
    for mesh in meshes:
        plan = memory_plan(
            c,
            parse_mesh(mesh),
            gpu_memory_gib=gpu_gib,
            dtype=torch.bfloat16,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            **FORMATS[form],
        )
        row.update(
            state_bytes_per_token=round(plan.state_per_token, 2),
            state_bytes_per_sequence=plan.state_per_sequence,
            max_model_len=plan.max_model_len,
        )
        if plan.fits:
            return row | {
                "mesh": mesh,
                "gpus": plan.mesh.world_size,
                "weights_gib_per_gpu": round(plan.weights / GiB, 2),
                "host_gib_per_gpu": round(sum(h.bytes for h in plan.host) / GiB, 2),
                "sequences_per_gpu": plan.sequences,
            }
    return row | {"mesh": None, "gpus": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_fx.bench.memory_plans", description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="1,ep2,ep4,ep8,ep16,ep32,ep64", help="meshes tried, smallest first")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--name", default="memory_plans_released")
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    rows = [
        smallest_fit(name, form, gib, meshes, args.max_model_len, args.max_num_seqs)
        for name in MODELS
        for form in FORMATS
        for gib in GPUS.values()
    ]
    for r in rows:
        where = f"{r['gpus']} GPUs ({r['mesh']})" if r["gpus"] else "no mesh listed"
        print(
            f"{r['model']:<32} {r['format']:<12} {r['gpu_gib']:>5.0f} GiB: {where:<18} "
            f"state {r['state_bytes_per_token']:>8.1f} B/token + {r['state_bytes_per_sequence'] / 2**20:.2f} MiB/sequence"
        )
    result = {**run_info(argv), "gpus": GPUS, "rows": rows}
    print(write_result(args.name, result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
