"""Run by ``test_spec_mesh.py`` under torchrun: for each run given, every rank builds
``LLM(model, mesh=..., speculative_config=...)`` over the same in-memory model and generates the
same requests (``mesh_requests.spec_requests``, SPMD). Models: ``test_spec_drafters.drafting``
(a target whose greedy text cycles, with an MTP-1 block that drafts the cycle part of the time;
DSpark's for ``dspark``) and, for ``oracle``, the random tiny V4 of ``test_spec_decode``, whose
n-gram drafts are replaced by the one-process tokens (REF.json), every third one wrong, so that
drafts are accepted and rejected on a model whose tokens any state error would change.

Rank 0 writes, per run, each request's tokens and draft counts, every rank's count of verify
and rollback re-run steps (those with chunks of its own and those of padding alone) and the EP
placement and the slots a rank holds of each EP group (the trunk's, a DSpark drafter's); or the
``ValueError`` a refused run raised. Usage: ``spec_mesh_job.py OUT.json
REF.json RUN...``, a run written ``MESH[@compiled]:METHOD[+fp8head][+eplb]`` (METHOD ``off``,
``ngram``, ``oracle``, ``mtp`` or ``dspark``; ``+fp8head``: the drafter reads the block-FP8 copy of
the head; ``+eplb``: then an EPLB rebalance by the loads measured, and the requests again, written
as ``RUN+eplb``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine")]  # the models' helpers

from mesh_requests import spec_requests  # noqa: E402
from test_spec_decode import _tiny_model, oracle  # noqa: E402
from test_spec_drafters import drafting  # noqa: E402

from deepinfer_fx import LLM, SamplingParams  # noqa: E402

K = 3  # drafts a verify step carries
MODELS = {"oracle": lambda: _tiny_model("v4"), "dspark": lambda: drafting("dspark-v41")}


def counted(llm: LLM) -> dict[str, int]:
    """Counters of ``llm``'s verify steps, split into those carrying this rank's own chunks and
    those of padding alone (another rank verifies), and of its prefill steps without the
    drafter (a rollback re-run until session 35: there must be none now)."""
    counts = {"verify": 0, "padding verify": 0, "undrafted prefill": 0}
    steps, verify, step = llm.runner.steps, llm.runner.steps.verify, llm.runner.steps.step

    def verify_counted(chunks, *args, **kw):
        counts["verify" if chunks else "padding verify"] += 1
        return verify(chunks, *args, **kw)

    def step_counted(dec, pre, *args, draft=True, **kw):
        counts["undrafted prefill"] += int(not draft and (len(pre) > 0 or kw.get("min_chunks", 0) > 0))
        return step(dec, pre, *args, draft=draft, **kw)

    steps.verify, steps.step = verify_counted, step_counted
    return counts


def build(run: str) -> LLM:
    mesh_steps, _, method = run.partition(":")
    mesh, _, steps = mesh_steps.partition("@")
    method = method.partition("+")[0]
    drafter = {"oracle": "ngram"}.get(method, method)
    spec = {"method": drafter, "num_speculative_tokens": K, **({"draft_head": "fp8"} if "+fp8head" in run else {})}
    return LLM(
        MODELS.get(method, lambda: drafting("mtp-v4"))(),
        device="cpu",
        max_model_len=96,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        mesh=mesh,
        eager=steps != "compiled",
        warmup=False,
        speculative_config=None if method == "off" else spec,
    )


def main(out: str, ref: str, runs: list[str]) -> None:
    reqs = spec_requests()
    reference = {tuple(r["prompt"]): ids for r, ids in zip(reqs, json.loads(Path(ref).read_text()))}
    params = [SamplingParams(**r["params"]) for r in reqs]
    results = {}
    for run in runs:
        try:
            llm = build(run)
        except ValueError as e:  # a refused combination: the test reads the reason
            results[run] = {"error": str(e)}
            continue
        if ":oracle" in run:
            oracle(llm, reference)
        counts = counted(llm)
        for key in [run.removesuffix("+eplb")] + ([run] if run.endswith("+eplb") else []):
            if key != run.removesuffix("+eplb"):
                llm.rebalance_experts()  # the trunk's experts move, and an MTP-1 block's with them
            counts.update(dict.fromkeys(counts, 0))
            outs = llm.generate([r["prompt"] for r in reqs], params)
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, counts)
            results[key] = {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "drafts": [[o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens] for o in outs],
                "steps": per_rank,
                "placement": list(llm.ranks.ep.placement.phys_to_logical) if llm.ranks.ep else None,
                "slots": [g.slots_per_rank for g in (llm.ranks.ep, llm.ranks.draft_ep) if g is not None],
                "varlen": llm.speculative is not None and llm.speculative.varlen,
            }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # gloo's threads torn down while joinable at exit abort the process (llm_mesh_job.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
