"""The family entries' own rules, without llama.cpp: refusals of settings llama.cpp's graph for the family would
compute differently, deepseek2's split of kv_b_proj and gpt-oss's split of its interleaved gate_up (weights and
biases) against numpy references."""

import gguf
import numpy as np
import pytest

from jgptq_torch.export.gguf.arch import UnsupportedGGUFModel, arch_of, targets
from jgptq_torch.export.gguf.export import export_gguf
from tests.export.family_models import MODELS, build
from tests.export.gguf_models import field, read


def yarn(**changes):
    """The tiny gpt-oss's YaRN settings with ``changes``."""
    return {**MODELS["gpt_oss"][2]["rope_parameters"], **changes}


@pytest.mark.parametrize("family,overrides,match", [
    ("dots1", dict(num_key_value_heads=2), "multi-head attention only"),
    ("dots1", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=16), "whole context"),
    ("deepseek_v3", dict(rope_interleave=False), "interleaved"),
    ("deepseek_v3", dict(n_group=3, topk_group=1), "groups"),
    ("phimoe", {}, "sparsemixer"),
    ("ernie4_5_moe", dict(moe_layer_end_index=1), "up to the last layer"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "hard-codes alpha 1.702 and limit 7.0"),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "alternates sliding-window"),
    ("gpt_oss", {"rope_parameters": yarn(beta_fast=16.0)}, "uses 32.0"),
    ("gpt_oss", {"rope_parameters": yarn(attention_factor=1.2)}, "does not read it"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "'yarn'"),
    ("qwen3_moe", {"rope_parameters": yarn()}, "rope_type 'yarn'"),  # yarn is read per family
    ("llama4_text", dict(no_rope_layer_interval=2), "every 4th layer only"),
    ("llama4_text", dict(attention_chunk_size=None), "attends in chunks"),
    ("llama4_text", dict(attention_chunk_size=4096), "chunks of 8192"),
    ("llama4_text", dict(attn_scale=0.2), "temperature"),
    ("llama4_text", dict(use_qk_norm=False), "128 experts"),
    ("llama4_text", dict(moe_layers=[0, 1, 2, 3]), "interleave_moe_layer_step=2"),
    ("hunyuan_v1_moe", dict(moe_topk=[2, 1]), "one value for every layer"),
    ("hunyuan_v1_moe", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "sequence length"),
    ("lfm2_moe", dict(conv_bias=True), "no convolution or projection biases"),
    ("lfm2_moe", dict(use_expert_bias=False), "correction bias"),
    ("lfm2_moe", dict(norm_topk_prob=False), "always renormalises"),
    ("lfm2_moe", dict(routed_scaling_factor=2.0), "does not scale"),
    ("afmoe", dict(global_attn_every_n_layers=2, layer_types=None), "every 4th layer"),
    ("afmoe", dict(mup_enabled=False), "sqrt"),
    ("qwen3_next", {"layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"]},
     "every n-th layer full attention"),
    ("qwen3_next", {"linear_value_head_dim": 32}, "value heads as its key heads"),
    ("qwen3_next", {"mlp_only_layers": [0]}, "experts in every layer"),
    ("qwen3_next", {"norm_topk_prob": False}, "norm_topk_prob=True"),
    ("qwen3_5_moe_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "cover the 2 rotated pairs"),
    ("qwen3_5_moe_text", {"layer_types": ["linear_attention", "full_attention", "linear_attention",
                                          "linear_attention"]}, "every n-th layer"),
])
def test_refusals(family, overrides, match):
    model = build(family, **overrides)
    with pytest.raises(UnsupportedGGUFModel, match=match):
        arch_of(model)


def test_deepseek2_kv_b_split(tmp_path):
    """attn_k_b is each head's key rows of kv_b_proj transposed, attn_v_b its value rows (the converter's layout,
    read back from the file)."""
    model = build("deepseek_v3")
    cfg = model.config
    _, tensors = read(export_gguf(model, None, tmp_path / "d.gguf", float_type="f32"))
    kv_b = model.model.layers[1].self_attn.kv_b_proj.weight.detach().numpy().astype(np.float64)
    h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    per_head = kv_b.reshape(h, nope + v, cfg.kv_lora_rank)
    k_b = np.asarray(tensors["blk.1.attn_k_b.weight"].data)
    v_b = np.asarray(tensors["blk.1.attn_v_b.weight"].data)
    assert k_b.shape == (h, cfg.kv_lora_rank, nope) and v_b.shape == (h, v, cfg.kv_lora_rank)
    for head in range(h):
        np.testing.assert_array_equal(k_b[head], per_head[head, :nope].T)
        np.testing.assert_array_equal(v_b[head], per_head[head, nope:])
    plan = targets(model, arch_of(model))
    assert [t.name for t in plan["model.layers.1.self_attn.kv_b_proj.weight"]] == [
        "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"]
    assert [t.name for t in plan["model.layers.1.mlp.gate.e_score_correction_bias"]] == ["blk.1.exp_probs_b.bias"]


def test_gpt_oss_tensors_and_yarn_keys(tmp_path):
    """gpt-oss's interleaved gate_up (stored (E, H, 2I)) becomes ffn_gate_exps (columns 0, 2, ...) and ffn_up_exps
    (1, 3, ...) in (E, I, H), weights and biases alike; sinks and biases are float32 in an f16 file; YaRN's keys
    carry the config's values. A truncate=False config is exported with a warning (llama.cpp rounds the range)."""
    model = build("gpt_oss", rope_parameters=yarn(truncate=False))
    with pytest.warns(UserWarning, match="truncate=False"):
        reader, tensors = read(export_gguf(model, None, tmp_path / "g.gguf", float_type="f16"))
    experts = model.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().numpy().transpose(0, 2, 1)   # (E, 2I, H)
    bias = experts.gate_up_proj_bias.detach().numpy()
    for part, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
        w = tensors[f"blk.1.ffn_{part}_exps.weight"]
        assert w.tensor_type == gguf.GGMLQuantizationType.F16
        np.testing.assert_array_equal(np.asarray(w.data), gate_up[:, cols].astype(np.float16))
        b = tensors[f"blk.1.ffn_{part}_exps.bias"]
        assert b.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(b.data), bias[:, cols])
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_down_exps.bias"].data),
                                  experts.down_proj_bias.detach().numpy())
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_sinks.weight"].data),
                                  model.model.layers[1].self_attn.sinks.detach().numpy())
    for name in ("blk.1.attn_output.bias", "blk.1.ffn_gate_inp.bias", "blk.1.attn_sinks.weight"):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32, name
    rope = MODELS["gpt_oss"][2]["rope_parameters"]
    assert field(reader, "gpt-oss.rope.scaling.type") == "yarn"
    assert field(reader, "gpt-oss.rope.scaling.factor") == rope["factor"]
    assert field(reader, "gpt-oss.rope.scaling.original_context_length") == rope["original_max_position_embeddings"]
    assert field(reader, "gpt-oss.attention.sliding_window") == model.config.sliding_window
