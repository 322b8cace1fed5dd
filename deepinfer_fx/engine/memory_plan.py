"""A memory plan a user can read before buying GPUs: the bytes one GPU of a mesh holds, by
category, in the formats this engine holds them in, from the config alone (no weights read).

    python -m deepinfer_fx.generate --model DIR --plan [--mesh ep8] [--gpu-memory-gb 141]

Formats, as ``io/loader.py`` loads a checkpoint today:

- routed experts: MXFP4 experts (the released V4 and V4.1) are dequantised to the run dtype
  on load; block-FP8 experts (V4 ``-Base``) stay float8_e4m3fn with fp32 block scales on CUDA
  when ``expert_format`` keeps them (``held_experts``), else they are
  dequantised too. A GPU holds its EP rank's expert slots (``start_expert_ids``: on a multi-rank
  mesh the routed count plus ``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS``, rounded up to the EP size);
- dense weights: FP8 dense weights are dequantised to the run dtype, or held as stored
  (float8_e4m3fn + fp32 block scales) with ``dense_format="fp8"``; mHC, sinks, biases and
  the like are fp32; all of it is replicated on every GPU;
- the draft model (``mtp.*``: MTP-1 or DSpark) is loaded when the checkpoint carries it, as the
  released ones do; its experts shard like the trunk's;
- Engram tables (V4.1), fp8 rows + ue8m0 scales as stored: compiled steps place them as
  ``DEEPINFER_ENGRAM_TABLES=auto`` does (``engine/engram_tables.py``): on the device while they
  fit its budget (an eighth of the GPU's memory), the rest in pinned host memory; eager steps
  read them memory-mapped from the checkpoint (host memory, nothing on the GPU);
- state (``engine/cache.py``): a fixed part per sequence (window and compressor rings) and a part
  per cached token (compressed entries, index keys), in the run dtype, or with
  ``kv_format="trained"`` as fp8 / fp4 codes and scales (``graphs/state.py``); the pool holds
  ``max_num_seqs`` sequences of ``max_model_len`` tokens plus one scratch slot, or fewer: the
  engine gives the pool 80 % of the memory left after the weights
  (``engine/llm_build.default_budget``) and leaves the rest to the CUDA graph pool;
- graph pool: the activations of the largest prefill graph, estimated from the shapes of one
  layer at ``max_num_batched_tokens`` tokens (not measured).

Not counted: the CUDA context and allocator slack (a few hundred MiB), the step buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..graphs.param_spec import ParamSpec
from ..graphs.params import param_specs
from ..io.loader import held_dense, held_experts
from ..settings import DEFAULTS, EngineConfig
from ..sharding.mesh import MeshSpec
from ..sharding.parallel import start_expert_ids
from .cache import state_bytes_per_slot
from .llm_build import state_format
from .engram_tables import DEVICE_SHARE

GiB = 2**30
H200_GIB = 141  # an H200's HBM3e as its maker states it (torch reports ~140.4 GiB)
POOL_SHARE = 0.8  # the engine's cache budget: this share of the memory free after the weights
ONE_GPU = MeshSpec()


@dataclass(frozen=True)
class Category:
    name: str
    bytes: int
    note: str


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's share of a model on ``mesh``: ``device`` categories are on the GPU, ``host``
    ones in host memory."""

    mesh: MeshSpec
    dtype: torch.dtype
    compiled: bool
    gpu_bytes: int
    device: tuple[Category, ...]
    host: tuple[Category, ...]
    state_per_token: float
    state_per_sequence: int
    kv_format: str
    max_model_len: int
    max_num_seqs: int
    graph_pool: int
    problems: tuple[str, ...]  # why the model cannot run so at all (before any memory count)

    @property
    def weights(self) -> int:
        return sum(c.bytes for c in self.device)

    @property
    def sequence_bytes(self) -> int:
        return self.state_per_sequence + math.ceil(self.state_per_token * self.max_model_len)

    @property
    def sequences(self) -> int:
        """Sequences of ``max_model_len`` the engine's pool holds on this GPU (its 80 % rule,
        one slot kept as scratch), at most ``max_num_seqs``; 0: not one."""
        free = self.gpu_bytes - self.weights
        return max(0, min(self.max_num_seqs, int(free * POOL_SHARE) // self.sequence_bytes - 1))

    @property
    def fits(self) -> bool:
        """Runs at all, the engine's pool holds ``max_num_seqs`` sequences, and the weights, that
        pool and the graph pool fit one GPU."""
        need = self.weights + (self.max_num_seqs + 1) * self.sequence_bytes + self.graph_pool
        return not self.problems and self.sequences == self.max_num_seqs and need <= self.gpu_bytes

    def format(self) -> str:
        """The plan as a table a person reads."""
        mode = "compiled steps" if self.compiled else "eager steps"
        gpus = f"{self.mesh.world_size} GPU{'s' if self.mesh.world_size > 1 else ''}"
        lines = [
            f"memory plan per GPU: mesh {self.mesh} ({gpus}), {str(self.dtype).removeprefix('torch.')}, "
            f"{mode}, {self.gpu_bytes / GiB:.0f} GiB a GPU"
        ]
        for c in self.device:
            lines.append(f"  {c.name:<24} {c.bytes / GiB:10.2f} GiB  {c.note}")
        lines.append(f"  {'weights on the GPU':<24} {self.weights / GiB:10.2f} GiB")
        for c in self.host:
            lines.append(f"  {c.name + ' (host)':<24} {c.bytes / GiB:10.2f} GiB  {c.note}")
        pool = (self.max_num_seqs + 1) * self.sequence_bytes
        lines += [
            f"  {'state per token':<24} {self.state_per_token / 2**10:10.2f} KiB  compressed entries and index keys"
            + (", fp8 / fp4 as trained" if self.kv_format == "trained" else ""),
            f"  {'state per sequence':<24} {self.state_per_sequence / 2**20:10.2f} MiB  window and compressor rings (fixed)",
            f"  {'state pool':<24} {pool / GiB:10.2f} GiB  {self.max_num_seqs} sequences x {self.max_model_len} tokens + 1 scratch slot",
            f"  {'graph pool (estimate)':<24} {self.graph_pool / GiB:10.2f} GiB  activations of the largest prefill graph",
        ]
        lines += [f"  cannot run: {p}" for p in self.problems]
        if self.fits:
            verdict = "fits"
        elif self.problems or self.sequences == 0:
            verdict = "does NOT fit"
        else:
            verdict = f"does NOT fit {self.max_num_seqs} sequences; the engine's pool would hold {self.sequences}"
        lines.append(
            f"{verdict}: {self.weights / GiB:.2f} GiB of weights + {pool / GiB:.2f} GiB of state + "
            f"{self.graph_pool / GiB:.2f} GiB of graph pool against {self.gpu_bytes / GiB:.0f} GiB"
        )
        return "\n".join(lines)


def _bytes(s: ParamSpec, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * s.dtype(dtype).itemsize


def _expert_slots(mesh: MeshSpec, s: ParamSpec, extra: int) -> int:
    """The expert slots of stacked spec ``s`` one GPU holds: all experts on one GPU, else rank 0's
    start placement with ``extra`` redundant experts (every rank holds as many)."""
    return s.shape[0] if mesh.world_size == 1 else len(start_expert_ids(mesh, 0, extra)(s))


def _stored(c: ModelConfig, s: ParamSpec) -> str | None:
    """How the checkpoint stores spec ``s``: its quantised format where the config is quantised
    (a ``quantization_config``), else None (unquantised), as ``io/writer.py`` writes it."""
    return s.quant if c.fp8_block is not None else None


def _released_bytes(c: ModelConfig, s: ParamSpec, slots: int) -> int:
    """A routed expert spec as the checkpoint stores it: MXFP4 (half a byte a value, a ue8m0 byte
    a 32 values), block FP8 (a byte a value, an fp32 scale a block) or bf16."""
    numel = slots * math.prod(s.shape[1:])
    if _stored(c, s) == "fp4":
        return numel // 2 + numel // 32
    if _stored(c, s) == "fp8":
        return numel + slots * math.prod(-(-n // (c.fp8_block or 1)) for n in s.shape[1:]) * 4
    return numel * 2


def _graph_pool(c: ModelConfig, tokens: int, max_len: int, dtype: torch.dtype) -> int:
    """Peak activations of a ``tokens``-token prefill, from one layer's largest live tensors: the
    streams in and out of an mHC site, the queries and attention output, the attention bias over
    the window and the compressed entries and the indexer's scores (fp32, the densest layer:
    ratio 1 on V4.1, the CSA ratio on V4), the routed pairs' hidden and output rows and the fp32
    combine; plus the last rows' fp32 logits."""
    act = dtype.itemsize
    ratio = min(r for r in c.compress_ratios if r) if any(c.compress_ratios) else 0
    entries = max_len // ratio if ratio else 0
    streams = 2 * tokens * c.hc_mult * c.hidden_size * act
    attention = 2 * tokens * c.num_attention_heads * c.head_dim * act + 2 * tokens * (c.sliding_window + entries) * 4
    moe = tokens * c.num_experts_per_tok * (c.moe_intermediate_size + c.hidden_size) * act + tokens * c.hidden_size * 4
    return streams + max(attention, moe) + c.vocab_size * 4


def _dense_format_note(c: ModelConfig) -> str:
    if c.held_dense == "fp8":
        return "block FP8 + fp32 scales as stored; "
    return "FP8 dequantised; " if c.fp8_block else ""


def memory_plan(
    c: ModelConfig,
    mesh: MeshSpec = ONE_GPU,
    *,
    gpu_memory_gib: float = H200_GIB,
    dtype: torch.dtype = torch.bfloat16,
    compiled: bool = True,
    expert_format: str | None = None,
    dense_format: str | None = None,
    kv_format: str = "model",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    draft: bool = True,
    extra_experts: int = DEFAULTS.extra_experts,
    engram_tables: str = DEFAULTS.engram_tables,
    engram_device_gib: float | None = DEFAULTS.engram_device_gib,
) -> MemoryPlan:
    """The plan of config ``c`` (a checkpoint's config, nothing else read) on one GPU of ``mesh``
    with the engine's settings: ``max_model_len`` (None: the engine's default,
    ``min(max_position_embeddings, 8192)``), ``max_num_seqs``, ``max_num_batched_tokens``,
    ``expert_format`` and ``dense_format`` (as ``load_model`` takes them), ``kv_format`` ("model"
    or "trained", as ``init_state`` takes it), ``compiled`` (Engram tables on the device),
    ``draft`` (the checkpoint carries ``mtp.*``) and the settings ``extra_experts`` (multi-rank
    meshes only), ``engram_tables`` and ``engram_device_gib`` (``EngineConfig``'s fields)."""
    c = c.replace(
        held_experts=held_experts(c, expert_format, "cuda"), held_dense=held_dense(c, dense_format, "cuda", dtype)
    )
    max_len = min(max_model_len or min(c.max_position_embeddings, 8192), c.max_position_embeddings)
    sums = {"routed": 0, "dense": 0, "draft": 0, "engram": 0, "engram_host": 0, "released": 0}
    # as engram_tables.place_engram_tables places them; eager steps read them memory-mapped
    share = int(gpu_memory_gib * GiB) // DEVICE_SHARE if engram_device_gib is None else int(engram_device_gib * GiB)
    engram_budget = {"host": 0, "device": 1 << 62}.get(engram_tables, share) if compiled else 0
    problems = []
    for s in param_specs(c, mtp=draft):
        if s.path == "head" and c.tie_word_embeddings:
            continue  # the loader points the head at the embedding
        if s.quant == "engram":  # fp8 rows + a ue8m0 byte a 32 channels, as stored, wherever held
            stored = s.numel + s.numel // 32
            on_device = sums["engram"] + stored <= engram_budget
            sums["engram" if on_device else "engram_host"] += stored
            continue
        shape = ((_expert_slots(mesh, s, extra_experts),) + s.held_shape[1:]) if s.stacked else s.held_shape
        key = "draft" if s.path.startswith("mtp.") else ("routed" if s.stacked else "dense")
        sums[key] += _bytes(s, shape, dtype)
        if key == "routed" and s.held != "scale":
            sums["released"] += _released_bytes(c, s, shape[0])
    if c.engram_layer_ids:
        sums["dense"] += c.vocab_size * 8  # the token -> compressed class table, int64
    held = {"fp8": "block fp8 + fp32 scales", "fp4": "MXFP4 + ue8m0 scales"}.get(
        c.held_experts or "", f"{str(dtype).removeprefix('torch.')} (dequantised on load)"
    )
    expert = next(s for s in param_specs(c, mtp=False) if s.stacked)
    released = {"fp4": "MXFP4", "fp8": "block FP8"}.get(_stored(c, expert) or "", "bf16")
    slots = _expert_slots(mesh, expert, extra_experts)
    dense_note = "mHC, sinks and biases fp32; on every GPU"
    device = [
        Category(
            "routed experts",
            sums["routed"],
            f"{slots} of {c.n_routed_experts} experts a layer, {held}; "
            f"{sums['released'] / GiB:.2f} GiB as released ({released})",
        ),
        Category("dense weights", sums["dense"], _dense_format_note(c) + dense_note),
    ]
    if draft and sums["draft"]:
        device.append(Category("draft model (mtp.*)", sums["draft"], "MTP-1 / DSpark, when the checkpoint has it"))
    host = []
    if sums["engram"]:
        device.append(Category("Engram tables", sums["engram"], "fp8 rows + ue8m0 scales within the device budget"))
    if sums["engram_host"]:
        note = "pinned host memory, the GPU reads a step's rows" if compiled else "memory-mapped (eager steps)"
        host.append(Category("Engram tables", sums["engram_host"], f"fp8 rows + ue8m0 scales, {note}"))
    state = state_bytes_per_slot(c, max_len, dtype, kv_format=kv_format)
    return MemoryPlan(
        mesh=mesh,
        dtype=dtype,
        compiled=compiled,
        gpu_bytes=int(gpu_memory_gib * GiB),
        device=tuple(device),
        host=tuple(host),
        state_per_token=state["per_token"],
        state_per_sequence=state["fixed"],
        kv_format=kv_format,
        max_model_len=max_len,
        max_num_seqs=max_num_seqs,
        graph_pool=_graph_pool(c, max_num_batched_tokens, max_len, dtype),
        problems=tuple(problems),
    )


def cli(
    model: str | None,
    mesh: str | None,
    gpu_memory_gib: float,
    *,
    dtype: str = "auto",
    eager: bool = False,
    expert_format: str | None = None,
    dense_format: str | None = None,
    kv_format: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
) -> int:
    """``generate --plan``: ``model`` is a checkpoint directory or a config.json (only the config is
    read; default ``DEEPINFER_HF_MODEL_DIR``); the other arguments are ``generate``'s flags."""
    from ..config import load_config
    from ..sharding.mesh import parse_mesh

    settings = EngineConfig.from_env()
    path = model or settings.hf_model_dir
    if not path:
        raise ValueError("--plan needs --model: a checkpoint directory or a config.json (only the config is read)")
    run = torch.float32 if dtype == "float32" else torch.bfloat16  # auto: the engine's dtype on a GPU
    c = load_config(path)
    plan = memory_plan(
        c,
        parse_mesh(mesh or "1"),
        gpu_memory_gib=gpu_memory_gib,
        dtype=run,
        compiled=not eager,
        expert_format=expert_format,
        dense_format=dense_format,
        kv_format=state_format(c, kv_format, settings),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        extra_experts=settings.extra_experts,
        engram_tables=settings.engram_tables,
        engram_device_gib=settings.engram_device_gib,
    )
    print(plan.format())
    return 0 if plan.fits else 1
