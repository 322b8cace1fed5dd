"""Batch invariance across mesh shapes (CPU, gloo, tiny V4, fp32): with
``DEEPINFER_BATCH_INVARIANT=1`` in every rank, ``LLM(mesh=...)`` on ep2, dp2, cp2, ep4, dp2,ep2
and cp2,ep2 (also after an EPLB rebalance, and ep2 with compiled steps) gives the tokens and logprobs of one
process bit for bit, where that process runs other batch sizes and chunk splits. The ranks run
``llm_mesh_job.py`` (``test_llm_mesh.py``'s job) under torchrun."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from mesh_requests import mesh_requests
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams

JOB = Path(__file__).with_name("llm_mesh_job.py")
REPO = Path(deepinfer_fx.__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "ranks,meshes",
    [(2, ["ep2", "dp2", "cp2", "ep2@compiled"]), (4, ["ep4", "dp2,ep2", "cp2,ep2"])],
    ids=["2ranks", "4ranks"],
)
def test_mesh_equals_one_process_bit_for_bit(tmp_path: Path, ranks: int, meshes: list[str]) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    deepinfer_fx.write_random_checkpoint(ckpt, tiny_v4(), seed=seed)
    reqs = mesh_requests(rng)
    (tmp_path / "requests.json").write_text(json.dumps(reqs))
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "DEEPINFER_BATCH_INVARIANT": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(JOB),
        str(ckpt),
        str(tmp_path / "requests.json"),
        str(tmp_path / "out.json"),
        *meshes,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert r.returncode == 0, f"seed={seed}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    got = json.loads((tmp_path / "out.json").read_text())

    one = LLM(
        ckpt,
        dtype="float32",
        device="cpu",
        fake_quant=False,
        max_model_len=96,
        max_num_seqs=2,
        max_num_batched_tokens=13,
        batch_invariant=True,
        num_threads=1,
    )
    want = [
        [o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs]  # llm_mesh_job.outputs' fields
        for o in one.generate([q["prompt"] for q in reqs], [SamplingParams(**q["params"]) for q in reqs])
    ]
    want = json.loads(json.dumps(want))  # the job's JSON spelling (string keys)
    for mesh in [*meshes, *(f"{m}+eplb" for m in meshes)]:
        for i, (g, w) in enumerate(zip(got[mesh], want)):
            assert g == w, f"seed={seed} mesh={mesh} request {i}"
