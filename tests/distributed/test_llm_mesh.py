"""``LLM(model=..., mesh=...)`` under torchrun: two ranks serving ep2 (experts split, one all-to-all
group), dp2 (experts replicated) and cp2 (both ranks serve every request, prefill chunks split
over them; eager, and compiled with the static split) produce the tokens and logprobs of one
process, for greedy and seeded sampled requests of different lengths (some ranks finish early and
idle through the others' steps), also after an EPLB rebalance between two generate calls, with
eager and with compiled steps; four ranks serve dp2 x ep2. On every mesh each parameter is a DTensor with the placements the sharding
rules give (``LLM.mesh_params``), whose local view is the tensor the steps run on and whose
gathered whole is the one-process tensor. One torchrun launch runs every mesh of a test: a
launch costs ~20 s here, compiling ~60 s more."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from mesh_requests import cp_requests, mesh_requests
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.graphs.param_spec import iter_tree
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.sharding.mesh import parse_mesh
from deepinfer_fx.sharding.parallel import start_placement

JOB = Path(__file__).with_name("llm_mesh_job.py")
REPO = Path(deepinfer_fx.__file__).resolve().parents[1]


def _check_placements(got: dict, mesh: str, one: LLM) -> None:
    """Every parameter of the one-process tree is on ``mesh`` as the design has it: routed experts
    (stacked, ``{e}`` keys) sharded on dim 0 over ``ep`` with every physical slot in the whole
    shape, everything else replicated; each local view is the steps' tensor and gathers to the
    one-process weight (the job checks both on every rank)."""
    spec = parse_mesh(mesh.partition("@")[0])
    specs = {s.path: s for s in param_specs(one.model.config)}
    tensors = {p: v for p, v in iter_tree(one.model.params) if isinstance(v, torch.Tensor)}
    for when in ("", "+eplb"):
        placed = got[f"{mesh}{when}:placements"]
        assert {p for p, v in placed.items() if isinstance(v, dict)} == set(tensors), (mesh, when)
        for path, t in tensors.items():
            row, s = placed[path], specs.get(path)
            shape = list(t.shape)
            if s is not None and s.stacked:
                whole = [start_placement(shape[0], spec.ep).n_physical, *shape[1:]]
                want = (["R", "R", "S(0)"], whole, [whole[0] // spec.ep, *shape[1:]])
            else:
                want = (["R", "R", "R"], shape, shape)
            assert (row["placements"], row["global"], row["local"]) == want, (mesh, when, path)
            assert row["same storage"] and row["whole equal"], (mesh, when, path, row)


def _meshes_equal_one_process(
    tmp_path: Path,
    meshes: list[str],
    ranks: int = 2,
    requests: Callable[[random.Random], list[dict]] = mesh_requests,
) -> dict:
    """Launch ``llm_mesh_job.py`` on ``ranks`` ranks over ``meshes``; each mesh's outputs (before
    and after its EPLB rebalance) == one eager process: tokens equal, logprobs (and prompt
    logprobs, where asked for) within 1e-5; its parameters placed as ``_check_placements`` says."""
    seed = random.SystemRandom().randrange(2**31)
    ckpt = tmp_path / "ckpt"
    deepinfer_fx.write_random_checkpoint(ckpt, tiny_v4(), seed=seed)
    reqs = requests(random.Random(seed))
    (tmp_path / "requests.json").write_text(json.dumps(reqs))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
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
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"seed={seed}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    got = json.loads((tmp_path / "out.json").read_text())

    one = LLM(
        ckpt,
        dtype="float32",
        device="cpu",
        fake_quant=False,
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=48,
    )
    first = one.generate([q["prompt"] for q in reqs], [SamplingParams(**q["params"]) for q in reqs])
    again = one.generate(
        [q["prompt"] for q in reqs], [SamplingParams(**q["params"]) for q in reqs]
    )  # later request ids
    for mesh in meshes:
        _check_placements(got, mesh, one)
    runs = [(m, first) for m in meshes] + [(f"{m}+eplb", again) for m in meshes]
    for mesh, want in runs:
        for i, (w, (ids, lps, prompt_lps)) in enumerate(zip(want, got[mesh])):
            where = f"seed={seed} mesh={mesh} request {i}"
            assert ids == w.outputs[0].token_ids, where
            assert (prompt_lps is None) == (w.prompt_logprobs is None), where
            for a, b in zip(lps + (prompt_lps or []), w.outputs[0].logprobs + (w.prompt_logprobs or [])):
                assert (a is None) == (b is None), where
                assert {int(k) for k in a or {}} == set(b or {}), where
                assert all(abs(a[str(k)] - v) <= 1e-5 for k, v in (b or {}).items()), where
    return got


def test_llm_on_ep2_dp2_cp2_equals_one_process(tmp_path) -> None:
    _meshes_equal_one_process(tmp_path, ["ep2", "dp2", "cp2"])


def test_compiled_steps_on_ep2_dp2_equal_one_process(tmp_path) -> None:
    """Compiled steps (aot_eager on the CPU): the ranks agree each turn on the decode and prefill
    graphs and their buckets, so ranks with less work (or none) pad and the all-to-alls pair up;
    the EPLB shuffle drops the graphs, which are traced again. On ep2 the decode graphs send the
    static capacity and the prefill graphs the routed pairs alone (the ragged op); dp2's EP
    groups have one rank: no exchange at all."""
    got = _meshes_equal_one_process(tmp_path, ["ep2@compiled", "dp2@compiled"])
    for mesh, want in (("ep2", {"decode": ["all_to_all_single"], "prefill": ["ep_moe_ragged"]}), ("dp2", {})):
        graphs = got[f"{mesh}@compiled:collectives"]
        assert {g.split("-")[0] for g in graphs} == {"prefill", "decode"}, graphs
        for graph, kinds in graphs.items():
            assert kinds == want.get(graph.split("-")[0], []), (mesh, graphs)


def test_compiled_cp2_equals_one_process(tmp_path) -> None:
    """Compiled context parallelism (aot_eager on the CPU): each prefill bucket split statically
    over the two ranks (prompts of no multiple of 4 tokens, a chunked prompt, a step with every
    row's logits), decode steps whole on both; the eager cp2 beside it. Every compiled prefill
    graph holds the CP all-gather and no decode graph does, so the steps ran compiled and split."""
    got = _meshes_equal_one_process(tmp_path, ["cp2", "cp2@compiled"], requests=cp_requests)
    graphs = got["cp2@compiled:collectives"]
    assert {g.split("-")[0] for g in graphs} == {"prefill", "decode"}, graphs
    for graph, kinds in graphs.items():
        assert kinds == (["all_gather_into_tensor"] if graph.startswith("prefill") else []), graphs


def test_compiled_cp2_ep2_equals_one_process(tmp_path) -> None:
    """Four ranks, compiled: each prefill bucket split over the CP pair, and its MoE sending only
    the routed pairs within each EP pair (the ragged op, inside the split prefill graph); decode
    graphs whole on every rank, sending the static capacity of their own bucket."""
    got = _meshes_equal_one_process(tmp_path, ["cp2,ep2@compiled"], ranks=4, requests=cp_requests)
    graphs = got["cp2,ep2@compiled:collectives"]
    assert {g.split("-")[0] for g in graphs} == {"prefill", "decode"}, graphs
    for graph, kinds in graphs.items():
        want = ["all_gather_into_tensor", "ep_moe_ragged"] if graph.startswith("prefill") else ["all_to_all_single"]
        assert kinds == want, graphs


def test_llm_on_dp2_ep2_equals_one_process(tmp_path) -> None:
    """Four ranks: two EP groups of two, each holding every expert once between its ranks."""
    _meshes_equal_one_process(tmp_path, ["dp2,ep2"], ranks=4)


def test_mesh_errors_before_any_work(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    deepinfer_fx.write_random_checkpoint(ckpt, tiny_v4(), seed=3)
    with pytest.raises(
        ValueError,
        match=r"mesh ep2 has 2 ranks but this process was not started by torchrun; launch it under torchrun --nproc-per-node 2",
    ):
        LLM(ckpt, dtype="float32", device="cpu", mesh="ep2")
    with pytest.raises(
        ValueError,
        match=r"mesh cp2,ep2 has 4 ranks but this process was not started by torchrun; launch it under torchrun --nproc-per-node 4",
    ):
        LLM(ckpt, dtype="float32", device="cpu", mesh="cp2,ep2")
