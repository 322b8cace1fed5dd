"""The requests the mesh tests send (``llm_mesh_job.py`` runs them on every mesh)."""

from __future__ import annotations

import random


def mesh_requests(rng: random.Random) -> list[dict]:
    """Five requests of 1-30 random prompt tokens, greedy and seeded-sampled in turn, asking for
    logprobs, as the job's JSON takes them."""
    out = []
    for i in range(5):
        sampled = i % 2 == 1
        params = {
            "temperature": 0.8 if sampled else 0.0,
            "max_tokens": rng.randint(1, 8),
            "ignore_eos": True,
            "logprobs": 2,
            "seq_seed": rng.randrange(2**31) if sampled else None,
        }
        out.append({"prompt": [rng.randrange(3, 300) for _ in range(rng.randint(1, 30))], "params": params})
    return out


def spec_requests() -> list[dict]:
    """Greedy requests for speculation on meshes (``spec_mesh_job.py``, a target whose text
    cycles): repetitive prompts, whose first lookups draft the prompt's pattern (rejected, so
    rollbacks run) and later ones the output's cycle (accepted), random prompts, prompts longer
    than the 16-token budget (chunked), and uneven work: dealt round-robin over two ranks, rank 0
    serves three requests with long outputs (one waits for a slot), rank 1 two short ones behind
    a 40-token prompt, so some turns have one rank verifying while the other prefills or idles."""
    rng = random.Random(7)
    prompts = [
        [5, 6, 7, 8] * 6 + [7],
        [rng.randrange(3, 300) for _ in range(40)],
        [9, 10] * 10 + [11],
        [rng.randrange(3, 300) for _ in range(6)],
        [20, 21, 22] * 4,
    ]
    params = [{"temperature": 0.0, "max_tokens": m, "ignore_eos": True} for m in (24, 6, 20, 5, 16)]
    return [{"prompt": p, "params": q} for p, q in zip(prompts, params)]


def cp_requests(rng: random.Random) -> list[dict]:
    """``mesh_requests`` with prompts of 61, 7, 13, 30 and 22 tokens: none a multiple of 4, so a
    cp2 split pads every chunk, and 61 is prefilled in two chunks (over a 48-token budget); the
    fourth also asks for prompt logprobs, so some prefill steps return every row's logits."""
    out = mesh_requests(rng)
    for req, n in zip(out, (61, 7, 13, 30, 22)):
        req["prompt"] = [rng.randrange(3, 300) for _ in range(n)]
    out[3]["params"]["prompt_logprobs"] = 2
    return out
