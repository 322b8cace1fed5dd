"""Run by ``test_llm_mesh.py`` under torchrun: every rank builds ``LLM(ckpt, mesh=...)`` for each
mesh given and generates the same requests (SPMD), then rebalances the experts by the measured
loads and generates them again; every rank must get all outputs back, and rank 0 writes them to
a JSON file, with the swap places each mesh's runner held and, before and after the rebalance,
what each parameter is on the mesh (``placements``), and for compiled steps the collectives in
each graph (``collectives``). Usage: ``llm_mesh_job.py CKPT REQUESTS.json OUT.json MESH...``; a
mesh written ``ep2@compiled`` runs compiled steps."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from deepinfer_fx import LLM, SamplingParams, load_model
from deepinfer_fx.graphs.param_spec import iter_tree
from deepinfer_fx.sharding.dryrun import collectives
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


def graph_collectives(llm: LLM) -> dict[str, list[str]]:
    """Per compiled step graph (its ``GraphKey.name``): the kinds of functional collective its
    model part holds (``all_to_all_single``: EP's static capacity; ``all_gather_into_tensor``: CP)
    and ``ep_moe_ragged`` where it holds the ragged EP op (whose all-to-alls are inside it), so a
    test can tell a compiled step that shares its work from one that ran without its group."""
    steps = llm.runner.steps

    def kinds(gm) -> set[str]:
        ragged = any(getattr(n.target, "name", lambda: "")() == "deepinfer::ep_moe_ragged" for n in gm.graph.nodes)
        return {x.kind for x in collectives(gm, "")} | ({"ep_moe_ragged"} if ragged else set())

    # a key whose model part another key compiled first (the same bucket, another sampler) has no graphs
    graphs = {r["graph"]: steps.backend(r["graph"]).graphs for r in steps.report()}
    return {name: sorted(set().union(*map(kinds, gms))) for name, gms in graphs.items() if gms}


def outputs(outs: list) -> list:
    """Per request: its tokens, their logprobs and its prompt logprobs (None unless asked for)."""
    return [[o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs] for o in outs]


def main(ckpt: str, requests: str, out: str, meshes: list[str]) -> None:
    reqs = json.loads(open(requests).read())
    params = [SamplingParams(**r["params"]) for r in reqs]
    results = {}
    whole = dict(iter_tree(load_model(ckpt, dtype=torch.float32, fake_quant=False).params))
    for name in meshes:
        # "ep2@compiled": compiled steps (aot_eager on the CPU); no suffix: eager=True, the reference math
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
            eager=steps != "compiled",
            warmup=False,
        )
        results[f"{name}:swap places"] = sorted(llm.runner.swaps)
        results[f"{name}:placements"] = placements(llm, whole)
        outs = llm.generate([r["prompt"] for r in reqs], params)
        assert len(outs) == len(reqs), (name, dist.get_rank(), len(outs))
        results[name] = outputs(outs)
        if steps == "compiled":
            results[f"{name}:collectives"] = graph_collectives(llm)
        # EPLB mid-run: re-place the experts by the loads just measured, then serve again
        llm.rebalance_experts()
        results[f"{name}+eplb:placements"] = placements(llm, whole)
        outs = llm.generate([r["prompt"] for r in reqs], params)
        results[f"{name}+eplb"] = outputs(outs)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # Left to interpreter exit, gloo's threads of the several engines' groups were sometimes
    # torn down while joinable (std::terminate, SIGABRT) after the results were written.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
