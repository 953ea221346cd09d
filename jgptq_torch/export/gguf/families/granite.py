"""Granite MoE (``granitemoe``): llama's attention (normal RoPE, so Q/K rows are permuted) with Granite's four
multipliers (embedding, residual, attention score, logits), a softmax top-k router over experts whose gate and up
halves transformers keeps fused. Granite MoE Shared (``granitemoeshared``, the same llama.cpp architecture) adds a
shared MLP whose ``input_linear`` holds the gate rows then the up rows."""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, Target


def _meta(cfg, meta, key):
    k = gguf.Keys.LLM
    meta[key(gguf.Keys.Attention.SCALE)] = float(cfg.attention_multiplier)
    meta[key(k.EMBEDDING_SCALE)] = float(cfg.embedding_multiplier)
    meta[key(k.RESIDUAL_SCALE)] = float(cfg.residual_multiplier)
    meta[key(k.LOGIT_SCALE)] = float(cfg.logits_scaling)


def _shared_meta(cfg, meta, key):
    _meta(cfg, meta, key)
    if getattr(cfg, "shared_intermediate_size", 0):
        meta[key(gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)] = int(cfg.shared_intermediate_size)


def _shared_mlp(model, spec, param, tmap):
    """The shared MLP's fused ``input_linear`` (2 I, H) as ``ffn_gate_shexp`` (rows :I) and ``ffn_up_shexp``."""
    if not param.endswith(".shared_mlp.input_linear.weight"):
        return None
    owner = param[: -len(".shared_mlp.input_linear.weight")]
    width = int(model.config.shared_intermediate_size)
    return [Target(tmap.get_name(f"{owner}.mlp.shared_experts.{part}_proj") + ".weight", rows=rows)
            for part, rows in (("gate", slice(0, width)), ("up", slice(width, 2 * width)))]


_ALIASES = ((".block_sparse_moe.router", ".block_sparse_moe.router.layer"),
            (".block_sparse_moe.experts.", ".mlp.experts."))
FAMILIES = [
    Arch("granitemoe", gguf.MODEL_ARCH.GRANITE_MOE, permute_qk=True, meta=_meta, aliases=_ALIASES),
    Arch("granitemoeshared", gguf.MODEL_ARCH.GRANITE_MOE, permute_qk=True, meta=_shared_meta, aliases=_ALIASES,
         special=_shared_mlp),
]
