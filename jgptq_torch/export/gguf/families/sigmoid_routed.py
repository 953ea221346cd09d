"""Families whose routers score experts with a sigmoid and choose with a correction bias (``exp_probs_b``), and
whose attention is Qwen3's (Q/K norms, NeoX rotary): dots.llm1 (``dots1``: DeepSeek-V3 routing with groups,
shared experts, dense leading layers; multi-head attention only) and MiniMax-M2 (``minimax-m2``: renormalised
top-k, Q/K norms over the whole projection, partial rotary)."""

import gguf

from jgptq_torch.export.gguf.families.base import (Arch, check_groups, correction_bias, head_dim, refuse,
                                                   rope_parameters, sigmoid_routing)


def _dots1_check(model, spec):
    cfg = model.config
    check_groups(model, spec)
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        refuse(model, "num_key_value_heads != num_attention_heads",
               "llama.cpp's dots1 loads K and V with as many heads as Q (multi-head attention only)")
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        refuse(model, f"layer_types {sorted(kinds)}", "llama.cpp's dots1 graph attends to the whole context")


def _dots1_meta(cfg, meta, key):
    sigmoid_routing(cfg, meta, key, always_norm=True)


def _minimax_meta(cfg, meta, key):
    k = gguf.Keys.LLM
    partial = float(rope_parameters(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    meta[key(gguf.Keys.Rope.DIMENSION_COUNT)] = int(head_dim(cfg) * partial)
    meta[key(k.EXPERT_FEED_FORWARD_LENGTH)] = int(cfg.intermediate_size)
    meta[key(k.EXPERT_GATING_FUNC)] = gguf.ExpertGatingFuncType.SIGMOID.value  # transformers' router


FAMILIES = [
    Arch("dots1", gguf.MODEL_ARCH.DOTS1, permute_qk=False, expert_ff="moe_intermediate_size", check=_dots1_check,
         meta=_dots1_meta, special=correction_bias, window_from_layer_types=True),
    Arch("minimax_m2", gguf.MODEL_ARCH.MINIMAXM2, permute_qk=False, output_required=True, meta=_minimax_meta,
         special=correction_bias),
]
