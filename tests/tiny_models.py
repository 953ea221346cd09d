"""Tiny random transformers models of several families (CPU, float32) and helpers for the torch-side tests."""

import torch

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=None)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                         num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128, head_dim=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=8, num_experts_per_tok=2)),
    # Llama 4 text: routed experts pre-scaled by a sigmoid routing score, a shared expert, and (with
    # interleave_moe_layer_step=2) a dense MLP in every other layer
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(intermediate_size=32, intermediate_size_mlp=128, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=1)),
    # a shared MLP beside softmax-routed experts in every layer; Q/K norms after the rotary embedding
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
                       dict(intermediate_size=32, head_dim=16, num_experts=4, moe_topk=2)),
    # short-convolution and attention layers; a dense first layer, then sigmoid-routed experts
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], intermediate_size=128,
                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1)),
    # gated attention with pre/post norms, a dense first layer, sigmoid-routed experts beside a shared one
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM",
              dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=4, num_experts_per_tok=2,
                   num_shared_experts=1, num_dense_layers=1, sliding_window=16, mup_enabled=True)),
}


def build(family: str, seed: int = 0, **overrides):
    """A tiny float32 model of ``family`` in eval mode, weights drawn with ``seed``."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    if family == "gpt_oss":  # expert biases start at zero: randomise them to exercise has_bias
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("_bias"):
                    p.normal_(0, 0.02)
    return model


def token_ids(n: int, length: int, seed: int, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def next_token_kl(reference, model, ids) -> float:
    """Mean KL(reference || model) of the next-token distributions over every position of ``ids``."""
    with torch.no_grad():
        p = torch.log_softmax(reference(ids).logits.double(), -1)
        q = torch.log_softmax(model(ids).logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def chunk_budget(float_model, result, per_chunk: int, layer: int = 0) -> int:
    """The device budget (cpu offload) under which decoder layer ``layer`` of ``float_model`` fits ``per_chunk``
    routed experts at a time and no more: the tensors outside the layers plus the layer's need with that chunk
    (``result``: a run of the same model and calibration, for its measured activations)."""
    from jgptq_torch import models
    from jgptq_torch.pipeline import offload

    mem = result.report.memory
    decoder = float_model.model.layers[layer]
    work = offload.layer_need(decoder, models.layer_targets(decoder), mem["activations_measured"],
                              result.config.moe.calibration == "all_experts")
    assert work.need(per_chunk).total < work.need(per_chunk + 1).total
    return mem["other_on_device"] + work.need(per_chunk).total
