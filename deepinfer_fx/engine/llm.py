"""``LLM``: the offline API, as vLLM and DeepInfer users know it.

    llm = LLM(model="/path/to/ckpt")            # or "demo" for the built-in tiny random model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.7, max_tokens=64))
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence as Seq

import torch

from ..api import Model, load_model
from ..io.checkpoint import ENV_MODEL_DIR
from ..settings import EngineConfig
from ..io.tokenizer import decode, encode, load_tokenizer
from .cache import CachePool, plan_capacity, state_bytes_per_slot
from .loop import EngineLoop, LoopStats, export_dir_for
from .ranks import Ranks
from .request import RequestOutput, Sequence, to_output
from .runner import ModelRunner, eager_kernel_swaps
from .sampler import derive_seed
from .sampling import SamplingParams
from .scheduler import EngineType, Scheduler
from .state_io import export_slot, import_slot, read_meta

DEFAULT_CPU_BUDGET = 2 << 30


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | Model | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        eager: bool | None = None,
        overlap: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        memory_budget: int | None = None,
        seed: int = 0,
        engine_type: str | EngineType = EngineType.NORMAL,
        state_dir: str | os.PathLike | None = None,
        fake_quant: bool | None = None,
        mesh: str | None = None,
        cuda_graphs: bool | None = None,
        inductor: bool | None = None,
        dump_graphs: str | os.PathLike | None = None,
        disable_passes: str | Seq[str] | None = None,
        expert_format: str | None = None,
    ) -> None:
        """``eager``: None compiles the steps on GPUs and runs them eagerly on the CPU (there the
        compile time outweighs the gain); True never compiles; False always does. Compiled runs
        take ``cuda_graphs`` (default: on where the device has graphs; decode replays them),
        ``inductor`` (default: on GPUs; off = our passes on aot_eager), ``dump_graphs`` (a
        directory for every graph's stages) and ``disable_passes`` (names, or comma-separated;
        added to ``DEEPINFER_DISABLE_PASSES``). ``expert_format``: as in ``load_model`` (default
        ``DEEPINFER_EXPERT_FORMAT``, auto: block-FP8 routed experts stay fp8 on CUDA)."""
        self.settings = EngineConfig.from_env()
        self.engine_type = EngineType(engine_type) if not isinstance(engine_type, EngineType) else engine_type
        if self.engine_type is not EngineType.NORMAL and state_dir is None:
            raise ValueError(f"engine_type={self.engine_type.value!r} needs state_dir (where request states are exported/imported)")
        self.state_dir = Path(state_dir) if state_dir is not None else None
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # a multi-rank mesh joins the torchrun world first: the loader reads only this rank's experts
        asked_eager = eager
        self.ranks, device, eager = Ranks.join(mesh, device, eager)
        if dtype == "auto":
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        elif isinstance(dtype, str):
            if dtype not in ("bfloat16", "float32", "float16"):
                raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16' or 'float32', got {dtype!r}")
            dtype = getattr(torch, dtype)

        if isinstance(model, Model):
            self.model = self.ranks.shard(model)
        else:
            if model == "demo":
                from ..generate import demo_model_dir

                model = demo_model_dir()
            if model is None and not self.settings.hf_model_dir:
                raise ValueError(f"no model given: pass LLM(model=path or hub id), set {ENV_MODEL_DIR}, or use model='demo'")
            self.model = load_model(model, dtype=dtype, device=device, fake_quant=fake_quant, experts=self.ranks.experts(),
                                    expert_format=expert_format)
        c = self.model.config
        self.tokenizer = None
        if self.model.path is not None and (Path(self.model.path) / "tokenizer.json").exists():
            self.tokenizer = load_tokenizer(self.model.path)

        self.max_model_len = min(max_model_len or min(c.max_position_embeddings, 8192), c.max_position_embeddings)
        if max_model_len is not None and max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit ({c.max_position_embeddings})")
        budget = memory_budget if memory_budget is not None else self._default_budget(device)
        self.plan = plan_capacity(c, budget, self.max_model_len, self.model.dtype, max_slots=max_num_seqs)
        self.pool = CachePool(c, self.plan, self.model.dtype, self.model.device)
        if eager is None:
            eager = self.model.device.type == "cpu"
        if eager and (cuda_graphs or dump_graphs is not None or inductor):
            raise ValueError("cuda_graphs, inductor and dump_graphs apply to compiled steps; drop eager=True (or --eager)")
        compiled = None
        names = disable_passes.split(",") if isinstance(disable_passes, str) else list(disable_passes or ())
        if not eager:
            compiled = {
                "max_requests": max_num_seqs, "max_tokens": max_num_batched_tokens, "accelerator": self.settings.accelerator,
                "graphs": cuda_graphs, "inductor": self.model.device.type == "cuda" if inductor is None else inductor,
                "dump_dir": None if dump_graphs is None else str(dump_graphs), "disabled": [n.strip() for n in names if n.strip()],
            }
        swaps = self.ranks.start_ep(c, max_num_batched_tokens, self.model.device)
        cp_swap, split = self.ranks.cp_split()
        if split is not None and asked_eager is None:
            # cp steps eagerly because it must, not because eager math was asked for: the
            # accelerator's kernels still take their places (an eager cp2 16k-token chunk ran the
            # reference attention at 1.1 s on H200s, against 72 ms compiled on one GPU)
            swaps = {**eager_kernel_swaps(self.settings.accelerator, self.model.device, names), **swaps}
        self.runner = ModelRunner(self.model, self.pool, compiled, {**swaps, **cp_swap}, split,
                                  lockstep=self.ranks.lockstep if compiled is not None else None)
        self.runner.importer = self._import
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, self.engine_type)
        self.seed = seed
        self.overlap = overlap
        self._next_id = 0
        self._finished: list[Sequence] = []
        self._engine_loop: EngineLoop | None = None
        self.last_stats: LoopStats | None = None
        self.last_events: list[tuple[str, int]] = []

    def _default_budget(self, device: torch.device) -> int:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * 0.8)
        return DEFAULT_CPU_BUDGET

    # --- per-token memory, for the CLI summary
    def bytes_per_token(self) -> float:
        return state_bytes_per_slot(self.model.config, self.max_model_len, self.model.dtype)["per_token"]

    # --- requests
    def _tokens(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token-id lists instead of strings")
            return prompt, encode(self.tokenizer, prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {self.model.config.vocab_size}); got {bad[:5]}")
        return None, ids

    def _make_seq(self, prompt, params: SamplingParams) -> Sequence:
        text, ids = self._tokens(prompt)
        need = len(ids) + (1 if self.engine_type is EngineType.PROMPT else params.max_tokens)
        if need > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds max_model_len {self.max_model_len}; "
                "shorten the prompt, lower max_tokens or raise max_model_len"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        seq_id = self._next_id
        self._next_id += 1
        seed = params.seq_seed if params.seq_seed is not None else derive_seed(self.seed, seq_id)
        return Sequence(seq_id, text, ids, params, seed)

    def _import(self, seq: Sequence) -> None:
        meta = import_slot(self.pool, seq.slot, seq.import_path, self.model.config)
        self.runner.set_next_token(seq.slot, int(meta["last_token"]))

    def _export(self, seq: Sequence) -> None:
        meta = {
            "n_tokens": seq.prompt_len, "prompt_token_ids": seq.prompt_ids, "last_token": seq.output_ids[-1],
            "seed": seq.seed, "prompt": seq.prompt,
        }
        export_slot(self.pool, seq.slot, export_dir_for(self.state_dir, seq), meta)

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order.
        A COMPLETION engine takes ``prompts=None`` and continues every state in ``state_dir``."""
        if self.engine_type is EngineType.COMPLETION:
            seqs = self._imported_seqs(sampling_params)
        else:
            if prompts is None:
                raise ValueError("generate() needs prompts")
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            params = sampling_params if sampling_params is not None else SamplingParams()
            plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
            seqs = [self._make_seq(p, sp) for p, sp in zip(prompts, plist)]  # validate all before running any
        return self._run(seqs, use_tqdm)

    def _imported_seqs(self, sampling_params) -> list[Sequence]:
        dirs = sorted(p for p in self.state_dir.iterdir() if p.is_dir()) if self.state_dir.is_dir() else []
        if not dirs:
            raise ValueError(f"{self.state_dir}: no exported request states found (run a PROMPT engine first)")
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(dirs)
        seqs = []
        for d, sp in zip(dirs, plist):
            meta = read_meta(d)
            seq = self._make_seq(list(meta["prompt_token_ids"]), sp)
            seq.prompt = meta.get("prompt")
            seq.seed = int(meta["seed"]) if sp.seq_seed is None else sp.seq_seed
            seq.imported, seq.import_path = True, d
            seq.output_ids.append(int(meta["last_token"]))
            seq.num_sampled_scheduled = 1
            seqs.append(seq)
        return seqs

    def _loop(self) -> EngineLoop:
        if self._engine_loop is None:
            detok = (lambda ids: decode(self.tokenizer, ids)) if self.tokenizer is not None else None
            self._engine_loop = EngineLoop(
                self.scheduler, self.runner, detok, self.model.config.eos_token_ids, self.overlap,
                export=self._export if self.engine_type is EngineType.PROMPT else None,
                on_finish=self._finished.append, lockstep=self.ranks.lockstep,
            )
        return self._engine_loop

    # --- step-level API (what generate() is built on)
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Invalid input raises before anything is queued."""
        if self.engine_type is EngineType.COMPLETION:
            raise ValueError("a COMPLETION engine takes its requests from state_dir: call generate()")
        seq = self._make_seq(prompt, params if params is not None else SamplingParams())
        self.scheduler.add(seq)
        return seq.id

    def has_unfinished_requests(self) -> bool:
        return self._loop().busy()

    def step(self) -> list[RequestOutput]:
        """Run one engine turn; returns the requests that finished in it."""
        self._finished.clear()
        self.ranks.turn(self._loop().step)  # a peer that stops answering: a RankTimeout, not a raw gloo error
        return [to_output(s) for s in self._finished]

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        """Serve this rank's share of ``seqs`` (all of them on one rank); every rank returns all
        outputs, in order."""
        seqs = self.ranks.mine(seqs)
        bar = None
        if use_tqdm and self.ranks.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="requests", unit="req", dynamic_ncols=True)
        for seq in seqs:
            self.scheduler.add(seq)
        loop = self._loop()
        stats_before = dataclasses.replace(loop.stats)
        try:
            while loop.busy():
                done = self.step()
                if bar is not None:
                    bar.update(len(done))
        finally:
            if bar is not None:
                bar.close()
        self.last_stats = loop.stats.since(stats_before)
        self.last_events = list(loop.events)
        return self.ranks.gather([(s.id, to_output(s)) for s in seqs])

    def rebalance_experts(self) -> None:
        """EPLB at run time (multi-rank meshes): re-place the routed experts over each EP group by
        the loads measured since the last call (hot experts get the redundant slots) and move the
        weights between ranks. Call it between ``generate`` calls on every rank; outputs do not
        change. On one rank it does nothing."""
        swaps = self.ranks.rebalance(self.model.params)
        if swaps is not None:
            self.runner.swaps.update(swaps)
            if self.runner.steps is not None:
                self.runner.steps.reset()

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a queued or running request: it finishes with reason 'abort' and keeps what it
        generated so far; its slot returns to the pool once no launched step uses it."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        self._loop().finish(seq, "abort", None)
        return to_output(seq)
