"""``LLM``: the offline API, as vLLM and DeepInfer users know it.

llm = LLM(model="/path/to/ckpt")            # or "demo" for the built-in tiny random model
outs = llm.generate(["Hello"], SamplingParams(temperature=0.7, max_tokens=64))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence as Seq

import torch

from ..api import Model
from ..io.tokenizer import decode
from ..kernels.launch_options import use_pdl
from ..settings import EngineConfig, usable_cores
from . import inputs
from .cache import CachePool, plan_capacity
from .llm_build import default_budget, model_len, model_tokenizer, run_dtype, serve_model, state_format
from .llm_requests import imported_seqs, make_seq, sampling_list, serve
from .loop import EngineLoop, LoopStats
from .options import llm_options
from .ranks import Ranks
from .request import RequestOutput, Sequence, to_output
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import EngineType, Scheduler
from .spec_config import check_mesh, draft_head_params, parse_speculative_config
from .spec_decode import Speculator
from .state_io import StateTransfer
from .structured import Grammars
from .warmup import use_cache_dir, warm_up


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
        dense_format: str | None = None,
        kv_format: str | None = None,
        num_threads: int | None = None,
        warmup: bool | None = None,
        speculative_config: dict | None = None,
        yoco_mode: str | None = None,
        yoco_keep_tokens: int | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        """``eager``: None compiles the steps on GPUs and runs them eagerly on the CPU (there the
        compile time outweighs the gain); True never compiles; False always does. Compiled runs
        take ``cuda_graphs`` (default: on where the device has graphs; decode replays them),
        ``inductor`` (default: on GPUs; off = our passes on aot_eager), ``dump_graphs`` (a
        directory for every graph's stages) and ``disable_passes`` (names, or comma-separated;
        added to ``DEEPINFER_DISABLE_PASSES``); asking for any of these asks for compiled steps
        (on the CPU too), so with ``eager=True`` they are an error. ``expert_format``: as in
        ``load_model`` (default ``DEEPINFER_EXPERT_FORMAT``, auto: block-FP8 routed experts stay
        fp8 on CUDA; fp4 keeps MXFP4 experts as stored); ``dense_format``: as in ``load_model``
        (default ``DEEPINFER_DENSE_FORMAT``, auto: block-FP8 dense projections stay fp8 on CUDA in bf16).
        ``kv_format`` (default ``DEEPINFER_KV_FORMAT``, auto = model): "trained" holds the cache's
        window kv, compressed entries and index keys as the fp8 / fp4 codes and scales of the
        model's fake-quant points (the same values, 2-4x fewer bytes; ``graphs/state.py``). ``num_threads``: intra-op CPU threads (``torch.set_num_threads``; default on
        the CPU: ``OMP_NUM_THREADS`` where set, as torchrun sets it, else the cores this process
        may use). ``warmup`` (default: on wherever steps are compiled): compile and capture every
        decode bucket and the prefill buckets up to ``max_num_batched_tokens`` now, with a
        progress bar, so that ``generate`` never stalls on a compile; the compile caches live in
        ``DEEPINFER_CACHE_DIR``. ``speculative_config``: speculative decoding, vLLM's shape
        (``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
        "prompt_lookup_max": 4}``, or method "mtp" / "dspark" with ``"draft_head": "model" | "fp8"``,
        ``engine/spec_config.py``; ``DEEPINFER_USE_NEXTN_DECODE`` caps k); greedy and sampled
        requests get the tokens they get without it (``engine/spec_accept.py``). ``yoco_mode`` ('compact' or 'off'; default
        ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE``, else compact for V4.1 models) and
        ``yoco_keep_tokens`` (default ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``, 140): V4.1's compact
        prefill, whose decoder replays only each prompt's last KEEP rows (``graphs/yoco.py``;
        prompt-logprob requests replay every row). ``batch_invariant`` (default
        ``DEEPINFER_BATCH_INVARIANT``, off): every op that could depend on the batch takes its
        batch-invariant form (``passes/batch_invariant.py``), so a request's logprobs and, with a
        fixed ``seq_seed``, its sampled tokens are the same bits alone or in any batch, chunking,
        overlap setting, eager or compiled step and mesh shape; built for the CPU (``docs/architecture.md``),
        elsewhere it refuses."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            inputs.count(name, value)
        inputs.count("max_model_len", max_model_len, optional=True)
        inputs.count("memory_budget", memory_budget, optional=True)
        inputs.count("num_threads", num_threads, optional=True)
        inputs.count("seed", seed, low=0)
        inputs.flag("overlap", overlap)
        for name, value in (
            ("eager", eager),
            ("fake_quant", fake_quant),
            ("cuda_graphs", cuda_graphs),
            ("inductor", inductor),
            ("warmup", warmup),
            ("batch_invariant", batch_invariant),
        ):
            inputs.flag(name, value, optional=True)
        eager = inputs.eager_setting(
            eager,
            cuda_graphs=cuda_graphs,
            inductor=inductor,
            dump_graphs=dump_graphs,
            disable_passes=disable_passes,
        )
        inputs.check_launch(mesh)
        self.settings = EngineConfig.from_env(batch_invariant=batch_invariant)
        disable_passes = inputs.disabled_passes(disable_passes, self.settings)
        use_pdl(self.settings.pdl)  # our kernels' launchers and Inductor's backend read it
        self.engine_type = EngineType(engine_type) if not isinstance(engine_type, EngineType) else engine_type
        if self.engine_type is not EngineType.NORMAL and state_dir is None:
            raise ValueError(
                f"engine_type={self.engine_type.value!r} needs state_dir (where request states are exported/imported)"
            )
        self.state_dir = Path(state_dir) if state_dir is not None else None
        device = inputs.resolve_device(device)
        if num_threads is not None or (device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ):
            torch.set_num_threads(num_threads or usable_cores())  # torchrun's OMP_NUM_THREADS (1 a rank) stays in force
        # a multi-rank mesh joins the torchrun world first: the loader reads only this rank's experts
        self.ranks, device = Ranks.join(mesh, device, self.settings)
        # mesh_params (a multi-rank mesh): the rank's DTensors; the steps run on their local views
        opt = {"fake_quant": fake_quant, "expert_format": expert_format, "dense_format": dense_format}
        served = serve_model(model, self.ranks, self.settings, dtype=run_dtype(dtype, device), device=device, **opt)
        self.model, self.mesh_params = self.ranks.place(served)
        c = self.model.config
        self.tokenizer = model_tokenizer(self.model)
        self._grammars: Grammars | None = None  # built with the first constrained request (xgrammar loads then)

        self.max_model_len = model_len(c, max_model_len)
        self.speculative = parse_speculative_config(speculative_config, self.settings, c, self.model.params)
        if self.speculative is not None and self.ranks.multi:
            check_mesh(self.speculative, self.ranks.spec)
        if self.speculative is not None and self.speculative.draft_head == "fp8":  # a copy: the caller's tree stays
            params = {**self.model.params, **draft_head_params(self.model.params["head"])}
            self.model = Model(c, params, self.model.path)
        max_drafts = 0 if self.speculative is None else self.speculative.num_speculative_tokens
        budget = memory_budget if memory_budget is not None else default_budget(device)
        # rings with room for the longest draft: a rejection is rolled back by forgetting its positions
        self.plan = plan_capacity(
            c,
            budget,
            self.max_model_len,
            self.model.dtype,
            max_slots=max_num_seqs,
            spare=max_drafts,
            kv_format=state_format(c, kv_format, self.settings),
        )
        self.pool = CachePool(c, self.plan, self.model.dtype, self.model.device)
        cp_swap, context = self.ranks.cp_split()
        method = None if self.speculative is None else self.speculative.method
        self.options = opts = llm_options(
            c,
            self.settings,
            self.model.device,
            yoco_mode=yoco_mode,
            yoco_keep_tokens=yoco_keep_tokens,
            max_drafts=max_drafts,
            drafter=method,
            cp=context is not None,
            eager=eager,
            overlap=overlap,
            warmup=warmup,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            cuda_graphs=cuda_graphs,
            inductor=inductor,
            dump_graphs=dump_graphs,
            disable_passes=disable_passes,
        )
        if opts.steps.compiled:
            use_cache_dir(opts.cache_dir)
        # a mesh's EP exchange
        ep = self.ranks.start_ep(c, opts.max_num_batched_tokens, max_num_seqs, self.model.device)
        model_drafts = max_drafts if method in ("mtp", "dspark") else 0
        if model_drafts and self.engine_type is not EngineType.NORMAL:
            raise ValueError(
                f"speculative_config method {method!r} with engine_type={self.engine_type.value!r}: the drafter's "
                "state does not travel between PROMPT and COMPLETION engines yet; use method 'ngram' or engine_type='normal'"
            )
        self.runner = ModelRunner(
            self.model,
            self.pool,
            opts.steps,
            {**ep.steps, **cp_swap},
            context,
            prefill_swaps=ep.prefill,
            lockstep=self.ranks.lockstep,
            max_drafts=max_drafts,
            model_drafts=model_drafts,
            varlen=self.speculative is not None and self.speculative.varlen,
        )
        self.transfer = None
        if self.engine_type is not EngineType.NORMAL:
            self.transfer = StateTransfer(self.pool, c, self.state_dir, self.runner.next_token)
        self.speculator = None if self.speculative is None else Speculator(self.speculative, self.runner.step_time)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, self.engine_type, self.speculator)
        self.seed = seed
        self._next_id = 0
        self._engine_loop: EngineLoop | None = None
        self._held: dict[int, Sequence] = {}  # requests of add_request that moved while generate() ran
        self.last_stats: LoopStats | None = None
        self.last_events: list[tuple[str, int]] = []
        self.warmup_s: float | None = None
        self.warmed: frozenset[str] = frozenset()  # the step graphs the warm-up compiled
        if opts.warmup:
            self.warmup_s = warm_up(self.runner, opts, show=self.ranks.rank == 0)
            self.warmed = frozenset(r["graph"] for r in self.runner.steps.report())

    # --- per-token memory, for the CLI summary
    def bytes_per_token(self) -> float:
        """Cache bytes per cached token (compressed entries and index keys, as ``kv_format`` holds them)."""
        return self.plan.per_token_bytes

    def generate(
        self,
        prompts: str | dict | Seq[str] | Seq[Seq[int]] | Seq[dict] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists, or vLLM's dicts with images:
        ``{"prompt": ..., "multi_modal_data": {"image": PIL image or a list}}``, one
        ``image_token_id`` placeholder in the prompt per image); outputs in prompt order.
        A COMPLETION engine takes ``prompts=None`` and continues every state in ``state_dir``."""
        if self.engine_type is EngineType.COMPLETION:
            seqs = imported_seqs(self, sampling_params)
        else:
            prompts, names = inputs.prompt_list(prompts)
            plist = sampling_list(sampling_params, len(prompts))
            seqs = [make_seq(self, p, sp, where) for p, sp, where in zip(prompts, plist, names)]  # all checked first
        return serve(self, seqs, use_tqdm)

    def _loop(self) -> EngineLoop:
        if self._engine_loop is None:
            detok = (lambda ids: decode(self.tokenizer, ids)) if self.tokenizer is not None else None
            self._engine_loop = EngineLoop(
                self.scheduler,
                self.runner,
                detok,
                self.model.config.eos_token_ids,
                self.options.overlap,
                transfer=self.transfer,
                lockstep=self.ranks.lockstep,
            )
        return self._engine_loop

    # --- step-level API (what generate() is built on)
    def add_request(self, prompt: str | Seq[int] | dict, params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Invalid input raises before anything is queued."""
        if self.engine_type is EngineType.COMPLETION:
            raise ValueError("a COMPLETION engine takes its requests from state_dir: call generate()")
        seq = make_seq(self, prompt, params if params is not None else SamplingParams())
        self.scheduler.add(seq)
        return seq.id

    @property
    def stats(self) -> LoopStats:
        """The host loop's counters since the engine was built (``last_stats``: the last generate's)."""
        return self._loop().stats

    def has_unfinished_requests(self) -> bool:
        """Whether a ``step()`` has anything left to return: requests queued or running, or
        progress made while a ``generate`` ran that no ``step()`` has returned yet."""
        return bool(self._held) or self._loop().busy()

    def step(self) -> list[RequestOutput]:
        """Run one engine turn; returns every request that made progress in it (as vLLM's
        ``LLMEngine.step``): the text and tokens so far, ``delta_text`` / ``delta_token_ids``
        new since that request's previous output, and ``finished``. Requests added with
        ``add_request`` that moved while a ``generate`` ran are returned by the next call."""
        # a peer that stops answering: a RankTimeout, not a raw gloo error
        moved = {s.id: s for s in self.ranks.turn(self._loop().step)}
        held, self._held = self._held, {}
        return [to_output(s) for s in sorted({**held, **moved}.values(), key=lambda s: s.id)]

    def rebalance_experts(self) -> None:
        """EPLB at run time (multi-rank meshes): re-place the routed experts over each EP group by
        the loads measured since the last call (hot experts get the redundant slots) and move the
        weights between ranks. Call it between ``generate`` calls on every rank; outputs do not
        change. On one rank, or where the EP groups have one rank (dp, cp meshes), it does
        nothing. The steps bake the old placement in, so they are compiled again: by the warm-up
        where the engine was warmed up, else on first use."""
        swaps = self.ranks.rebalance(self.model.params)
        if swaps is not None:
            self.runner.swaps.update(swaps.steps)
            self.runner.steps.reset(swaps.prefill)
            if self.options.warmup:
                self.warmup_s = warm_up(self.runner, self.options, show=self.ranks.rank == 0)

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a queued or running request: it finishes with reason 'abort' and keeps what it
        generated so far; its slot returns to the pool once no launched step uses it."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        self._loop().finish(seq, "abort", None)
        self._held.pop(seq.id, None)
        return to_output(seq)
