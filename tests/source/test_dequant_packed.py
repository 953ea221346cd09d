"""compressed-tensors pack-quantized int4 (symmetric, Kimi-K2-Thinking style) and asymmetric weights, read back
from tiny folders written in that format, against a float64 numpy unpacking of the format and against
transformers' compressed-tensors load."""

import numpy as np
import pytest
import torch

from jgptq_torch.source import companions, dequantize_tensors, source_format
from tests.source.quantized_folders import write_pack_quantized_folder
from tests.source.test_dequant_fp8 import read_folder, tiny_qwen3_moe

pytest.importorskip("compressed_tensors")


def unpack_rows(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 words (N, W) -> (N, count) unsigned values: element i of a row is the `bits` bits starting at bit
    i*bits of the row's bit stream (bit k of word w at position 32*w + k)."""
    stream = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8).reshape(words.shape[0], -1), axis=1,
                           bitorder="little").astype(np.int64)
    stream = stream[:, : count * bits].reshape(words.shape[0], count, bits)
    return (stream << np.arange(bits)).sum(-1)


def reference_packed(packed, scale, shape, bits, zero=None) -> torch.Tensor:
    """(q - zero) * scale per group (a channel: one group a row) from the format's definition (stored value =
    q + 2**(bits-1); zero points packed the same way along rows), exact in float64, rounded once to the scale's
    dtype."""
    rows, cols = shape.tolist()
    group = cols // scale.shape[1]
    q = unpack_rows(packed.numpy(), bits, cols) - 2 ** (bits - 1)
    s = np.repeat(scale.to(torch.float64).numpy(), group, axis=1)
    z = 0 if zero is None else np.repeat(unpack_rows(zero.numpy().T, bits, rows).T - 2 ** (bits - 1), group, axis=1)
    return torch.from_numpy((q - z) * s).to(scale.dtype)


def check_against_reference(tensors, out, bits, symmetric):
    checked = 0
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        base = name[: -len("_packed")]
        ref = reference_packed(tensors[name], tensors[base + "_scale"], tensors[base + "_shape"], bits,
                               None if symmetric else tensors[base + "_zero_point"])
        assert out[base].dtype == torch.float32
        assert torch.equal(out[base], ref.to(torch.float32)), base
        checked += 1
    return checked


@pytest.fixture(scope="module")
def int4_folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("int4"))
    model = tiny_qwen3_moe(128, 64, seed=2).to(torch.bfloat16)
    write_pack_quantized_folder(model, path, num_bits=4, group_size=32,
                                ignore=("lm_head", "re:.*self_attn\\.k_proj"))
    return path, model


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_int4_symmetric_bitwise_against_numpy_and_transformers(int4_folder):
    """transformers loads a symmetric pack-quantized MoE and decompresses it on the first forward: the oracle."""
    import transformers

    path, model = int4_folder
    config, tensors = read_folder(path)
    fmt = source_format(config)
    assert fmt.name == "pack_quantized" and fmt.schemes[0].num_bits == 4 and fmt.schemes[0].group_size == 32
    assert tensors["model.layers.0.mlp.experts.1.down_proj.weight_packed"].shape == (128, 8)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16  # ignored by regex
    out = dequantize_tensors(tensors, fmt, torch.float32)
    assert not any(k.endswith(("_packed", "_scale", "_shape")) for k in out)
    assert check_against_reference(tensors, out, 4, True) == 2 * (3 + 3 * 3)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        loaded(torch.tensor([[1, 2, 3]]))
    state = loaded.state_dict()
    out16 = dequantize_tensors(tensors, fmt, torch.bfloat16)
    for layer in range(2):
        p = f"model.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(state[p + f"self_attn.{proj}.weight"], out16[p + f"self_attn.{proj}.weight"]), proj
        for e in range(3):
            x = p + f"mlp.experts.{e}."
            gate_up = torch.cat([out16[x + "gate_proj.weight"], out16[x + "up_proj.weight"]])
            assert torch.equal(state[p + "mlp.experts.gate_up_proj"][e], gate_up)
            assert torch.equal(state[p + "mlp.experts.down_proj"][e], out16[x + "down_proj.weight"])
    err = (out["model.layers.1.self_attn.o_proj.weight"] - model.model.layers[1].self_attn.o_proj.weight.float())
    assert 0 < err.abs().max() < 0.2 * model.model.layers[1].self_attn.o_proj.weight.float().abs().max()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_int4_asymmetric_bitwise_against_numpy_and_transformers(tmp_path):
    """Asymmetric (packed zero points): transformers reads these only on a dense model and with
    CompressedTensorsConfig(dequantize=True), so the oracle model here is a tiny Llama."""
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(4)
    write_pack_quantized_folder(transformers.LlamaForCausalLM(cfg), str(tmp_path), num_bits=4, group_size=32,
                                symmetric=False)
    config, tensors = read_folder(str(tmp_path))
    fmt = source_format(config)
    assert fmt.schemes[0].symmetric is False
    zp = "model.layers.0.mlp.down_proj.weight_zero_point"
    assert tensors[zp].shape == (8, 3) and tensors[zp].dtype == torch.int32  # 64 rows / 8 a word, 96 / 32 groups
    assert companions("model.layers.0.mlp.down_proj.weight_packed", fmt) == [
        "model.layers.0.mlp.down_proj.weight_scale", "model.layers.0.mlp.down_proj.weight_shape", zp]
    out = dequantize_tensors(tensors, fmt, torch.float32)
    assert check_against_reference(tensors, out, 4, False) == 7
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = loaded.state_dict()
    for name in out:
        if name.startswith("model.layers."):
            assert torch.equal(state[name], out[name]), name


def test_packed_companions_and_refusals(int4_folder):
    config, tensors = read_folder(int4_folder[0])
    fmt = source_format(config)
    base = "model.layers.0.mlp.experts.0.up_proj.weight"
    assert companions(base + "_packed", fmt) == [base + "_scale", base + "_shape"]
    assert companions(base + "_scale", fmt) == [base + "_packed", base + "_shape"]
    assert companions("model.layers.0.self_attn.k_proj.weight", fmt) == []
    parts = {k: tensors[base + k] for k in ("_packed", "_scale", "_shape")}
    with pytest.raises(ValueError, match=r"up_proj\.weight_packed, .*weight_shape: needs .*up_proj\.weight_scale, "
                                         r"missing"):
        dequantize_tensors({base + k: v for k, v in parts.items() if k != "_scale"}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale: shape \(64, 2\) torch\.bfloat16; expected "
                                         r"floating \(64, 4\) for group strategy"):
        dequantize_tensors({base + "_packed": parts["_packed"], base + "_shape": parts["_shape"],
                            base + "_scale": parts["_scale"][:, :2]}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"up_proj\.weight_packed: shape \(64, 15\); weight_shape \(64, 128\) at 4 "
                                         r"bits packs to \(64, 16\)"):
        dequantize_tensors({base + "_packed": parts["_packed"][:, :15], base + "_shape": parts["_shape"],
                            base + "_scale": parts["_scale"]}, fmt, torch.float32)
    with pytest.raises(ValueError, match=r"weight_zero_point: not expected beside .*up_proj\.weight"):
        dequantize_tensors({base + "_packed": parts["_packed"], base + "_shape": parts["_shape"],
                            base + "_scale": parts["_scale"],
                            base + "_zero_point": torch.zeros(8, 4, dtype=torch.int32)}, fmt, torch.float32)


@pytest.mark.parametrize("change, message", [
    ({"quantization_status": "frozen"}, r"quantization_status is 'frozen'; supported: 'compressed'"),
    ({"input_activations": {"num_bits": 8}}, r"config_groups\.group_0\.input_activations is set; only weight-only"),
    ({"strategy": "block"}, r"config_groups\.group_0\.weights\.strategy is 'block'; supported: 'group', 'channel'"),
])
def test_packed_config_refusals(int4_folder, change, message):
    import copy

    config, _ = read_folder(int4_folder[0])
    config = copy.deepcopy(config)
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    key, value = next(iter(change.items()))
    if key == "quantization_status":
        qc[key] = value
    elif key == "input_activations":
        group[key] = value
    else:
        group["weights"][key] = value
    with pytest.raises(ValueError, match=r"^config\.json: quantization_config\." + message):
        source_format(config)
