"""compressed-tensors weights one value a byte (float-quantized FP8 per channel, per tensor or in 128x128 blocks;
int-quantized int8), read back from tiny folders written in those formats, against a float64 numpy decoding and
against transformers' compressed-tensors load with dequantize=True."""

import numpy as np
import pytest
import torch

from jgptq_torch.source import companions, dequantize_tensors, source_format
from tests.source.quantized_folders import read_checkpoint, write_compressed_bytes_folder
from tests.source.test_dequant_fp8 import e4m3_decode, tiny_qwen3_moe

pytest.importorskip("compressed_tensors")


def reference_bytes(weight: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """q * scale, the scale of each element's region (channel, group or the whole tensor: the region's size read
    off the scale's shape; or a ``block`` with ragged edges), exact in float64, rounded once to the scale's
    dtype."""
    if weight.dtype == torch.float8_e4m3fn:
        q = e4m3_decode(weight.view(torch.uint8).numpy())
    else:
        q = weight.numpy().astype(np.float64)
    s = scale.to(torch.float64).numpy().reshape(-1, scale.shape[-1]) if scale.ndim else np.ones((1, 1)) * scale
    rows, cols = q.shape
    br, bc = block or (rows // s.shape[0], cols // s.shape[1])
    full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:rows, :cols]
    return torch.from_numpy(q * full).to(scale.dtype)


def check(tensors, out, block=None):
    checked = 0
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            weight = name[: -len("_scale")]
            assert torch.equal(out[weight], reference_bytes(tensors[weight], t, block).to(out[weight].dtype)), weight
            checked += 1
    return checked


@pytest.mark.parametrize("type_, strategy, dims", [
    ("float", "block", (192, 160)),     # -FP8-block, ragged edge blocks
    ("float", "channel", (128, 64)),    # -FP8-dynamic
    ("float", "tensor", (128, 64)),
    ("int", "channel", (128, 64)),      # W8A8
    ("int", "group", (128, 64)),
])
def test_byte_formats_bitwise_against_numpy(tmp_path, type_, strategy, dims):
    write_compressed_bytes_folder(tiny_qwen3_moe(*dims, seed=7).to(torch.bfloat16), str(tmp_path), type=type_,
                                  strategy=strategy, group_size=32, ignore=("lm_head", "re:.*v_proj"))
    config, tensors = read_checkpoint(str(tmp_path))
    fmt = source_format(config)
    assert fmt.name == "compressed_tensors" and fmt.schemes[0].strategy == strategy
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == (
        torch.float8_e4m3fn if type_ == "float" else torch.int8)
    assert tensors["model.layers.0.self_attn.v_proj.weight"].dtype == torch.bfloat16
    for dtype in (torch.bfloat16, torch.float32):
        out = dequantize_tensors(tensors, fmt, dtype)
        assert not any(k.endswith("_scale") for k in out)
        assert check(tensors, out, (128, 128) if strategy == "block" else None) == 2 * (3 + 3 * 3)
        assert out["model.layers.1.self_attn.v_proj.weight"].dtype == dtype


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_fp8_block_equals_transformers_dequantizing_load(tmp_path):
    """compressed-tensors' loader in transformers, dequantize=True, on ragged 128x128 blocks and a sharded folder.
    A dense Llama: transformers 5 cannot dequantize fused experts whose matrices span more than one block (its
    CompressedTensorsDequantize fails on the shapes), so the MoE case is checked against numpy above."""
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=64)
    torch.manual_seed(8)
    write_compressed_bytes_folder(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), str(tmp_path),
                                  strategy="block", shards=2)
    config, tensors = read_checkpoint(str(tmp_path))
    fmt = source_format(config)
    ours = dequantize_tensors(tensors, fmt, torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = hf.state_dict()
    assert len(ours) == len(state)
    for name in ours:
        assert torch.equal(state[name], ours[name]), name
    name = "model.layers.1.mlp.down_proj.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn and tuple(tensors[name + "_scale"].shape) == (2, 2)
    assert companions(name, fmt) == [name + "_scale"]
    assert companions(name + "_scale", fmt) == [name]


def test_byte_format_refusals():
    fmt = source_format({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"g": {"targets": ["Linear"], "input_activations": {"dynamic": True, "num_bits": 8},
                                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}})
    w = (torch.randn(8, 16)).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^a\.weight: needs a\.weight_scale, missing"):
        dequantize_tensors({"a.weight": w}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"a\.weight_scale: shape \(8, 2\) torch\.float32; expected floating "
                                         r"\(8, 1\) for the channel strategy and weight \(8, 16\)"):
        dequantize_tensors({"a.weight": w, "a.weight_scale": torch.ones(8, 2)}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"a\.weight: float-quantized float weights must be torch\.float8_e4m3fn, "
                                         r"got torch\.int8"):
        dequantize_tensors({"a.weight": w.view(torch.int8), "a.weight_scale": torch.ones(8, 1)}, fmt,
                           torch.float32)
    plain = torch.randn(4, 4)
    assert torch.equal(dequantize_tensors({"n.weight": plain}, fmt, torch.float32)["n.weight"], plain)
