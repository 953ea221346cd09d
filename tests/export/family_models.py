"""Tiny models of every GGUF family, small enough for llama.cpp's converter and C library in a second or two."""

import torch

from tests.export.converter import VOCAB

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, tie_word_embeddings=False)

# family -> (config class, model class, settings over COMMON). ``scoring_func="sigmoid"``: transformers' routers of
# these families are sigmoid whatever the config says; llama.cpp's converter writes the gating function only from
# this key (the original checkpoints' configs have it).
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128, head_dim=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=32, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                         num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16, scoring_func="sigmoid")),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_key_value_heads=4,
                   n_routed_experts=8,
                      num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                      attention_bias=True, use_qk_norm=True, routed_scaling_factor=1.5,
                      num_nextn_predict_layers=0)),  # transformers has no MTP layer; the converter would count one
    "dots1": ("Dots1Config", "Dots1ForCausalLM",
              dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_key_value_heads=4,
                   n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                   norm_topk_prob=True, routed_scaling_factor=1.5, scoring_func="sigmoid")),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(intermediate_size=32, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                        rotary_dim=8, scoring_func="sigmoid")),  # the converter reads rotary_dim
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
                        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=64, embedding_multiplier=2.0, residual_multiplier=0.5,
                              attention_multiplier=0.2, logits_scaling=3.0)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=32, moe_num_experts=8,
                          moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2,
                          head_dim=16)),  # the converter's shared width is intermediate_size // kv heads: 32 here
    # gpt-oss's own YaRN settings but truncate=True (llama.cpp's rounding of the correction range; see the family's
    # module) and a window shorter than the tests' sequences
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                     max_position_embeddings=131072,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": True,
                                      "original_max_position_embeddings": 4096})),
    # four layers: experts in layers 1 and 3 (interleave step 2), layer 3 without rotary embedding (llama.cpp's
    # fixed pattern); llama3 rope scaling with frequencies in each of its three bands
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    dict(num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=128, head_dim=16,
                         num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})),
    # the released checkpoints' settings: NTK alpha rotary scaling (its converter takes head_dim 128, alpha 1000,
    # base 10000) and per-layer lists of top-k, expert width and shared-expert count
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                       dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            max_position_embeddings=32768, intermediate_size=32, num_experts=4, moe_topk=[2, 2],
                            moe_intermediate_size=[32, 32], num_shared_expert=[1, 1],
                            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                             "rope_theta": 10000.0})),
    # a dense short-convolution layer, then experts after attention and after a convolution
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], intermediate_size=128,
                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                      tie_word_embeddings=True)),  # as released (its converter maps no lm_head)
    # four layers: three sliding (window 16 < the tests' 32 tokens) with rotary embedding, then a global one; a dense
    # first layer; route_norm as the released configs write it (the converter reads it, transformers always norms)
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM",
              dict(num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=4,
                   num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, sliding_window=16,
                   mup_enabled=True, route_scale=2.0, route_norm=True)),
    # three gated-delta-net (linear attention) layers, then gated full attention with partial rotary embedding (the
    # released pattern); twice as many value heads as key heads; every layer experts and a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "head_dim": 16, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 8,
                    "num_experts_per_tok": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    # Qwen3-Next's layers with the linear attention's projections apart and value heads reordered for llama.cpp;
    # rotary sections of the 2 rotated pairs of a head of 16 (the released ones cover 32 pairs of 256)
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         {"num_hidden_layers": 4, "head_dim": 16, "moe_intermediate_size": 32,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
                          "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                          "linear_value_head_dim": 16}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # mixtures of MLP experts and of attention experts (query and output projections), kv_channels per head
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM",
               {"kv_channels": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
# no GGUF export: built to be refused by the GGUF exporter
REFUSED = {"phimoe", "jetmoe"}
# families whose converter reads only another vocabulary format (SentencePiece; tiktoken ranks for hunyuan): it is
# made to read the tests' BPE one as GPT-2's
BPE_VOCAB = {"ernie4_5_moe", "hunyuan_v1_moe"}
# the converter's extra arguments per family: Qwen3-Next's and Qwen3.5's converters expect multi-token-prediction tensors, which
# transformers' model does not hold, unless told to leave them out
CONVERTER_ARGS = {"qwen3_next": ("--no-mtp",), "qwen3_5_moe_text": ("--no-mtp",)}


def build(family: str, seed: int = 0, **overrides):
    """A tiny float32 model of ``family`` (eval mode, weights drawn with ``seed``; biases, where the family has
    them, and weights a family initialises to zero drawn too so that they are not all zero; attention sinks from
    N(0, 1) so that heads differ)."""
    import transformers

    cfg_name, model_name, extra = MODELS[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("bias") or (p.ndim >= 2 and not p.any()):   # e.g. AFMoE's router starts at zero
                p.normal_(0, 0.02)
            elif name.endswith(".sinks"):
                p.normal_(0, 1.0)
    return model
