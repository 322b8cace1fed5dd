"""Run by ``test_rank_timeout.py`` under torchrun: every rank builds ``LLM(CKPT, mesh=MESH)`` and
generates the same requests (SPMD), and rank 1 stops answering (sleeps for good) at its Nth
chance: before its Nth lock-step agreement (``turn``), or inside its Nth EP all-to-all, in the
middle of a step (``step``).

The ranks meet (through files, which wait as long as it takes) before the engine starts and
before it generates, so that a loaded machine's skew between them is not mistaken for a stall
by the short timeout the test sets.
Before generating, each rank writes ``OUT/rank{r}.json``: the timeout (seconds) of every process
group its engine uses. Rank 1 writes ``OUT/stalled`` (a wall-clock stamp) when it stops; a rank
that gets ``RankTimeout`` writes ``OUT/failed{r}.json`` (stamp and message) and lets it go on up, so
the process ends as a user's script would. Usage: ``stall_job.py CKPT OUT MESH MODE N``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.sharding import ep as ep_mod
from deepinfer_fx.sharding import ep_ragged
from deepinfer_fx.sharding.lockstep import LockStep, RankTimeout


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _meet(out: Path, name: str, rank: int, size: int = 2) -> None:
    (out / f"{name}{rank}").touch()
    while not all((out / f"{name}{r}").exists() for r in range(size)):
        time.sleep(0.02)


def _stall(out: Path) -> None:
    (out / "stalled").write_text(repr(time.time()))
    time.sleep(3600)  # for good; torchrun ends it once the other rank has failed


def _arm(out: Path, mode: str, n: int) -> None:
    """Make rank 1 stall at its ``n``th agreement (turn) or EP all-to-all (step)."""
    calls = [0]
    if mode == "step":
        # the static path's exchanges (compiled steps) and the ragged path's (eager steps)
        for module, name in ((ep_mod, "_exchange"), (ep_ragged, "_exchange_rows")):
            exchange = getattr(module, name)

            def stalling_exchange(*args, exchange=exchange):
                calls[0] += 1
                if calls[0] == n:
                    _stall(out)
                return exchange(*args)

            setattr(module, name, stalling_exchange)
        return
    agreement = LockStep._agreement

    def stalling_agreement(self, what, collective):
        calls[0] += 1
        if calls[0] == n:
            _stall(out)
        return agreement(self, what, collective)

    LockStep._agreement = stalling_agreement


def main(ckpt: str, out_dir: str, mesh: str, mode: str, n: int) -> None:
    out = Path(out_dir)
    _meet(out, "start", int(os.environ["RANK"]))
    llm = LLM(
        ckpt,
        dtype="float32",
        device="cpu",
        fake_quant=False,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        mesh=mesh,
        eager=True,
    )
    rank = dist.get_rank()
    groups = {"default": dist.group.WORLD, "lockstep": llm.ranks.lockstep.group}
    groups.update({f"mesh:{a}": llm.ranks.world.get_group(a) for a in llm.ranks.world.mesh_dim_names})
    (out / f"rank{rank}.json").write_text(json.dumps({k: _timeout_s(g) for k, g in groups.items()}))
    if rank == 1:
        _arm(out, mode, n)
    _meet(out, "loaded", rank)
    prompts = [[3 + (7 * i + j) % 290 for j in range(4 + 3 * i)] for i in range(4)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    except RankTimeout as e:
        (out / f"failed{rank}.json").write_text(json.dumps({"time": time.time(), "message": str(e)}))
        raise
    raise AssertionError(f"rank {rank}: generate() returned although rank 1 stopped answering")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
