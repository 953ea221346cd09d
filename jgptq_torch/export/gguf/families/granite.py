"""Granite MoE (``granitemoe``): llama's attention (normal RoPE, so Q/K rows are permuted) with Granite's four
multipliers (embedding, residual, attention score, logits), a softmax top-k router over experts whose gate and up
halves transformers keeps fused."""

import gguf

from jgptq_torch.export.gguf.families.base import Arch


def _meta(cfg, meta, key):
    k = gguf.Keys.LLM
    meta[key(gguf.Keys.Attention.SCALE)] = float(cfg.attention_multiplier)
    meta[key(k.EMBEDDING_SCALE)] = float(cfg.embedding_multiplier)
    meta[key(k.RESIDUAL_SCALE)] = float(cfg.residual_multiplier)
    meta[key(k.LOGIT_SCALE)] = float(cfg.logits_scaling)


FAMILIES = [Arch("granitemoe", gguf.MODEL_ARCH.GRANITE_MOE, permute_qk=True, meta=_meta,
                 aliases=((".block_sparse_moe.router", ".block_sparse_moe.router.layer"),
                          (".block_sparse_moe.experts.", ".mlp.experts.")))]
