"""LFM2-MoE (``lfm2_moe``, transformers' ``Lfm2MoeForCausalLM``): llama.cpp's ``lfm2moe``.

A hybrid: layers marked ``conv`` in ``layer_types`` run a gated short convolution (``in_proj`` to B, C, x; a
causal depthwise convolution of B*x over ``conv_L_cache`` positions; C times that through ``out_proj``), the
others attention with per-head Q/K norms before the NeoX rotary embedding; the metadata's per-layer KV head
count is 0 on the convolution layers, which is how llama.cpp tells them apart. Feed-forward: dense SwiGLU in the
first ``num_dense_layers`` layers, then sigmoid-scored experts chosen with a correction bias (``exp_probs_b``) and
always renormalised. The convolution kernel (hidden, 1, L) is written as llama.cpp's (hidden, L) and stays
float32 (its projections are ordinary weights).
"""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, ConvKernel, Target, refuse, require_mha_width


def _check(model, spec):
    cfg = model.config
    require_mha_width(model, spec)
    kinds = set(cfg.layer_types)
    if not kinds <= {"conv", "full_attention"}:
        refuse(model, f"layer_types {sorted(kinds)}", "llama.cpp's lfm2moe has short-convolution and full-attention "
               "layers only")
    if cfg.conv_bias:
        refuse(model, "conv_bias=True", "llama.cpp's lfm2moe loads no convolution or projection biases")
    if not cfg.use_expert_bias:
        refuse(model, "use_expert_bias=False", "llama.cpp's lfm2moe loads the router's correction bias (exp_probs_b)")
    if not cfg.norm_topk_prob:
        refuse(model, "norm_topk_prob=False", "llama.cpp's lfm2moe always renormalises the top-k weights")
    if float(cfg.routed_scaling_factor) != 1.0:
        refuse(model, f"routed_scaling_factor={cfg.routed_scaling_factor}", "llama.cpp's lfm2moe does not scale "
               "the routed experts' weights")


def _meta(cfg, meta, key):
    k = gguf.Keys.LLM
    kv = int(cfg.num_key_value_heads)
    meta[key(gguf.Keys.Attention.HEAD_COUNT_KV)] = [kv if t == "full_attention" else 0 for t in cfg.layer_types]
    meta[key(k.EXPERT_FEED_FORWARD_LENGTH)] = int(cfg.moe_intermediate_size)
    meta[key(k.LEADING_DENSE_BLOCK_COUNT)] = int(cfg.num_dense_layers)
    meta[key(k.EXPERT_GATING_FUNC)] = gguf.ExpertGatingFuncType.SIGMOID.value
    meta[key(gguf.Keys.ShortConv.L_CACHE)] = int(cfg.conv_L_cache)


def _special(model, spec, param, tmap):
    if param == "lm_head.weight":   # the name map of lfm2moe has no head; llama.cpp loads one named as usual
        tied = bool(model.config.tie_word_embeddings)
        return [] if tied else [Target(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight", role="output")]
    if param.endswith(".feed_forward.expert_bias"):
        return [Target(tmap.get_name(param) + ".bias", role="norm")]
    if param.endswith(".conv.conv.weight"):
        return [Target(tmap.get_name(param[: -len(".weight")]) + ".weight", role="norm", split=ConvKernel())]
    return None


FAMILIES = [Arch("lfm2_moe", gguf.MODEL_ARCH.LFM2MOE, permute_qk=False, expert_ff="moe_intermediate_size",
                 check=_check, meta=_meta, special=_special)]
