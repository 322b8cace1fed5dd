"""The physical limit of a step: bytes moved and FLOPs, from the parameter specs.

A decode step of ``batch`` requests at ``context`` tokens must at least read every dense weight
once, the routed experts that some token picks (expected distinct experts for ``batch`` draws
of ``k`` among ``E``), the LM head, and each request's cache entries that attention reads; it
must do 2 FLOPs per weight element per token it multiplies plus the attention products. The
roofline time is the larger of bytes / bandwidth and FLOPs / matmul rate. The ceilings default to
what was measured on the H200 for this project (``spec/perf.md``: 4.26 TB/s copy, 785 TF/s
dense bf16); a bench on another GPU measures its own (``measure_ceilings``: the device tool
lends H100s as often as H200s, and a ratio against another card's roofline means nothing).
Prefill uses 80 % of the matmul ceiling, as the issue's anchor does.

V4.1 (spec §7.2, §7.7): every compressed layer attends its window and the top-k of its KV
source's entries (ratio 2 or 1), read from the source's shared cache once per layer that reads
them; only index sources score index keys, a reuse layer takes its source's selection; index
sources after the candidate source (the two-level top-k) score only the candidate blocks'
entries (``candidate_topk_blocks * candidate_block_size``), the others all their source's keys;
each token of an Engram layer gathers ``(max_ngram - 1) * n_heads`` table rows of
``engram_head_dim`` (the tables are never read whole). The draft head is not run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..config import ModelConfig
from ..graphs.params import param_specs
from ..vision.params import is_vision_path

COPY_BYTES_PER_S = 4.26e12
BF16_FLOPS = 785e12
PREFILL_MFU = 0.8


@dataclass(frozen=True)
class Ceilings:
    """A GPU's copy bandwidth (bytes read + written per second) and dense bf16 matmul rate."""

    copy_bytes_per_s: float
    bf16_flops: float
    source: str

    def as_dict(self) -> dict:
        return {
            "copy_tb_s": round(self.copy_bytes_per_s / 1e12, 3),
            "bf16_tflops": round(self.bf16_flops / 1e12, 1),
            "source": self.source,
        }


H200 = Ceilings(COPY_BYTES_PER_S, BF16_FLOPS, "H200, measured for spec/perf.md")


def _best_seconds(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_ceilings(device: torch.device | str = "cuda", reps: int = 10) -> Ceilings:
    """The ceilings of the GPU at hand, measured as ``spec/perf.md``'s were: a 1 GiB device copy
    (read + write) and an 8192^3 bf16 matmul, best of ``reps`` (about a second in all)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), reps)
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_s = _best_seconds(lambda: torch.mm(a, b), reps)
    name = torch.cuda.get_device_name(device)
    return Ceilings(2 * (1 << 30) / copy_s, 2 * n**3 / mm_s, f"{name}, measured in this run")


_GATHERED = ("embed", "tid2eid")  # only the rows of the step's tokens are read (Engram tables' paths end so too)


@dataclass(frozen=True)
class Roofline:
    bytes: float
    flops: float
    seconds: float
    bound: str  # "memory" or "compute"

    def as_dict(self) -> dict:
        return {**asdict(self), "ms": round(self.seconds * 1e3, 3)}


def _weights(c: ModelConfig) -> tuple[float, float, float, float]:
    """(dense weight elements in the model dtype, dense elements held in block FP8, one routed
    expert's elements, head elements) of the backbone."""
    dense = held = expert = head = 0.0
    for s in param_specs(c, mtp=False):
        if s.path.endswith(_GATHERED) or is_vision_path(s.path):  # the vision tower runs once per image, not per step
            continue
        if s.held == "scale":  # held weights' scales: counted in expert_bytes / FP8_DENSE_BYTES
            continue
        if s.stacked:
            expert += s.numel / s.shape[0] / c.num_hidden_layers
        elif s.path == "head":
            head = s.numel
        elif s.held == "fp8":
            held += s.numel
        else:
            dense += s.numel
    return dense, held, expert, head


def dense_bytes(c: ModelConfig, weight_bytes: int) -> float:
    """Bytes of the dense weights (the head included) as held: block FP8 a byte plus an fp32
    scale per block (``dense_format="fp8"``), the rest ``weight_bytes``."""
    dense, held, _, head = _weights(c)
    return (dense + head) * weight_bytes + held * (1 + 4 / (c.fp8_block or 1) ** 2)


def expert_bytes(c: ModelConfig, weight_bytes: int) -> float:
    """Bytes a routed expert's element takes as held: MXFP4 half a byte plus a ue8m0 byte per 32,
    block FP8 a byte plus an fp32 scale per block, else ``weight_bytes``."""
    if c.held_experts == "fp4":
        return 0.5 + 1 / 32
    if c.held_experts == "fp8":
        return 1 + 4 / c.fp8_block**2
    return weight_bytes


def expected_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts when ``tokens`` tokens each pick ``k`` distinct ones uniformly."""
    return n_experts * (1 - (1 - k / n_experts) ** tokens)


def _attention(c: ModelConfig, context: int) -> tuple[float, float]:
    """(entries attended, indexer keys scored) per query, summed over the layers."""
    entries = keys = 0.0
    for layer, ratio in enumerate(c.compress_ratios):
        window = min(c.sliding_window, context)
        n = context // ratio if ratio else 0
        if ratio == 0:
            entries += window
        elif c.is_v41:  # the source's top-k; indexer keys only where the layer scores them
            entries += window + min(c.index_topk, n)
            if c.is_index_source(layer):
                keys += min(n, c.candidate_topk_blocks * c.candidate_block_size) if c.uses_candidates(layer) else n
        elif ratio == c.csa_ratio:  # CSA: the indexer scores every compressed key, attention reads the top-k
            keys += n
            entries += window + min(c.index_topk, n)
        else:  # HCA: every compressed entry
            entries += window + n
    return entries, keys


def _engram_rows(c: ModelConfig) -> int:
    """Table rows one token gathers over all Engram layers."""
    return len(c.engram_layer_ids) * (c.engram_max_ngram_size - 1) * c.engram_n_heads


def decode(
    c: ModelConfig, batch: int, context: int, weight_bytes: int = 2, cache_bytes: int = 2, ceil: Ceilings = H200
) -> Roofline:
    dense, held, expert, head = _weights(c)
    dense += held
    n_layers, k = c.num_hidden_layers, c.num_experts_per_tok
    active = expected_experts(c.n_routed_experts, k, batch)
    entries, keys = _attention(c, context)
    weights = dense_bytes(c, weight_bytes) + n_layers * active * expert * expert_bytes(c, weight_bytes)
    cache = batch * (entries * c.head_dim + keys * c.index_head_dim) * cache_bytes
    engram = batch * _engram_rows(c) * c.engram_head_dim * weight_bytes
    flops = 2 * batch * (dense + n_layers * k * expert + head)
    flops += 2 * batch * (2 * entries * c.head_dim * c.num_attention_heads + keys * c.index_head_dim * c.index_n_heads)
    nbytes = weights + cache + engram
    t_mem, t_flop = nbytes / ceil.copy_bytes_per_s, flops / ceil.bf16_flops
    return Roofline(nbytes, flops, max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute")


def prefill(c: ModelConfig, tokens: int, weight_bytes: int = 2, ceil: Ceilings = H200) -> Roofline:
    """One chunk of ``tokens`` from position 0: linear FLOPs of every token plus attention at
    the average position (half the chunk)."""
    dense, held, expert, head = _weights(c)
    dense += held
    entries, keys = _attention(c, tokens // 2)
    n_layers, k = c.num_hidden_layers, c.num_experts_per_tok
    flops = 2 * tokens * (dense + n_layers * k * expert)  # the head runs for the last row only
    flops += 2 * tokens * (2 * entries * c.head_dim * c.num_attention_heads + keys * c.index_head_dim * c.index_n_heads)
    nbytes = dense_bytes(c, weight_bytes) + n_layers * c.n_routed_experts * expert * expert_bytes(c, weight_bytes)
    nbytes += tokens * _engram_rows(c) * c.engram_head_dim * weight_bytes
    t_mem, t_flop = nbytes / ceil.copy_bytes_per_s, flops / (ceil.bf16_flops * PREFILL_MFU)
    return Roofline(nbytes, flops, max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute")
