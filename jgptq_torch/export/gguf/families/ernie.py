"""ERNIE 4.5 MoE (``ernie4_5_moe``): llama.cpp's ``ernie4_5-moe``. Interleaved-pair rotary embedding as llama.cpp's
normal RoPE (no permutation), dense leading layers then experts every ``moe_layer_interval`` layers, a softmax
router whose correction bias (``moe_statics``) steers the choice only, renormalised top-k, shared experts of
``moe_intermediate_size x moe_num_shared_experts``."""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, Target, refuse


def _check(model, spec):
    cfg = model.config
    if getattr(cfg, "use_bias", False):
        refuse(model, "use_bias=True", "biases are not written by this exporter")
    last = int(cfg.num_hidden_layers) - 1
    end = getattr(cfg, "moe_layer_end_index", last)
    if end is not None and 0 <= int(end) < last:
        refuse(model, f"moe_layer_end_index={end}", "llama.cpp's ernie4_5-moe has experts up to the last layer")


def _meta(cfg, meta, key):
    k = gguf.Keys.LLM
    shared = int(getattr(cfg, "moe_num_shared_experts", 0) or 0)
    meta[key(k.EXPERT_COUNT)] = int(cfg.moe_num_experts)
    meta[key(k.EXPERT_USED_COUNT)] = int(cfg.moe_k)
    meta[key(k.INTERLEAVE_MOE_LAYER_STEP)] = int(cfg.moe_layer_interval)
    meta[key(k.LEADING_DENSE_BLOCK_COUNT)] = int(cfg.moe_layer_start_index)
    meta[key(k.EXPERT_FEED_FORWARD_LENGTH)] = int(cfg.moe_intermediate_size)
    meta[key(k.EXPERT_SHARED_COUNT)] = shared
    if shared:
        meta[key(k.EXPERT_SHARED_FEED_FORWARD_LENGTH)] = int(cfg.moe_intermediate_size) * shared


def _special(model, spec, param, tmap):
    if param.endswith(".gate.moe_statics.e_score_correction_bias"):
        owner = param[: -len(".gate.moe_statics.e_score_correction_bias")]
        return [Target(tmap.get_name(owner + ".moe_statics.e_score_correction") + ".bias", role="norm", flat=True)]
    return None


FAMILIES = [Arch("ernie4_5_moe", gguf.MODEL_ARCH.ERNIE4_5_MOE, permute_qk=False, check=_check, meta=_meta,
                 special=_special)]
