"""GPTQ v1 checkpoints: decoded by an unpacker written from the format description, configs that transformers
parses, and refusals of what the format cannot hold."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jgptq.export import QuantizedWeight, export_gptq_v1, expert_entries
from tests.export.conftest import COLS, GRIDS, ROWS, config, solved, solved_experts

MODEL_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32, "dtype": "float16"}


def read_checkpoint(out):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(str(out / shard))
        assert all(index["weight_map"][k] == shard for k in part)
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return tensors


def stream_values(words, bits, count):
    """Values 0..count-1 of a little-endian bit stream made of int32 words (word k = stream bits 32k..32k+31)."""
    stream = 0
    for k, word in enumerate(words):
        stream |= (int(word) & 0xFFFFFFFF) << (32 * k)
    assert stream >> (32 * len(words)) == 0
    return [(stream >> (bits * i)) & ((1 << bits) - 1) for i in range(count)]


def decode_gptq(t, name, bits, out_features, in_features):
    """W[o, i] = scales[g_idx[i], o] * (q[i, o] - (qzeros[g_idx[i], o] + 1)), from the stored tensors alone."""
    qweight, qzeros, scales, g_idx = (t[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx"))
    assert qweight.dtype == np.int32 and qzeros.dtype == np.int32 and g_idx.dtype == np.int32
    assert scales.dtype == np.float16
    assert qweight.shape == (-(-in_features * bits // 32), out_features)
    assert qzeros.shape == (scales.shape[0], -(-out_features * bits // 32))
    q = np.array([stream_values(qweight[:, o], bits, in_features) for o in range(out_features)]).T
    z = np.array([stream_values(qzeros[g], bits, out_features) for g in range(qzeros.shape[0])]) + 1
    s = scales.astype(np.float32)
    cols = np.arange(in_features)
    return (s[g_idx[cols]] * (q[cols] - z[g_idx[cols]]).astype(np.float32)).T


@pytest.mark.parametrize("bits, sym, group_size", [g for g in GRIDS])
def test_round_trip(tmp_path, bits, sym, group_size):
    cfg = config(bits=bits, sym=sym, group_size=group_size)
    result, rec = solved(cfg)
    assert sym or rec.zeros.min() > 0  # precondition of a storable asymmetric grid
    qc = export_gptq_v1(tmp_path / "m", {"model.layers.0.mlp.up_proj.weight": rec}, model_config=MODEL_CONFIG,
                        quant_config=cfg)
    t = read_checkpoint(tmp_path / "m")
    assert set(t) == {f"model.layers.0.mlp.up_proj.{k}" for k in ("qweight", "qzeros", "scales", "g_idx")}
    w = decode_gptq(t, "model.layers.0.mlp.up_proj", bits, ROWS, COLS)
    assert np.array_equal(w, np.asarray(result.weight))
    assert qc["bits"] == bits and qc["sym"] == sym and qc["group_size"] == group_size and not qc["desc_act"]
    if sym:
        stored = np.array(stream_values(t["model.layers.0.mlp.up_proj.qzeros"][0], bits, ROWS))
        assert (stored == (1 << (bits - 1)) - 1).all()


def test_desc_act_three_bit_and_config_parses(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import GPTQConfig

    cfg = config(bits=3, sym=False, act_order="desc")
    result, rec = solved(cfg)
    assert not rec.has_plain_g_idx()
    bias = np.linspace(-1, 1, ROWS).astype(np.float32)
    other = {"model.embed_tokens.weight": np.ones((32, 64), np.float32), "model.layers.0.mlp.up_proj.bias": bias}
    qc = export_gptq_v1(tmp_path / "m", {"model.layers.0.mlp.up_proj": rec}, tensors=other,
                        model_config=MODEL_CONFIG, quant_config=cfg, extra_files={"tokenizer.json": "{}"})
    t = read_checkpoint(tmp_path / "m")
    assert np.array_equal(t["model.layers.0.mlp.up_proj.g_idx"], np.asarray(result.g_idx))
    assert np.array_equal(decode_gptq(t, "model.layers.0.mlp.up_proj", 3, ROWS, COLS), np.asarray(result.weight))
    assert t["model.layers.0.mlp.up_proj.bias"].dtype == np.float16
    assert np.array_equal(t["model.layers.0.mlp.up_proj.bias"], bias.astype(np.float16))
    assert t["model.embed_tokens.weight"].dtype == np.float32
    assert (tmp_path / "m" / "tokenizer.json").read_text() == "{}"

    assert qc["desc_act"] is True and qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
    assert qc["meta"]["quantizer"][0].startswith("jgptq:")
    on_disk = json.loads((tmp_path / "m" / "quantize_config.json").read_text())
    assert on_disk == qc
    auto = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert auto.model_type == "llama" and auto.hidden_size == 64
    parsed = GPTQConfig.from_dict(auto.quantization_config)
    assert (parsed.bits, parsed.group_size, parsed.desc_act, parsed.sym) == (3, 32, True, False)
    assert parsed.format == "gptq" and parsed.damp_percent == cfg.damp


def test_group_aware_order_needs_no_desc_act(tmp_path):
    cfg = config(act_order="group_aware")
    result, rec = solved(cfg)
    qc = export_gptq_v1(tmp_path / "m", {"m.up": rec}, model_config=MODEL_CONFIG, quant_config=cfg)
    assert qc["desc_act"] is False and qc["act_group_aware"] is True and qc["meta"]["act_order"] == "group_aware"
    t = read_checkpoint(tmp_path / "m")
    assert np.array_equal(decode_gptq(t, "m.up", 4, ROWS, COLS), np.asarray(result.weight))


def test_moe_experts_per_expert_names(tmp_path):
    cfg = config()
    result, stack = solved_experts(cfg)
    names = ["model.layers.0.mlp.experts.{expert}.gate_proj", "model.layers.0.mlp.experts.{expert}.up_proj"]
    export_gptq_v1(tmp_path / "m", expert_entries(stack, names), model_config=MODEL_CONFIG, quant_config=cfg,
                   max_shard_bytes=5000)
    t = read_checkpoint(tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert len(t) == 7 * 2 * 4
    for e in range(7):
        gate = decode_gptq(t, f"model.layers.0.mlp.experts.{e}.gate_proj", 4, 32, 64)
        up = decode_gptq(t, f"model.layers.0.mlp.experts.{e}.up_proj", 4, 32, 64)
        assert np.array_equal(np.concatenate([gate, up]), np.asarray(result.weight)[e])


def five_bit():
    """A valid 5-bit record (GPTQ loaders take 2, 3, 4, 8 bits): 4-bit asymmetric codes on a 5-bit grid."""
    rec = solved(config(sym=False))[1]
    return QuantizedWeight(rec.codes, rec.scales, rec.zeros, rec.g_idx, bits=5, group_size=rec.group_size, sym=False)


@pytest.mark.parametrize("make, rule", [
    (lambda: {"m.up": solved(config(sym=False), positive_row=True)[1]}, "zero point 0 cannot be stored"),
    (lambda: {"m.up": solved(config(scale_dtype="float32"))[1]}, "scale_dtype='float16'"),
    (lambda: {"m.up": five_bit()}, "accept bits"),
    (lambda: {"m.up": solved(config())[1], "m.down": solved(config(bits=8))[1]}, "one quantize_config"),
    (lambda: {"m.up": solved_experts(config())[1]}, "expert_entries"),
])
def test_refusals_write_nothing(tmp_path, make, rule):
    with pytest.raises(ValueError, match=rule):
        export_gptq_v1(tmp_path / "m", make(), model_config=MODEL_CONFIG)
    assert list(tmp_path.iterdir()) == []


def test_dense_weight_of_quantized_module_refused(tmp_path):
    rec = solved(config())[1]
    with pytest.raises(ValueError, match="dense weight"):
        export_gptq_v1(tmp_path / "m", {"a.b": rec}, tensors={"a.b.weight": np.zeros((2, 2))},
                       model_config=MODEL_CONFIG)
    with pytest.raises(ValueError, match="model_type"):
        export_gptq_v1(tmp_path / "m", {"a.b": rec}, model_config={})
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_then_overwritten(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    rec = solved(config())[1]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_gptq_v1(out, {"a.b": rec}, model_config=MODEL_CONFIG)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_gptq_v1(out, {"a.b": rec}, model_config=MODEL_CONFIG, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
