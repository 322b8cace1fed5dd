"""Run by ``test_llm_mesh.py`` under torchrun: every rank builds ``LLM(ckpt, mesh=...)`` for each
mesh given and generates the same requests (SPMD), then rebalances the experts by the measured
loads and generates them again; every rank must get all outputs back, and rank 0 writes them to
a JSON file, with the swap places each mesh's runner held. Usage: ``llm_mesh_job.py CKPT
REQUESTS.json OUT.json MESH...``; a mesh written ``ep2@compiled`` runs compiled steps,
``cp2@auto`` the engine's default steps."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from deepinfer_fx import LLM, SamplingParams


def main(ckpt: str, requests: str, out: str, meshes: list[str]) -> None:
    reqs = json.loads(open(requests).read())
    params = [SamplingParams(**r["params"]) for r in reqs]
    results = {}
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
        outs = llm.generate([r["prompt"] for r in reqs], params)
        assert len(outs) == len(reqs), (name, dist.get_rank(), len(outs))
        results[name] = [[o.outputs[0].token_ids, o.outputs[0].logprobs] for o in outs]
        # EPLB mid-run: re-place the experts by the loads just measured, then serve again
        llm.rebalance_experts()
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
