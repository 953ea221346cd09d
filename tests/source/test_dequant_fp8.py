"""FP8 e4m3 with 128x128 block scales, read back from tiny Qwen3-MoE folders written in that format, against a
float64 numpy decoding of the format and against transformers' own FP8 dequantizing load."""

import numpy as np
import pytest
import torch

from jgptq_torch.source import companions, dequantize_tensors, source_format
from tests.source.quantized_folders import read_checkpoint, write_fp8_folder


def e4m3_decode(bits: np.ndarray) -> np.ndarray:
    """float64 value of e4m3fn bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal;
    S.1111.111 NaN."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * np.exp2(exp - 7.0))
    return np.where((exp == 15) & (man == 7), np.nan, sign * value)


def reference_fp8(weight: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> np.ndarray:
    """float32 result of the format's definition: each element times its block's scale (ragged edge blocks),
    exact in float64, then rounded once to float32."""
    w = e4m3_decode(weight.view(torch.uint8).numpy())
    s = scale.to(torch.float64).numpy()
    rows, cols = w.shape
    full = np.empty_like(w)
    for i in range(rows):
        for j in range(cols):
            full[i, j] = w[i, j] * s[i // block[0], j // block[1]]
    return full.astype(np.float32)


def tiny_qwen3_moe(hidden, moe_inter, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=moe_inter,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         num_experts=3, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


def read_folder(path):
    return read_checkpoint(path)


@pytest.fixture(scope="module")
def ragged_folder(tmp_path_factory):
    """hidden 192 and expert width 160: 1.5 and 1.25 blocks of 128, so every matrix has ragged edge blocks."""
    path = str(tmp_path_factory.mktemp("fp8_ragged"))
    write_fp8_folder(tiny_qwen3_moe(192, 160), path, block=128, ignore=("model.layers.1.self_attn.o_proj",))
    return path


def test_fp8_bitwise_against_numpy_reference(ragged_folder):
    config, tensors = read_folder(ragged_folder)
    fmt = source_format(config)
    assert fmt.name == "fp8_block" and fmt.block_size == (128, 128)
    assert fmt.ignore == ("model.layers.1.self_attn.o_proj",)
    assert tensors["model.layers.0.mlp.experts.2.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors["model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv"].shape) == (2, 2)
    out = dequantize_tensors(tensors, fmt, torch.float32)
    assert not any(k.endswith("_scale_inv") for k in out)
    assert set(out) == {k for k in tensors if not k.endswith("_scale_inv")}
    checked = 0
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            ref = reference_fp8(t, tensors[name + "_scale_inv"])
            np.testing.assert_array_equal(out[name].numpy(), ref, err_msg=name)
            checked += 1
        elif not name.endswith("_scale_inv"):
            assert torch.equal(out[name], t.to(torch.float32)), name
    assert checked == 2 * (4 + 3 * 3) - 1  # 4 attention + 3 experts x 3 per layer, one o_proj left in float
    # bf16 out: the float32 product cast once
    out16 = dequantize_tensors(tensors, fmt, torch.bfloat16)
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    ref = torch.from_numpy(reference_fp8(tensors[name], tensors[name + "_scale_inv"])).to(torch.bfloat16)
    assert out16[name].dtype == torch.bfloat16 and torch.equal(out16[name].view(torch.int16), ref.view(torch.int16))


def test_fp8_one_layer_through_companions(ragged_folder):
    """The streamer's use: collect one layer's names with their companions, dequantize that subset alone."""
    config, tensors = read_folder(ragged_folder)
    fmt = source_format(config)
    available = set(tensors)
    assert companions("model.layers.1.mlp.experts.0.up_proj.weight", fmt) == [
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    assert companions("model.layers.1.mlp.experts.0.up_proj.weight_scale_inv", fmt) == [
        "model.layers.1.mlp.experts.0.up_proj.weight"]
    assert companions("model.layers.1.mlp.gate.weight", fmt, available) == []  # the router is float
    assert companions("model.layers.1.self_attn.o_proj.weight", fmt) == []  # ignored module
    assert companions("model.layers.1.input_layernorm.weight", fmt, available) == []
    first = sorted(k for k in tensors if k.startswith("model.layers.1.") and not k.endswith("_scale_inv"))
    subset = {}
    for name in first:
        for n in [name, *companions(name, fmt, available)]:
            subset[n] = tensors[n]
    out = dequantize_tensors(subset, fmt, torch.float32)
    whole = dequantize_tensors(tensors, fmt, torch.float32)
    assert sorted(out) == first
    assert all(torch.equal(out[k], whole[k]) for k in out)


def test_fp8_equals_transformers_dequantizing_load(tmp_path):
    """transformers' FineGrainedFP8Config(dequantize=True) load, on CPU, is the oracle. Its load derives the block
    from the scale grid (rows // scale_rows), so dimensions here are 128 or under (one block, ragged below 128):
    192 rows would be read as two 96-row blocks by it."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    write_fp8_folder(tiny_qwen3_moe(128, 64, seed=1), str(tmp_path))
    config, tensors = read_folder(str(tmp_path))
    ours = dequantize_tensors(tensors, source_format(config), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    state = hf.state_dict()
    for layer in range(2):
        p = f"model.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(state[p + f"self_attn.{proj}.weight"], ours[p + f"self_attn.{proj}.weight"])
        for e in range(3):
            x = p + f"mlp.experts.{e}."
            gate_up = torch.cat([ours[x + "gate_proj.weight"], ours[x + "up_proj.weight"]])
            assert torch.equal(state[p + "mlp.experts.gate_up_proj"][e], gate_up)
            assert torch.equal(state[p + "mlp.experts.down_proj"][e], ours[x + "down_proj.weight"])
        assert torch.equal(state[p + "mlp.gate.weight"], ours[p + "mlp.gate.weight"])
    # the quantization did change the weights: the comparison is not float against float
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"],
                           tiny_qwen3_moe(128, 64, seed=1).model.layers[0].self_attn.q_proj.weight)


def fp8_subset():
    torch.manual_seed(3)
    w = (torch.randn(200, 130) * 0.02).to(torch.float8_e4m3fn)
    return {"m.layers.0.proj.weight": w, "m.layers.0.proj.weight_scale_inv": torch.rand(2, 2) + 0.5}


FP8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


def test_fp8_refusals():
    fmt = source_format(FP8)
    subset = fp8_subset()
    with pytest.raises(ValueError, match=r"m\.layers\.0\.proj\.weight: needs m\.layers\.0\.proj\.weight_scale_inv"):
        dequantize_tensors({"m.layers.0.proj.weight": subset["m.layers.0.proj.weight"]}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"weight_scale_inv: needs m\.layers\.0\.proj\.weight,"):
        dequantize_tensors({"m.layers.0.proj.weight_scale_inv": subset["m.layers.0.proj.weight_scale_inv"]},
                           fmt, torch.float32)
    bad = dict(subset, **{"m.layers.0.proj.weight_scale_inv": torch.ones(2, 1)})
    with pytest.raises(ValueError, match=r"proj\.weight_scale_inv: shape \(2, 1\) does not fit weight \(200, 130\) "
                                         r"with 128x128 blocks; expected \(2, 2\)"):
        dequantize_tensors(bad, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"float8_e4m3fn tensor with no scale.*no quantization_config"):
        dequantize_tensors(subset, None, torch.float32)
    ignored = source_format({"quantization_config": dict(FP8["quantization_config"],
                                                         modules_to_not_convert=["m.layers.0.proj"])})
    with pytest.raises(ValueError, match=r"module 'm\.layers\.0\.proj' is in config\.json's ignore list"):
        dequantize_tensors(subset, ignored, torch.float32)
    with pytest.raises(ValueError, match=r"uint8 block scales need quantization_config\.scale_fmt 'ue8m0'"):
        dequantize_tensors(dict(subset, **{"m.layers.0.proj.weight_scale_inv": torch.full((2, 2), 127,
                                                                                          dtype=torch.uint8)}),
                           fmt, torch.float32)


def test_fp8_ue8m0_byte_scales():
    """E8M0 bytes (scale_fmt ue8m0) read as 2**(b - 127), the same as the float scales they stand for."""
    fmt = source_format({"quantization_config": dict(FP8["quantization_config"], scale_fmt="ue8m0")})
    subset = fp8_subset()
    exps = torch.tensor([[120, 127], [130, 1]], dtype=torch.uint8)
    as_bytes = dequantize_tensors(dict(subset, **{"m.layers.0.proj.weight_scale_inv": exps}), fmt, torch.float32)
    floats = torch.from_numpy(np.exp2(exps.numpy().astype(np.float64) - 127).astype(np.float32))
    as_float = dequantize_tensors(dict(subset, **{"m.layers.0.proj.weight_scale_inv": floats}), fmt, torch.float32)
    ref = reference_fp8(subset["m.layers.0.proj.weight"], floats)
    np.testing.assert_array_equal(as_bytes["m.layers.0.proj.weight"].numpy(), ref)
    assert torch.equal(as_bytes["m.layers.0.proj.weight"], as_float["m.layers.0.proj.weight"])


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq"}, r"quant_method is 'awq'; supported: 'fp8', 'mxfp4', 'compressed-tensors'"),
    ({"quant_method": "fp8"}, r"weight_block_size is None; fp8 checkpoints are read only with block scales"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     r"activation_scheme is 'static'; supported: 'dynamic'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8}}}},
     r"config_groups\.g\.format is 'float-quantized'; supported: 'pack-quantized'"),
])
def test_unknown_or_unsupported_config_refused(qc, message):
    with pytest.raises(ValueError, match=r"^config\.json: quantization_config\." + message):
        source_format({"quantization_config": qc})


def test_float_checkpoint_casts_and_passes_integers():
    assert source_format({"hidden_size": 8}) is None
    tensors = {"a.weight": torch.randn(3, 4, dtype=torch.bfloat16), "ids": torch.arange(3)}
    out = dequantize_tensors(tensors, None, torch.float32)
    assert out["a.weight"].dtype == torch.float32 and torch.equal(out["a.weight"], tensors["a.weight"].float())
    assert out["ids"] is tensors["ids"]
