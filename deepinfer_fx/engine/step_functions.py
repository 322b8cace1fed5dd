"""The functions a step's pieces run, compiled (``passes.compiler``: the accelerator's pass
pipeline, dumps, cache key) or eager: the model part once per bucket, the sampler (or the draft
acceptor) once per mode for every bucket, the model's drafter once per bucket.

With the model's drafter (``n_drafts`` > 0: MTP-1 or DSpark) a step's key carries its draft
count: the model part also returns what the drafter reads (the final streams, or DSpark's
target layers' streams) and a third compiled piece, ``steps.propose_drafts``, follows the
sampler inside the same graph.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch._library.custom_ops import CustomOpDef

from ..api import Model
from ..graphs.batch import Batch
from ..graphs.model import cached_engram_layout
from ..graphs.swap import swapped
from ..kernels.triton import register_nvidia_kernels
from ..passes.compiler import DeepinferBackend, compile_graph, make_backend
from ..passes.dump import graph_name
from ..passes.saved_steps import SavedSteps
from .graph_capture import GraphKey, Piece
from .spec_accept import accept_rows
from .step_inputs import Layout
from .steps import StepOut, VerifyOut, decode_logits, prefill_logits, propose_drafts, sample_rows, verify_out


class StepFunctions:
    """The compiled (``compile=True``) or eager step functions over a model and a state pool,
    each made once and kept for every key that shares it."""

    def __init__(
        self,
        model: Model,
        state: dict,
        next_token: torch.Tensor,
        vocab_ids: torch.Tensor,
        *,
        accelerator: str,
        compile: bool,
        inductor: bool,
        dump_dir: str | None,
        disabled: Sequence[str],
        split: Callable[[Batch], Batch] | None = None,
        saved: SavedSteps | None = None,
        invariant: bool = False,
    ) -> None:
        """``invariant``: batch-invariant steps (``passes/invariant_guard.py`` checks each graph). ``split``: context parallelism, a prefill bucket -> this rank's static share
        (``sharding.cp.ContextRank.bucket``); decode steps run whole. ``saved``: where Inductor-compiled
        model parts and drafters are saved ahead of time and loaded on a later start
        (``passes/saved_steps.py``; None: ``torch.compile`` alone)."""
        self.config, self.params = model
        self.split = split
        self.saved = saved
        self.state = state
        self.next_token = next_token
        self.vocab_ids = vocab_ids  # the sampler's race keys (sampler.sample_mode)
        self.accelerator, self.compile = accelerator, compile
        self.inductor, self.dump_dir, self.disabled = inductor, dump_dir, tuple(disabled)
        self.invariant = invariant
        self._forwards: dict[tuple, Callable] = {}  # one compiled model part per bucket, shared by its modes
        self._samplers: dict[tuple, Callable] = {}  # one compiled sampler per (mode, k, masked), every bucket
        self._drafters: dict[tuple, Callable] = {}  # one compiled drafter per bucket
        if compile and accelerator == "nvidia" and not register_nvidia_kernels():
            raise RuntimeError("compiled steps on NVIDIA GPUs need Triton (pip install triton), or run with eager=True")
        if self.config.engram_layer_ids:
            cached_engram_layout(self.config)  # built eagerly (numpy); the traced steps read it as a constant
        # one code object serves every bucket; each bucket is a separate compile
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)

    def clear(self) -> None:
        """Forget every compiled function: the steps are traced again on their next call."""
        self._forwards.clear()
        self._samplers.clear()
        self._drafters.clear()

    def pieces(
        self, key: GraphKey, layout: Layout, dev: torch.Tensor, mask: torch.Tensor | None, over: dict
    ) -> tuple[tuple[Piece, ...], DeepinferBackend | None]:
        """``key``'s pieces over its arena region ``dev`` (and its token bitmask rows ``mask``),
        and its model part's backend (None: eager). ``over``: ``graphs.swap`` replacements that
        win over the pipeline's kernel swaps."""
        params, state, next_token, n_drafts = self.params, self.state, self.next_token, key.drafts
        model_in, sampling_in = layout.model_part(dev), layout.sampling_part(dev)
        # eager (compile=False): the same pieces, uncompiled, at the step's exact sizes
        backend = self.backend(key.model_name)
        # kernel swaps are in force whenever the compiled function runs: it is traced on its
        # first call, and Dynamo's guards see the same replacements on every later call
        swaps = {**backend.pipeline.swaps(), **over} if backend is not None else {}
        in_force = _swaps_id(over)
        forward = self.forward(layout, backend, in_force, streams=bool(n_drafts))
        drafter = self.drafter(layout, n_drafts, in_force) if n_drafts else None
        verify = layout.kind == "verify"
        sampler = self.sampler(key.mode, key.k, key.masked, verify=verify)
        extra = () if mask is None else (mask,)
        token_ids, lens = (model_in[: layout.tokens], layout.split_model(model_in)[3]) if verify else (None, None)

        def model_part() -> tuple[torch.Tensor, Any]:
            """(logits, what the drafter reads: None without one)."""
            with swapped(swaps):
                out = forward(params, state, next_token, model_in)
            return out if n_drafts else (out, None)

        def sample_part(fwd: tuple[torch.Tensor, Any]) -> StepOut | VerifyOut:
            logits, X = fwd
            with swapped(swaps):  # the sampler's places too (batch invariance swaps its softmaxes)
                if verify:
                    out = verify_out(
                        sampler(logits, next_token, token_ids, lens, sampling_in, self.vocab_ids, *extra), logits
                    )
                else:
                    out = StepOut(*sampler(logits, next_token, sampling_in, self.vocab_ids, *extra), logits)
                if drafter is None:
                    return out
                drafts, confidence = drafter(params, state, dev, X, out.tokens, out.accepted if verify else None)
            return out._replace(drafts=drafts, confidence=confidence)

        # a masked decode / prefill step in two pieces, so that its masks can be filled while its
        # model part runs; verify masks are known at launch (the drafts), as are every other step's
        split = key.masked and not verify
        pieces = (Piece(model_part), Piece(sample_part)) if split else (Piece(lambda: sample_part(model_part())),)
        return pieces, backend

    def compiled(
        self, fn: Callable, backend: DeepinferBackend | None, dynamic: bool | None = False, reads: tuple | None = None
    ) -> Callable:
        """``fn`` compiled with ``backend`` (None: eager steps, ``fn`` itself). A static-shape
        Inductor function is saved ahead of time when the engine keeps saved steps and ``reads``
        (what its closure reads, for the key) is given."""
        if backend is None:
            return fn
        saveable = reads is not None and dynamic is False and backend.inductor and backend.dump_dir is None
        if self.saved is not None and saveable:
            return self.saved.wrap(fn, backend, repr((self.config, self.split, *reads)))
        return compile_graph(fn, backend, dynamic=dynamic)

    def backend(self, name: str) -> DeepinferBackend | None:
        if not self.compile:
            return None
        # ``disabled`` holds every name (StepGraphs resolved the environment's): read none here
        return make_backend(
            self.accelerator,
            self.disabled,
            self.dump_dir,
            name,
            inductor=self.inductor,
            environ={},
            invariant=self.invariant,
        )

    def forward(
        self, layout: Layout, backend: DeepinferBackend | None, in_force: str | None, streams: bool = False
    ) -> Callable:
        """The model part of ``layout``'s bucket (``streams``: it also returns the final streams);
        ``in_force``: the extra swaps it is traced under (``_swaps_id``; None: not saved)."""
        fkey = (layout.kind, layout.requests, layout.length, layout.all_rows, layout.kept, streams)
        if fkey not in self._forwards:
            c = self.config
            split = self.split if layout.kind == "prefill" else None  # verify chunks are not split
            if layout.kind == "decode":

                def forward(params, state, next_token, part):
                    return decode_logits(params, state, c, next_token, *layout.split_model(part), streams=streams)
            else:

                def forward(params, state, next_token, part):
                    return prefill_logits(
                        params, state, c, *layout.split_model(part), kept=layout.kept, streams=streams, split=split
                    )

            reads = None if in_force is None else (layout, fkey, in_force)
            self._forwards[fkey] = self.compiled(forward, backend, reads=reads)
        return self._forwards[fkey]

    def drafter(self, layout: Layout, n_drafts: int, in_force: str | None) -> Callable:
        """The model's drafter after ``layout``'s steps (``steps.propose_drafts``), compiled once per bucket."""
        dkey = (layout.kind, layout.requests, layout.length, layout.kept, n_drafts)
        if dkey not in self._drafters:
            c = self.config
            backend = self.backend(
                graph_name(f"draft-{layout.kind}", t=layout.tokens or layout.requests, r=layout.requests)
                + (f"-kept{layout.kept}" if layout.kept else "")
            )

            def drafter(params, state, buf, X, tokens, accepted):
                return propose_drafts(params, state, c, layout, buf, X, tokens, n_drafts, accepted)

            reads = None if in_force is None else (layout, dkey, in_force)
            self._drafters[dkey] = self.compiled(drafter, backend, reads=reads)
        return self._drafters[dkey]

    def sampler(self, mode: str, k: int | None, masked: bool = False, verify: bool = False) -> Callable:
        """The sampler of ``mode`` (``verify``: the draft acceptor, ``spec_accept.accept_rows``):
        its own small graph, compiled once for every bucket (the row count is dynamic), so a new
        mode costs seconds, not a model compile. ``masked``: the variant that takes a token
        bitmask (structured output) as a last input."""
        skey = (mode, k, masked, verify)
        if skey not in self._samplers:
            name = ("accept-" if verify else "sample-") + mode + (f"-k{k}" if k else "") + ("-masked" if masked else "")
            backend = self.backend(name)
            if verify:

                def sampler(logits, next_token, token_ids, lens, part, vocab_ids, mask=None):
                    return accept_rows(logits, next_token, token_ids, lens, part, mode, vocab_ids, k, mask)
            else:

                def sampler(logits, next_token, part, vocab_ids, mask=None):
                    return sample_rows(logits, next_token, part, mode, k, vocab_ids, mask)

            self._samplers[skey] = self.compiled(sampler, backend, dynamic=None)
        return self._samplers[skey]


def _swaps_id(over: dict) -> str | None:
    """The replacements beyond the pipeline's (whose id the backend's key holds) that a step is
    traced under, by place and function, for a saved step's key; None where one carries state a
    key cannot see (a closure or a bound method: a mesh's EP groups and placement), so that step is
    not saved."""
    ids = []
    for place, f in sorted(over.items()):
        if isinstance(f, (torch._ops.OpOverloadPacket, torch._ops.OpOverload, CustomOpDef)):
            ids.append((place, repr(f)))
        elif inspect.isfunction(f) and f.__closure__ is None and "<locals>" not in f.__qualname__:
            ids.append((place, f"{f.__module__}.{f.__qualname__}"))
        else:
            return None
    return repr(ids)
