"""Run by ``test_llm_mesh.py`` under torchrun: every rank builds ``LLM(ckpt, mesh=...)`` for each
mesh given and generates the same requests (SPMD), then rebalances the experts by the measured
loads and generates them again; every rank must get all outputs back, and rank 0 writes them to
a JSON file, with the swap places each mesh's runner held and, before and after the rebalance,
what each parameter is on the mesh (``placements``). Usage: ``llm_mesh_job.py CKPT REQUESTS.json
OUT.json MESH...``; a mesh written ``ep2@compiled`` runs compiled steps, ``cp2@auto`` the
engine's default steps."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from deepinfer_fx import LLM, SamplingParams, load_model
from deepinfer_fx.graphs.param_spec import iter_tree
from deepinfer_fx.sharding.parallel import start_placement


def placements(llm: LLM, whole: dict) -> dict:
    """Per tensor leaf of ``llm.mesh_params``: its placements (``R`` / ``S(d)`` per mesh axis),
    global and local shape, whether its local view is the tensor the steps run on (same
    storage), and whether the gathered whole (``full_tensor``, a collective every rank joins) is
    the one-process tensor ``whole`` holds, its experts in the placement's slot order."""
    local = dict(iter_tree(llm.model.params))
    trunk = llm.ranks.ep.placement  # EPLB re-places the trunk's experts, a draft head's of that count too
    out = {}
    for path, leaf in iter_tree(llm.mesh_params):
        if not isinstance(leaf, DTensor):
            out[path] = type(leaf).__name__
            continue
        gathered = leaf.full_tensor()
        want = whole[path]
        if ".experts." in path:
            at = trunk if want.shape[0] == trunk.n_logical else start_placement(want.shape[0], llm.ranks.spec.ep)
            want = want[torch.as_tensor(at.phys_to_logical)]
        out[path] = {
            "placements": ["S(%d)" % p.dim if p.is_shard() else "R" for p in leaf.placements],
            "global": list(leaf.shape),
            "local": list(leaf.to_local().shape),
            "same storage": leaf.to_local().data_ptr() == local[path].data_ptr(),
            "whole equal": gathered.shape == want.shape and torch.equal(gathered, want),
        }
    return out


def main(ckpt: str, requests: str, out: str, meshes: list[str]) -> None:
    reqs = json.loads(open(requests).read())
    params = [SamplingParams(**r["params"]) for r in reqs]
    results = {}
    whole = dict(iter_tree(load_model(ckpt, dtype=torch.float32, fake_quant=False).params))
    for name in meshes:
        # "ep2@compiled": compiled steps (aot_eager on the CPU); "cp2@auto": the engine's default
        # (cp steps eagerly with the kernel swaps); no suffix: eager=True, the reference math
        mesh, _, steps = name.partition("@")
        llm = LLM(
            ckpt,
            dtype="float32",
            device="cpu",
            fake_quant=False,
            max_model_len=96,
            max_num_seqs=4,
            max_num_batched_tokens=48,
            mesh=mesh,
            eager={"compiled": False, "auto": None}.get(steps, True),
            warmup=False,
        )
        results[f"{name}:swap places"] = sorted(llm.runner.swaps)
        results[f"{name}:placements"] = placements(llm, whole)
        outs = llm.generate([r["prompt"] for r in reqs], params)
        assert len(outs) == len(reqs), (name, dist.get_rank(), len(outs))
        results[name] = [[o.outputs[0].token_ids, o.outputs[0].logprobs] for o in outs]
        # EPLB mid-run: re-place the experts by the loads just measured, then serve again
        llm.rebalance_experts()
        results[f"{name}+eplb:placements"] = placements(llm, whole)
        outs = llm.generate([r["prompt"] for r in reqs], params)
        results[f"{name}+eplb"] = [[o.outputs[0].token_ids, o.outputs[0].logprobs] for o in outs]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # Left to interpreter exit, gloo's threads of the several engines' groups were sometimes
    # torn down while joinable (std::terminate, SIGABRT) after the results were written.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
