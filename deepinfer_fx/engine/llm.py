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
from ..settings import EngineConfig, usable_cores
from ..io.tokenizer import decode, encode, load_tokenizer
from ..vision.requests import prepare, split_prompt
from . import inputs
from .cache import CachePool, plan_capacity, state_bytes_per_slot
from .loop import EngineLoop, LoopStats
from .options import build_options, check_batch_invariant, compact_keep
from .warmup import use_cache_dir, warm_up
from .ranks import Ranks
from .request import RequestOutput, Sequence, to_output
from .runner import ModelRunner, eager_kernel_swaps
from .sampler import derive_seed
from .sampling import SamplingParams
from .structured import GrammarState, Grammars
from .scheduler import EngineType, Scheduler
from .spec_config import parse_speculative_config
from .spec_decode import Speculator
from .state_io import StateTransfer, read_meta

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
        fp8 on CUDA; fp4 keeps MXFP4 experts as stored). ``num_threads``: intra-op CPU threads (``torch.set_num_threads``; default on
        the CPU: ``OMP_NUM_THREADS`` where set, as torchrun sets it, else the cores this process
        may use). ``warmup`` (default: on wherever steps are compiled): compile and capture every
        decode bucket and the prefill buckets up to ``max_num_batched_tokens`` now, with a
        progress bar, so that ``generate`` never stalls on a compile; the compile caches live in
        ``DEEPINFER_CACHE_DIR``. ``speculative_config``: speculative decoding, vLLM's shape
        (``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
        "prompt_lookup_max": 4}``; ``DEEPINFER_USE_NEXTN_DECODE`` caps k); greedy and sampled
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
            mesh,
            cuda_graphs=cuda_graphs,
            inductor=inductor,
            dump_graphs=dump_graphs,
            disable_passes=disable_passes,
        )
        inputs.check_pass_names(disable_passes)
        inputs.check_launch(mesh)
        self.settings = EngineConfig.from_env(batch_invariant=batch_invariant)
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
                from ..demo import demo_model_dir

                model = demo_model_dir()
            if model is None and not self.settings.hf_model_dir:
                raise ValueError(
                    f"no model given: pass LLM(model=path or hub id), set {ENV_MODEL_DIR}, or use model='demo'"
                )
            self.model = load_model(
                model,
                dtype=dtype,
                device=device,
                fake_quant=fake_quant,
                experts=self.ranks.experts(),
                expert_format=expert_format,
            )
        c = self.model.config
        self.tokenizer = None
        if self.model.path is not None and (Path(self.model.path) / "tokenizer.json").exists():
            self.tokenizer = load_tokenizer(self.model.path)
        self._grammars: Grammars | None = None  # built with the first constrained request (xgrammar loads then)

        self.max_model_len = min(max_model_len or min(c.max_position_embeddings, 8192), c.max_position_embeddings)
        if max_model_len is not None and max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit ({c.max_position_embeddings})")
        self.speculative = parse_speculative_config(speculative_config, self.settings, c, self.model.params)
        if self.speculative is not None and self.ranks.multi:
            raise ValueError(
                "speculative decoding on a mesh is not built yet (its verify and rollback steps would need the "
                "ranks' lock step); drop speculative_config or the mesh"
            )
        budget = memory_budget if memory_budget is not None else self._default_budget(device)
        self.plan = plan_capacity(c, budget, self.max_model_len, self.model.dtype, max_slots=max_num_seqs)
        self.pool = CachePool(c, self.plan, self.model.dtype, self.model.device)
        cp_swap, split = self.ranks.cp_split()
        max_drafts = 0 if self.speculative is None else self.speculative.num_speculative_tokens
        keep = compact_keep(
            c,
            self.settings,
            yoco_mode,
            yoco_keep_tokens,
            max_draft=max_drafts,
            cp=split is not None,
            drafter=None if self.speculative is None else self.speculative.method,
        )
        opts = build_options(
            self.settings,
            self.model.device,
            eager=eager,
            overlap=overlap,
            warmup=warmup,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            cuda_graphs=cuda_graphs,
            inductor=inductor,
            dump_graphs=dump_graphs,
            disable_passes=disable_passes,
            keep=keep,
        )
        self.options = opts
        check_batch_invariant(
            self.settings,
            self.model.device,
            speculative=self.speculative is not None,
            compiled=opts.steps.compiled,
            inductor=opts.steps.inductor,
        )
        if opts.steps.compiled:
            use_cache_dir(opts.cache_dir)
        swaps = self.ranks.start_ep(c, max_num_batched_tokens, self.model.device)
        if split is not None and asked_eager is None and not self.settings.batch_invariant:
            # cp steps eagerly because it must, not because eager math was asked for: the
            # accelerator's kernels still take their places (an eager cp2 16k-token chunk ran the
            # reference attention at 1.1 s on H200s, against 72 ms compiled on one GPU); batch invariance declines them
            swaps = {
                **eager_kernel_swaps(self.settings.accelerator, self.model.device, opts.steps.disabled_passes),
                **swaps,
            }
        method = None if self.speculative is None else self.speculative.method
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
            {**swaps, **cp_swap},
            split,
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

    def _default_budget(self, device: torch.device) -> int:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * 0.8)
        return DEFAULT_CPU_BUDGET

    # --- per-token memory, for the CLI summary
    def bytes_per_token(self) -> float:
        return state_bytes_per_slot(self.model.config, self.max_model_len, self.model.dtype)["per_token"]

    # --- requests
    def _tokens(self, prompt: str | Seq[int], where: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{where} is a str but this checkpoint has no tokenizer.json: pass token-id lists instead"
                )
            return prompt, encode(self.tokenizer, prompt)
        return None, inputs.token_ids(prompt, where, self.model.config.vocab_size)

    def _make_seq(self, prompt, params: SamplingParams, where: str = "prompt", laid_out: bool = False) -> Sequence:
        """``laid_out``: the ids already hold their image spans (a COMPLETION engine's import)."""
        images: list = []
        if isinstance(prompt, dict):
            prompt, images = split_prompt(prompt, where)
        text, ids = self._tokens(prompt, where)
        mm = None
        if not laid_out:
            ids, mm = prepare(self.model, ids, images, where)
        if mm is not None:
            self._check_images(where)
        need = len(ids) + (1 if self.engine_type is EngineType.PROMPT else params.max_tokens)
        if need > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds max_model_len {self.max_model_len}; "
                "shorten the prompt, lower max_tokens or raise max_model_len"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
        vocab = self.model.config.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise ValueError(
                f"SamplingParams.stop_token_ids {outside} lie outside the model's vocabulary [0, {vocab}); "
                "no token can match them: drop them"
            )
        grammar = None if params.so_spec is None else self._grammar(params, where)
        seq_id = self._next_id
        self._next_id += 1
        seed = params.seq_seed if params.seq_seed is not None else derive_seed(self.seed, seq_id)
        seq = Sequence(seq_id, text, ids, params, seed)
        seq.grammar = grammar
        seq.images = mm
        return seq

    def _check_images(self, where: str) -> None:
        """Images go through an eager prefill step of their own (``ModelRunner.launch``); what
        that step does not serve yet is refused here, by name."""
        if self.ranks.multi:
            raise ValueError(
                f"{where}: images on a multi-rank mesh are not built yet (the ranks' steps would differ); run one rank"
            )
        if self.speculative is not None:
            raise ValueError(f"{where}: images with speculative decoding are not built yet; drop speculative_config")

    def _grammar(self, params: SamplingParams, where: str) -> GrammarState:
        """A matcher for ``params.so_args``, compiled (once per distinct spec) now, so that a bad
        regex, schema or grammar fails this request with xgrammar's message before it is queued."""
        if self.tokenizer is None:
            raise ValueError(
                f"{where}: SamplingParams.so_args needs the checkpoint's tokenizer.json (structured output "
                "constrains text); this checkpoint has none"
            )
        if self._grammars is None:
            c = self.model.config
            self._grammars = Grammars(self.tokenizer, c.vocab_size, c.eos_token_ids, threads=usable_cores())
        try:
            return self._grammars.state(params.so_spec)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

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
            seqs = self._imported_seqs(sampling_params)
        else:
            prompts, names = inputs.prompt_list(prompts)
            params = sampling_params if sampling_params is not None else SamplingParams()
            plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
            for i, sp in enumerate(plist):
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] is {type(sp).__name__}; pass SamplingParams(...)")
            seqs = [
                self._make_seq(p, sp, where) for p, sp, where in zip(prompts, plist, names)
            ]  # validate all before running any
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
            seq = self._make_seq(list(meta["prompt_token_ids"]), sp, laid_out=True)
            seq.prompt = meta.get("prompt")
            seq.seed = int(meta["seed"]) if sp.seq_seed is None else sp.seq_seed
            seq.imported, seq.import_path = True, d
            seq.output_ids.append(int(meta["last_token"]))
            if seq.grammar is not None and not seq.grammar.accept(seq.output_ids[-1]):
                raise ValueError(f"{d}: its first token {seq.output_ids[-1]} does not match this request's so_args")
            seq.num_sampled_scheduled = 1
            seqs.append(seq)
        return seqs

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
        seq = self._make_seq(prompt, params if params is not None else SamplingParams())
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

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        """Serve this rank's share of ``seqs`` (all of them on one rank); every rank returns all
        outputs, in order. Other requests (``add_request``) keep running alongside; their
        progress is held for the next ``step()``."""
        seqs = self.ranks.mine(seqs)
        own = {s.id for s in seqs}
        bar = None
        if use_tqdm and self.ranks.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="requests", unit="req", dynamic_ncols=True)
        for seq in seqs:
            self.scheduler.add(seq)
        loop = self._loop()
        stats_before = dataclasses.replace(loop.stats)
        left = len(seqs)
        try:
            while loop.busy() and (left or self.ranks.multi):  # a mesh's ranks turn together until all are done
                for s in self.ranks.turn(loop.step):
                    if s.id not in own:
                        self._held[s.id] = s
                    elif s.finished:
                        left -= 1
                        if bar is not None:
                            bar.update(1)
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
        change. On one rank it does nothing. The steps bake the old placement in, so they are
        compiled again: by the warm-up where the engine was warmed up, else on first use."""
        swaps = self.ranks.rebalance(self.model.params)
        if swaps is not None:
            self.runner.swaps.update(swaps)
            self.runner.steps.reset()
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
