"""source_format on quantization_config blocks shaped like the big releases' config.json, and their ignore
lists read with each library's own matching rule."""

import pytest

from jgptq_torch.source import companions, source_format

DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
DEEPSEEK_V31 = dict(DEEPSEEK_V3, scale_fmt="ue8m0")
QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
GPT_OSS = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                      "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
KIMI_K2_THINKING = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True},
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}


def fmt_of(qc):
    return source_format({"architectures": ["X"], "quantization_config": qc})


def test_fp8_releases():
    fmt = fmt_of(DEEPSEEK_V3)
    assert (fmt.name, fmt.block_size, fmt.scale_fmt, fmt.ignore) == ("fp8_block", (128, 128), "float", ())
    assert fmt_of(DEEPSEEK_V31).scale_fmt == "ue8m0"
    qwen = fmt_of(QWEN3_FP8)
    assert qwen.is_ignored("model.layers.0.mlp.gate") and qwen.is_ignored("lm_head")
    assert not qwen.is_ignored("model.layers.0.mlp.gate_proj")        # a module boundary, not a prefix
    assert not qwen.is_ignored("model.layers.10.mlp.gate")
    assert companions("model.layers.0.mlp.gate.weight", qwen) == []
    assert companions("model.layers.10.mlp.experts.3.gate_proj.weight", qwen) == [
        "model.layers.10.mlp.experts.3.gate_proj.weight_scale_inv"]


def test_gpt_oss_release():
    fmt = fmt_of(GPT_OSS)
    assert fmt.name == "mxfp4"
    assert fmt.is_ignored("model.layers.23.self_attn") and fmt.is_ignored("model.layers.0.mlp.router")
    assert not fmt.is_ignored("model.layers.0.mlp.experts")


def test_kimi_k2_thinking_release():
    fmt = fmt_of(KIMI_K2_THINKING)
    assert fmt.name == "pack_quantized"
    (scheme,) = fmt.schemes
    assert (scheme.num_bits, scheme.strategy, scheme.group_size, scheme.symmetric) == (4, "group", 32, True)
    for module in ("model.layers.3.self_attn.kv_a_proj_with_mqa", "model.layers.3.mlp.shared_experts.down_proj",
                   "model.layers.0.mlp.gate_proj", "lm_head"):
        assert fmt.is_ignored(module), module
    assert not fmt.is_ignored("model.layers.3.mlp.experts.17.gate_proj")
    assert not fmt.is_ignored("model.layers.3.mlp.gate")   # the router: not Linear-quantized, stored in float
    name = "model.layers.3.mlp.experts.17.down_proj.weight_packed"
    assert companions(name, fmt) == ["model.layers.3.mlp.experts.17.down_proj.weight_scale",
                                     "model.layers.3.mlp.experts.17.down_proj.weight_shape"]


def test_fp8_dynamic_release():
    fmt = fmt_of(FP8_DYNAMIC)
    assert fmt.name == "compressed_tensors" and fmt.schemes[0].format == "float-quantized"
    assert fmt.is_ignored("model.layers.5.mlp.gate") and not fmt.is_ignored("model.layers.5.mlp.gate_proj")
    assert companions("model.layers.5.mlp.experts.0.up_proj.weight", fmt) == [
        "model.layers.5.mlp.experts.0.up_proj.weight_scale"]


def test_quantization_config_must_be_an_object():
    with pytest.raises(ValueError, match=r"^config\.json: quantization_config must be an object, got str"):
        source_format({"quantization_config": "fp8"})
