# ruff: noqa: C408 -- configs read best as keyword arguments
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
    # every other MoE causal LM of transformers whose tiny model builds (its modeling module uses the experts
    # interface): per-layer lists cut to the first layer of each kind, MLA heads of 8 rotary + 8 other dimensions,
    # token ids outside the tiny vocabulary dropped
    "aria_text": ("AriaTextConfig", "AriaTextForCausalLM",
        dict(head_dim=16, intermediate_size=128, num_key_value_heads=4, moe_num_experts=8, moe_topk=2)),
    "axk1": ("AXK1Config", "AXK1ForCausalLM",
        dict(mlp_layer_types=['dense', 'sparse'], head_dim=8, intermediate_size=128, moe_intermediate_size=32,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
             num_key_value_heads=4, bos_token_id=None, eos_token_id=None, q_lora_rank=32, n_routed_experts=8,
             num_experts_per_tok=2, n_group=2, topk_group=1)),
    "axk2": ("AXK2Config", "AXK2ForCausalLM",
        dict(mlp_layer_types=['dense', 'sparse'], layer_types=['indexed_attention', 'indexed_attention'], head_dim=8,
             intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=8,
             num_key_value_heads=4, bos_token_id=None, eos_token_id=None, q_lora_rank=32, n_routed_experts=8,
             num_experts_per_tok=2)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
        dict(num_hidden_layers=3, layer_types=['linear_attention', 'linear_attention', 'full_attention'],
             mlp_layer_types=['dense', 'sparse', 'sparse'], expert_swiglu_limit_list=[0, 0, 0],
             share_expert_swiglu_limit_list=[0, 0, 0], head_dim=8, intermediate_size=128, moe_intermediate_size=32,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
             num_key_value_heads=4, pad_token_id=None, eos_token_id=None, num_experts=8, num_experts_per_token=2,
             first_k_dense_replace=1, num_expert_group=2, topk_group=1, linear_head_dim=16, linear_num_heads=4,
             num_nextn_predict_layers=0)),
    "beam": ("BeamConfig", "BeamForCausalLM",
        dict(num_hidden_layers=3, layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
             mlp_layer_types=['dense', 'sparse', 'sparse'], head_dim=16, intermediate_size=128,
             moe_intermediate_size=32, sliding_window=16, num_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1)),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM",
        dict(layer_types=['sliding_attention', 'full_attention'], mlp_layer_types=['sparse', 'sparse'], head_dim=16,
             intermediate_size=128, sliding_window=16, num_key_value_heads=4, eos_token_id=None, num_experts=8,
             num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
        dict(head_dim=8, intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, num_key_value_heads=4, q_lora_rank=32,
             n_routed_experts=8, num_experts_per_tok=2)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
        dict(mlp_layer_types=['dense', 'sparse'], layer_types=['indexed_attention', 'indexed_attention'], head_dim=8,
             intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=8,
             num_key_value_heads=4, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, first_k_dense_replace=1)),
    # GLM-5: MLA with a DSA indexer; layer 1 ("S") reuses the top-k token indices layer 0's indexer returns
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
        dict(head_dim=8, intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, q_lora_rank=32, n_routed_experts=8,
             num_experts_per_tok=2, mlp_layer_types=['dense', 'sparse'], index_head_dim=16, index_n_heads=2,
             index_topk=8, index_topk_pattern="FS")),
    # Hunyuan V4: MLA with a DSA indexer and hyper-connections; layer 1 ("shared") reuses layer 0's top-k indices
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM",
        dict(head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, index_topk=8,
             index_head_dim=16, index_n_heads=2, num_key_value_heads=4, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, indexer_types=["full", "shared"], mlp_layer_types=["sparse", "sparse"])),
    # Kolibri 1.1: layer 2 reads the keys and values layer 1 wrote into the container the forward hands every layer,
    # and the candidate pool layer 1's indexer returns
    "kolibri1_1": ("Kolibri1_1Config", "Kolibri1_1ForCausalLM",
        dict(num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             shared_expert_intermediate_size=32, index_topk=8, index_pool_size=64, index_compression=4,
             index_num_heads=2, index_num_local_tokens=4, index_num_sink_tokens=2, mlp_only_intermediate_size=64,
             sliding_window=16, layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
             index_layers=[1], kv_source_layers=[0, 1, 1], mlp_only_layers=[0])),
    # experts as blocks of rows of 2-D parameters run by the model's own loop; sizes under DBRX's own names
    "dbrx": ("DbrxConfig", "DbrxForCausalLM",
        dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
             attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM",
        dict(layer_types=['heavily_compressed_attention', 'compressed_sparse_attention'],
             mlp_layer_types=['hash_moe', 'moe'], head_dim=16, moe_intermediate_size=32, qk_rope_head_dim=2,
             index_head_dim=16, index_n_heads=2, index_topk=4, sliding_window=16, num_key_value_heads=1,
             q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16)),
    "dots3_note_text": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM",
        dict(num_hidden_layers=3, mlp_layer_types=['dense', 'sparse', 'sparse'],
             layer_types=['indexed_attention', 'indexed_attention', 'sliding_attention'], head_dim=16,
             intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=8, sliding_window=16,
             num_key_value_heads=4, pad_token_id=None, bos_token_id=None, eos_token_id=None, q_lora_rank=32,
             n_routed_experts=8, num_experts_per_tok=2,
             per_layer_config={'02': {'num_attention_heads': 2, 'num_key_value_heads': 2, 'kv_lora_rank': 32, 'qk_nope_head_dim': 8}})),
    "ergo": ("ErgoConfig", "ErgoForCausalLM",
        dict(num_hidden_layers=3, layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
             mlp_layer_types=['dense', 'sparse', 'sparse'], moe_intermediate_size=32, shared_intermediate_size=64,
             sliding_window=16, first_dense_intermediate_size=128, num_experts=8, num_experts_per_tok=2)),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM",
        dict(num_hidden_layers=3, layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
             mlp_layer_types=['dense', 'sparse', 'sparse'], intermediate_size=128, moe_intermediate_size=32,
             sliding_window=16, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM",
        dict(intermediate_size=128, num_key_value_heads=4, pad_token_id=None, eos_token_id=None, num_experts=8,
             num_experts_per_tok=2)),
    "flint": ("FlintConfig", "FlintForCausalLM",
        dict(layer_types=['full_attention', 'sliding_attention'], head_dim=16, intermediate_size=128,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, sliding_window=16, num_experts=8,
             num_experts_per_tok=2, mlp_only_layers=[0])),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
        dict(layer_types=['sliding_attention', 'full_attention'], head_dim=16, intermediate_size=128,
             sliding_window=16, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
             vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
             per_layer_config={'01': {'head_dim': 32}})),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
        dict(mlp_layer_types=['dense', 'sparse'], intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, num_key_value_heads=4,
             q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM",
        dict(layer_types=['full_attention', 'sliding_attention'], layer_rope_theta=[10000.0, 10000.0],
             intermediate_size=128, shared_intermediate_size=64, sliding_window=16, num_key_value_heads=4,
             num_local_experts=8, num_experts_per_tok=2)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
        dict(layer_types=['mamba', 'attention'], intermediate_size=128, shared_intermediate_size=64,
             mamba_d_state=16, mamba_n_heads=8, mamba_d_head=16, num_key_value_heads=4, num_local_experts=8,
             num_experts_per_tok=2, mamba_chunk_size=8)),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM",
        dict(mlp_layer_types=['dense', 'sparse'], head_dim=16, intermediate_size=128, moe_intermediate_size=32,
             num_experts=8, num_experts_per_tok=2)),
    "inkling2_text": ("Inkling2TextConfig", "Inkling2ForCausalLM",
        dict(layer_types=['hybrid_sliding', 'hybrid'], head_dim=16, moe_intermediate_size=32, eos_token_id=None,
             n_routed_experts=8, num_experts_per_tok=2, unpadded_vocab_size=128, swa_num_attention_heads=4,
             swa_head_dim=16, swa_num_key_value_heads=2, sliding_window_size=16,
             rel_extent=16)),
    "inkling2_loop_text": ("Inkling2LoopTextConfig", "Inkling2LoopForCausalLM",
        dict(layer_types=['hybrid_sliding', 'hybrid'], head_dim=16, moe_intermediate_size=32, eos_token_id=None,
             n_routed_experts=8, num_experts_per_tok=2, unpadded_vocab_size=128, swa_num_attention_heads=4,
             swa_head_dim=16, swa_num_key_value_heads=2, sliding_window_size=16,
             rel_extent=16)),
    "jamba": ("JambaConfig", "JambaForCausalLM",
        dict(intermediate_size=128, mamba_d_state=8, num_experts=8, num_experts_per_tok=2, attn_layer_period=2,
             attn_layer_offset=0, expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=16,
             use_mamba_kernels=False)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
        dict(num_hidden_layers=3, mlp_layer_types=['dense', 'sparse', 'sparse'],
             layer_types=['linear_attention', 'linear_attention', 'full_attention'], head_dim=8,
             intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, num_key_value_heads=4, pad_token_id=None,
             bos_token_id=None, eos_token_id=None, num_experts=8, num_experts_per_token=2, linear_head_dim=16)),
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM",
        dict(layer_types=['sliding_attention', 'full_attention'], head_dim=16, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, sliding_window=16, num_local_experts=8, num_experts_per_tok=2)),
    "laguna": ("LagunaConfig", "LagunaForCausalLM",
        dict(layer_types=['full_attention', 'full_attention'], num_attention_heads_per_layer=[4, 4],
             mlp_layer_types=['dense', 'sparse'], head_dim=16, intermediate_size=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, sliding_window=16, num_experts=8, num_experts_per_tok=2)),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM",
        dict(num_layers=2, head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             qk_head_dim=16, ffn_hidden_size=128, expert_ffn_hidden_size=32, num_key_value_heads=4, q_lora_rank=32,
             n_routed_experts=8, moe_topk=2)),
    "mellum": ("MellumConfig", "MellumForCausalLM",
        dict(layer_types=['full_attention', 'full_attention'], mlp_layer_types=['sparse', 'sparse'], head_dim=16,
             intermediate_size=128, moe_intermediate_size=32, sliding_window=16, num_local_experts=8,
             num_experts_per_tok=2)),
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM",
        dict(layer_types=['full_attention', 'sliding_attention'], mlp_layer_types=['dense', 'sparse'], head_dim=16,
             intermediate_size=128, moe_intermediate_size=32, v_head_dim=16, sliding_window=16, n_routed_experts=8,
             num_experts_per_tok=2)),
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM",
        dict(mlp_layer_types=['dense', 'sparse'], head_dim=16, intermediate_size=128, moe_intermediate_size=32,
             eos_token_id=None, n_routed_experts=8, num_experts_per_tok=2)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
        dict(layer_types=['full_attention', 'linear_attention'], intermediate_size=128, num_local_experts=8,
             num_experts_per_tok=2)),
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM",
        dict(mlp_layer_types=['sparse', 'sparse'], layer_types=['full_attention', 'full_attention'], head_dim=16,
             intermediate_size=128, shared_intermediate_size=64, index_head_dim=16, index_n_heads=2,
             dense_intermediate_size=128, bos_token_id=None, eos_token_id=None, num_local_experts=8,
             num_experts_per_tok=2)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
        dict(head_dim=16, intermediate_size=128, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
             mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_routed_experts=8, num_experts_per_tok=2,
             n_groups=2, chunk_size=8)),
    "qwen4_exp_text": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM",
        dict(layer_types=['linear_attention', 'indexed_attention'], head_dim=16, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
             hc_lowrank=16, ple_embed_dim=64, ngram_vocab_size_base=256, heads_per_ngram=2, split_ngram_parts=4)),
    "sarvam_mla": ("SarvamMLAConfig", "DeepseekV3ForCausalLM",
        dict(head_dim=8, intermediate_size=128, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, num_key_value_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, first_k_dense_replace=1)),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM",
        dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)),
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
