"""DeepSeek's canonical tensor names from the stored schemes (spec §5): (a) DeepSeek release
names pass through, (b) and (c) HF names are renamed rule by rule; fused HF expert tensors and
quantisation-scale siblings are recognised by name."""

from __future__ import annotations

import re

# HF -> DeepSeek renames, applied in order (each with re.sub) after a leading
# "model." is stripped.  Canonical names are fixed points of every rule, so
# scheme (a) passes through untouched.  Order matters: the indexer is moved
# out of the compressor before the generic compressor rules run.
RENAMES: list[tuple[str, str]] = [
    (r"^lm_head\.weight$", "head.weight"),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.q_(a|b)_proj\.", r".wq_\1."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.o_(a|b)_proj\.", r".wo_\1."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    # HF's forward rule `.norm.` -> `.kv_norm.` is meant for compressor norms;
    # save_original_format=True inverts it blindly and writes the attention
    # kv_norm as `attn.norm`, which no DeepSeek checkpoint contains.
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    # DSpark Markov head: some tools name its factors markov_w1 / markov_w2 (spec §12.7).
    (r"\.markov_head\.markov_w1\.", ".markov_head.embed."),
    (r"\.markov_head\.markov_w2\.", ".markov_head.head."),
]
RENAME_RES = [(re.compile(p), r) for p, r in RENAMES]

# Fused HF expert tensors [E, n*rows, ...]: chunk i of dim 1 for expert e is
# canonical "{prefix}.{e}.{parts[i]}.weight" (gate_up_proj holds w1 rows first).
FUSED: list[tuple[re.Pattern[str], tuple[str, ...]]] = [
    (re.compile(r"^(.+\.ffn\.experts)\.gate_up_proj$"), ("w1", "w3")),
    (re.compile(r"^(.+\.ffn\.experts)\.down_proj$"), ("w2",)),
]

# Quantisation scales are siblings of "<base>.weight"; DeepSeek writes
# "<base>.scale", HF fine-grained FP8 writes "<base>.weight_scale_inv".
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def canonical_name(stored: str) -> str:
    """Map a stored tensor name of any supported scheme to DeepSeek's name."""
    name = stored[len("model.") :] if stored.startswith("model.") else stored
    if name.startswith(("vision.", "aligner.")):  # the vision tower's names are its own (`.mlp.` is no text FFN)
        return name
    for pattern, repl in RENAME_RES:
        name = pattern.sub(repl, name)
    return name
