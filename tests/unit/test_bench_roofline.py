"""The roofline (``bench/roofline.py``) of a tiny V4.1 config against a count by hand from the
spec's shapes: every weight a decode step reads, the window and top-k entries of every
compressed layer, index keys only where a layer scores them (all of its source's, or the
candidate blocks' after the candidate source), and the Engram rows each token gathers."""

from __future__ import annotations

import pytest
from tiny import tiny_v4, tiny_v41

from deepinfer_fx.bench import roofline
from deepinfer_fx.config import config_from_dict


def _dense_by_hand(t: dict) -> tuple[int, int, int]:
    """(dense weight elements read, one routed expert's elements, head elements) of tiny_v41's
    shapes: embedding rows and Engram tables are gathered, not read whole."""
    d, q, h, hd, n = t["hidden_size"], t["q_lora_rank"], t["num_attention_heads"], t["head_dim"], t["hc_mult"]
    g, r, hi, di, i, e = (
        t["o_groups"],
        t["o_lora_rank"],
        t["index_n_heads"],
        t["index_head_dim"],
        t["moe_intermediate_size"],
        t["n_routed_experts"],
    )
    every = (
        2 * d  # attn_norm, ffn_norm
        + 2 * ((2 + n) * n * n * d + (2 + n) * n + 3)  # two mHC sites: fn, base, scale
        + q * d
        + q
        + h * hd * q
        + hd * d
        + hd
        + g * r * (h * hd // g)
        + d * g * r
        + h  # wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink
        + e * d
        + 2 * e  # gate, its bias and the image-span bias
        + 3 * i * d
    )  # the shared expert
    source = hd * d + hd + di * hd + di  # a KV source's compressor wkv and norm, the index keys' wk and k_norm
    gated = hd * d  # ... and its wgate where it pools (ratio > 1)
    index = hi * di * q + hi * d  # an index source's wq_b and weights_proj
    cols = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"] * t["engram_head_dim"]
    engram = (n + 1) * d * cols + 2 * n * d  # wkv, q_weight, k_weight
    ratios = t["compress_ratios"]
    dense = (
        t["num_hidden_layers"] * every
        + len(t["kv_source_layer_ids"]) * source
        + sum(gated for s in t["kv_source_layer_ids"] if ratios[s] > 1)
        + len(t["index_source_layer_ids"]) * index
        + len(t["engram_layer_ids"]) * engram
        + d
    )  # + the final norm
    return dense, 3 * i * d, t["vocab_size"] * d


def test_tiny_v41_decode_and_prefill_bytes_by_hand() -> None:
    t = tiny_v41()
    c = config_from_dict(t)
    dense, expert, head = _dense_by_hand(t)
    batch, context = 3, 40
    e, k = t["n_routed_experts"], t["num_experts_per_tok"]
    active = e * (1 - (1 - k / e) ** batch)
    # tiny_v41's layers: 0, 1 window only (8); 2, 3 ratio 2 (source 2); 4..7 ratio 1 (source 4,
    # the candidate source); index sources 2 (its 20 keys), 4 (all 40) and 6 (after the
    # candidate source: 2 blocks of 4 candidates); every compressed layer attends its top-5
    window, top = t["sliding_window"], t["index_topk"]
    entries = 2 * window + 2 * (window + min(top, context // 2)) + 4 * (window + min(top, context))
    keys = context // 2 + context + t["candidate_topk_blocks"] * t["candidate_block_size"]
    assert (entries, keys) == (94, 68)
    cache = batch * (entries * t["head_dim"] + keys * t["index_head_dim"]) * 2
    rows = len(t["engram_layer_ids"]) * (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]  # a token's Engram rows
    engram = batch * rows * t["engram_head_dim"] * 2
    weights = (dense + t["num_hidden_layers"] * active * expert + head) * 2
    got = roofline.decode(c, batch, context)
    assert got.bytes == pytest.approx(weights + cache + engram, rel=1e-12)
    assert got.bound == "memory"

    tokens = 24  # prefill: every weight once, each token's Engram rows
    want = (dense + t["num_hidden_layers"] * e * expert + head) * 2 + tokens * rows * t["engram_head_dim"] * 2
    assert roofline.prefill(c, tokens).bytes == pytest.approx(want, rel=1e-12)

    # routed experts held as stored: MXFP4 half a byte + a ue8m0 byte a 32, block FP8 a byte + fp32 scales
    for held, per in (("fp4", 0.5 + 1 / 32), ("fp8", 1 + 4 / 32**2)):
        q = c.replace(fp8_block=32, expert_dtype=held, held_experts=held)
        fewer = t["num_hidden_layers"] * active * expert * (2 - per)
        assert roofline.decode(q, batch, context).bytes == pytest.approx(weights + cache + engram - fewer, rel=1e-12)


def test_v4_counts_every_compressed_key_of_a_csa_layer() -> None:
    """V4 keeps its rule, by hand for tiny_v4 at 64 tokens (window 8, top-3): layer 0 window only
    (8 entries), CSA layers 1 and 3 score all 16 of their keys and attend 8 + 3, the HCA layer 2
    attends 8 + 64 / 8; no Engram."""
    c = config_from_dict(tiny_v4())
    assert roofline._attention(c, 64) == (8 + 2 * (8 + 3) + (8 + 8), 2 * 16)
    assert roofline._engram_rows(c) == 0


def test_another_gpus_ceilings_scale_the_bound_they_limit() -> None:
    """A bench on another GPU passes its own measured ceilings: half the bandwidth doubles a
    memory-bound decode's time, half the matmul rate a compute-bound prefill's; the bytes and
    FLOPs do not move."""
    c = config_from_dict(tiny_v4())
    h200 = roofline.H200
    slow_copy = roofline.Ceilings(h200.copy_bytes_per_s / 2, h200.bf16_flops, "test")
    slow_mm = roofline.Ceilings(h200.copy_bytes_per_s, h200.bf16_flops / 2, "test")
    d, d2 = roofline.decode(c, 1, 64), roofline.decode(c, 1, 64, ceil=slow_copy)
    assert d.bound == d2.bound == "memory" and d2.bytes == d.bytes
    assert d2.seconds == pytest.approx(2 * d.seconds)
    p, p2 = roofline.prefill(c, 1 << 20), roofline.prefill(c, 1 << 20, ceil=slow_mm)
    assert p.bound == p2.bound == "compute" and p2.flops == p.flops
    assert p2.seconds == pytest.approx(2 * p.seconds)
    assert slow_copy.as_dict()["copy_tb_s"] == pytest.approx(h200.copy_bytes_per_s / 2e12, abs=1e-3)


def test_dense_weights_held_in_fp8_count_a_byte_and_their_scales() -> None:
    """``dense_format="fp8"``: every block-FP8 dense projection reads a byte an element plus an fp32
    scale a 32 x 32 block instead of two bytes; the FLOPs stay."""
    c = config_from_dict(tiny_v4()).replace(fp8_block=32)
    held = c.replace(held_dense="fp8")
    fp8 = sum(s.numel for s in roofline.param_specs(held, mtp=False) if s.held == "fp8" and not s.stacked)
    assert fp8 > 0
    a, b = roofline.decode(c, 4, 64), roofline.decode(held, 4, 64)
    assert a.bytes - b.bytes == pytest.approx(fp8 * (2 - (1 + 4 / 32**2)), rel=1e-12)
    assert a.flops == b.flops
    assert roofline.prefill(c, 64).flops == roofline.prefill(held, 64).flops
