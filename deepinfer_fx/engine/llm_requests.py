"""``LLM``'s requests from start to end: prompts checked and made into ``Sequence``s (text, ids or
images; stops, grammars), the states a COMPLETION engine imports, and one call's batch served."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Sequence as Seq

from ..io.tokenizer import encode
from ..settings import usable_cores
from ..vision.requests import prepare, split_prompt
from . import inputs
from .request import RequestOutput, Sequence, to_output
from .sampler import derive_seed
from .sampling import SamplingParams
from .scheduler import EngineType
from .state_io import read_meta
from .structured import GrammarState, Grammars

if TYPE_CHECKING:
    from .llm import LLM


def prompt_tokens(llm: LLM, prompt: str | Seq[int], where: str) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of a str or a token-id list."""
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise ValueError(f"{where} is a str but this checkpoint has no tokenizer.json: pass token-id lists instead")
        return prompt, encode(llm.tokenizer, prompt)
    return None, inputs.token_ids(prompt, where, llm.model.config.vocab_size)


def make_seq(llm: LLM, prompt, params: SamplingParams, where: str = "prompt", laid_out: bool = False) -> Sequence:
    """``laid_out``: the ids already hold their image spans (a COMPLETION engine's import)."""
    images: list = []
    if isinstance(prompt, dict):
        prompt, images = split_prompt(prompt, where)
    text, ids = prompt_tokens(llm, prompt, where)
    mm = None
    if not laid_out:
        ids, mm = prepare(llm.model, ids, images, where)
    if mm is not None:
        _check_images(llm, where)
    need = len(ids) + (1 if llm.engine_type is EngineType.PROMPT else params.max_tokens)
    if need > llm.max_model_len:
        raise ValueError(
            f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds max_model_len {llm.max_model_len}; "
            "shorten the prompt, lower max_tokens or raise max_model_len"
        )
    if params.stop and llm.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
    vocab = llm.model.config.vocab_size
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        raise ValueError(
            f"SamplingParams.stop_token_ids {outside} lie outside the model's vocabulary [0, {vocab}); "
            "no token can match them: drop them"
        )
    grammar = None if params.so_spec is None else _grammar(llm, params, where)
    seq_id = llm._next_id
    llm._next_id += 1
    seed = params.seq_seed if params.seq_seed is not None else derive_seed(llm.seed, seq_id)
    seq = Sequence(seq_id, text, ids, params, seed)
    seq.grammar = grammar
    seq.images = mm
    return seq


def _check_images(llm: LLM, where: str) -> None:
    """Images go through an eager prefill step of their own (``ModelRunner.launch``); what
    that step does not serve yet is refused here, by name."""
    if llm.ranks.multi:
        raise ValueError(
            f"{where}: images on a multi-rank mesh are not built yet (the ranks' steps would differ); run one rank"
        )
    if llm.speculative is not None:
        raise ValueError(f"{where}: images with speculative decoding are not built yet; drop speculative_config")


def _grammar(llm: LLM, params: SamplingParams, where: str) -> GrammarState:
    """A matcher for ``params.so_args``, compiled (once per distinct spec, cached in
    ``llm._grammars``) now, so that a bad regex, schema or grammar fails this request with
    xgrammar's message before it is queued."""
    if llm.tokenizer is None:
        raise ValueError(
            f"{where}: SamplingParams.so_args needs the checkpoint's tokenizer.json (structured output "
            "constrains text); this checkpoint has none"
        )
    if llm._grammars is None:
        c = llm.model.config
        llm._grammars = Grammars(llm.tokenizer, c.vocab_size, c.eos_token_ids, threads=usable_cores())
    try:
        return llm._grammars.state(params.so_spec)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def sampling_list(sampling_params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: the one given for all, or a list of ``n``."""
    params = sampling_params if sampling_params is not None else SamplingParams()
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
    for i, sp in enumerate(plist):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params[{i}] is {type(sp).__name__}; pass SamplingParams(...)")
    return plist


def imported_seqs(llm: LLM, sampling_params) -> list[Sequence]:
    """A COMPLETION engine's requests: one per state exported to ``llm.state_dir``, its first
    token already sampled (by the PROMPT engine)."""
    dirs = sorted(p for p in llm.state_dir.iterdir() if p.is_dir()) if llm.state_dir.is_dir() else []
    if not dirs:
        raise ValueError(f"{llm.state_dir}: no exported request states found (run a PROMPT engine first)")
    params = sampling_params if sampling_params is not None else SamplingParams()
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(dirs)
    seqs = []
    for d, sp in zip(dirs, plist):
        meta = read_meta(d)
        seq = make_seq(llm, list(meta["prompt_token_ids"]), sp, laid_out=True)
        seq.prompt = meta.get("prompt")
        seq.seed = int(meta["seed"]) if sp.seq_seed is None else sp.seq_seed
        seq.imported, seq.import_path = True, d
        seq.output_ids.append(int(meta["last_token"]))
        if seq.grammar is not None and not seq.grammar.accept(seq.output_ids[-1]):
            raise ValueError(f"{d}: its first token {seq.output_ids[-1]} does not match this request's so_args")
        seq.num_sampled_scheduled = 1
        seqs.append(seq)
    return seqs


def serve(llm: LLM, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
    """Serve this rank's share of ``seqs`` (all of them on one rank); every rank returns all
    outputs, in order. Other requests (``add_request``) keep running alongside; their
    progress is held for the next ``step()``."""
    seqs = llm.ranks.mine(seqs)
    own = {s.id for s in seqs}
    bar = None
    if use_tqdm and llm.ranks.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(seqs), desc="requests", unit="req", dynamic_ncols=True)
    for seq in seqs:
        llm.scheduler.add(seq)
    loop = llm._loop()
    stats_before = dataclasses.replace(loop.stats)
    left = len(seqs)
    try:
        while loop.busy() and (left or llm.ranks.multi):  # a mesh's ranks turn together until all are done
            for s in llm.ranks.turn(loop.step):
                if s.id not in own:
                    llm._held[s.id] = s
                elif s.finished:
                    left -= 1
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    llm.last_stats = loop.stats.since(stats_before)
    llm.last_events = list(loop.events)
    return llm.ranks.gather([(s.id, to_output(s)) for s in seqs])
