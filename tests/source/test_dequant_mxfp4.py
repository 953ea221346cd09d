"""MXFP4 experts (gpt-oss), read back from a tiny GptOss folder written in that format, against a float64 numpy
decoding of the format and against transformers' Mxfp4Config(dequantize=True) load."""

import numpy as np
import pytest
import torch

from jgptq_torch.source import companions, dequantize_tensors, source_format
from tests.source.quantized_folders import E2M1, write_mxfp4_folder
from tests.source.test_dequant_fp8 import read_folder


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """(E, R, G, 16) nibbles, low nibble first, + (E, R, G) E8M0 -> (E, G*32, R) float32: sign (bit 3) times the
    e2m1 magnitude (bits 0..2) times 2**(s - 127), computed in float64."""
    b = blocks.numpy().astype(np.int64)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)
    values = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    values = values * np.exp2(scales.numpy().astype(np.float64) - 127)[..., None]
    e, r, g, _ = values.shape
    return values.reshape(e, r, g * 32).transpose(0, 2, 1).astype(np.float32)


def tiny_gpt_oss(seed=0):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=3,
                       num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    torch.manual_seed(seed)
    return GptOssForCausalLM(cfg)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mxfp4"))
    model = tiny_gpt_oss()
    write_mxfp4_folder(model, path)
    return path, model


def test_mxfp4_bitwise_against_numpy_and_transformers(mxfp4_folder):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path, model = mxfp4_folder
    config, tensors = read_folder(path)
    fmt = source_format(config)
    assert fmt.name == "mxfp4" and "lm_head" in fmt.ignore
    out = dequantize_tensors(tensors, fmt, torch.float32)
    assert not any(k.endswith(("_blocks", "_scales")) for k in out)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    state = hf.state_dict()
    float_state = model.state_dict()
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            ref = reference_mxfp4(tensors[name + "_blocks"], tensors[name + "_scales"])
            assert out[name].shape == float_state[name].shape  # (experts, in, out), as the float model holds it
            np.testing.assert_array_equal(out[name].numpy(), ref, err_msg=name)
            assert torch.equal(state[name], out[name]), name
            # 4-bit values: near the float weights, not equal to them
            err = (out[name] - float_state[name]).abs().max() / float_state[name].abs().max()
            assert 0 < err < 0.2, (name, err)
    for name in ("model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.mlp.router.weight", "lm_head.weight"):
        assert torch.equal(out[name], tensors[name]) and torch.equal(state[name], out[name]), name
    out16 = dequantize_tensors(tensors, fmt, torch.bfloat16)["model.layers.0.mlp.experts.down_proj"]
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, out["model.layers.0.mlp.experts.down_proj"].bfloat16())


def test_mxfp4_layout_low_nibble_first():
    """One block by hand: byte 0x2F holds element 0 = code 0xF (-6) and element 1 = code 0x2 (+1)."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # 2**1
    fmt = source_format({"quantization_config": {"quant_method": "mxfp4"}})
    out = dequantize_tensors({"e.down_proj_blocks": blocks, "e.down_proj_scales": scales}, fmt, torch.float32)
    w = out["e.down_proj"]
    assert w.shape == (1, 32, 1)
    assert w[0, :3, 0].tolist() == [-12.0, 2.0, 0.0]


def test_mxfp4_companions_and_refusals(mxfp4_folder):
    config, tensors = read_folder(mxfp4_folder[0])
    fmt = source_format(config)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert companions(name + "_blocks", fmt) == [name + "_scales"]
    assert companions(name + "_scales", fmt) == [name + "_blocks"]
    assert companions(name + "_bias", fmt) == []
    assert companions("model.layers.0.self_attn.q_proj.weight", fmt) == []
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks: needs model\.layers\.0\.mlp\.experts\.gate_up_proj_"
                                         r"scales, missing"):
        dequantize_tensors({name + "_blocks": tensors[name + "_blocks"]}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"gate_up_proj_scales: shape \(3, 192, 1\) does not fit .*expected "
                                         r"\(3, 192, 2\)"):
        dequantize_tensors({name + "_blocks": tensors[name + "_blocks"],
                            name + "_scales": tensors[name + "_scales"][..., :1]}, fmt, torch.float32)
