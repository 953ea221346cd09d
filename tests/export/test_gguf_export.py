"""jgptq_torch.export.gguf.export: GGUF files of tiny models read back with gguf.GGUFReader and decoded with gguf.quants."""

import functools
import types

import gguf
import numpy as np
import pytest
import torch

from jgptq_torch.export.gguf.arch import UnsupportedGGUFModel
from jgptq_torch.export.gguf.export import export_gguf, gguf_names
from jgptq.export.records import GGMLWeight, QuantizedWeight
from tests.export.gguf_models import field, per_expert, quantize_in_place, read, tiny
from tests.tiny_models import build

CASES = {"llama": "q8_0", "qwen3_moe": "q4_k", "mixtral": "q8_0", "olmoe": "q8_0", "qwen2_moe": "q8_0"}
PERMUTED = {"llama", "mixtral"}  # llama.cpp's llama architecture: normal RoPE


@functools.lru_cache(maxsize=None)
def quantized(family):
    model = tiny(family)
    return model, quantize_in_place(model, CASES[family])


def hf_permute(w, n_head):
    """llama.cpp's converter permutation of HF Q/K rows (numpy, on the leading row axis of any trailing shape)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def linear_view(model, name):
    return model.state_dict()[name].detach().float().numpy()  # every tiny family stores (E, out, in)


def heads_of(model, gname):
    if gname.endswith("attn_q.weight"):
        return model.config.num_attention_heads
    if gname.endswith("attn_k.weight"):
        return model.config.num_key_value_heads
    return None


@pytest.mark.parametrize("family", list(CASES))
def test_quantized_export_round_trip(family, tmp_path):
    model, result = quantized(family)
    path = export_gguf(model, result, tmp_path / "m.gguf")
    reader, t = read(path)
    names = gguf_names(model)
    expected = {g for entries in names.values() for g, _ in entries}
    assert set(t) == expected
    qtype = gguf.GGMLQuantizationType[CASES[family].upper()]
    for param, entries in names.items():
        rec = result.weights.get(param)
        w = linear_view(model, param)
        for gname, rows in entries:
            tensor = t[gname]
            want_w = w if rows is None else w[..., rows, :]
            heads = heads_of(model, gname) if family in PERMUTED else None
            if heads:
                want_w = hf_permute(want_w, heads)
            if gname.endswith("ffn_gate_inp_shexp.weight"):
                want_w = want_w.reshape(-1)  # llama.cpp loads the shared expert's (1, n) gate as {n}
            assert list(tensor.shape) == list(want_w.shape[::-1]), gname
            if rec is None:
                kind = gguf.GGMLQuantizationType.F32 if (w.ndim == 1 or "ffn_gate_inp" in gname) else \
                    gguf.GGMLQuantizationType.F16
                assert tensor.tensor_type == kind, gname
                assert np.array_equal(np.asarray(tensor.data).reshape(want_w.shape),
                                      want_w.astype(np.float32 if kind == gguf.GGMLQuantizationType.F32
                                                    else np.float16)), gname
                continue
            assert tensor.tensor_type == qtype, gname
            payload = rec.payload if rows is None else rec.payload[..., rows, :, :]
            if heads:
                payload = hf_permute(payload, heads)
            assert np.array_equal(np.asarray(tensor.data).reshape(-1), payload.reshape(-1)), gname
            decoded = gguf.quants.dequantize(np.asarray(tensor.data), qtype).reshape(want_w.shape)
            assert np.array_equal(decoded, want_w), gname  # exactly the weights the torch model holds
    arch = field(reader, "general.architecture")
    cfg = model.config
    assert field(reader, f"{arch}.block_count") == cfg.num_hidden_layers
    assert field(reader, f"{arch}.embedding_length") == cfg.hidden_size
    assert field(reader, f"{arch}.attention.head_count_kv") == cfg.num_key_value_heads
    assert field(reader, f"{arch}.vocab_size") == cfg.vocab_size
    assert field(reader, "tokenizer.ggml.model") == "none"
    assert field(reader, "general.quantization_version") == 2
    if family != "llama":
        assert field(reader, f"{arch}.expert_used_count") == cfg.num_experts_per_tok
    if family == "qwen3_moe":
        assert field(reader, "qwen3moe.expert_feed_forward_length") == cfg.moe_intermediate_size
        assert field(reader, "qwen3moe.attention.key_length") == cfg.head_dim
        assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_S


@pytest.mark.parametrize("fmt, mix, file_type", [
    ("q4_k", None, 14),      # llama.cpp's Q4_K_S: a plain q4_k run, not the Q4_K_M mix
    ("q4_k", "q4_k_m", 15),  # MOSTLY_Q4_K_M
    ("q8_0", None, 7),       # MOSTLY_Q8_0
    ("q6_k", "q6_k", 18),    # MOSTLY_Q6_K
])
def test_file_type_of_the_run(fmt, mix, file_type, tmp_path):
    model = tiny("qwen3_moe", seed=1)
    result = quantize_in_place(model, fmt)
    result.config = types.SimpleNamespace(mix=mix)
    reader, _ = read(export_gguf(model, result, tmp_path / "m.gguf"))
    assert field(reader, "general.file_type") == file_type


def test_general_name_from_the_source_folder(tmp_path):
    model = tiny("qwen3_moe", seed=1)
    model.config._name_or_path = str(tmp_path / "models" / "Tiny-MoE-7B") + "/"
    reader, _ = read(export_gguf(model, None, tmp_path / "a.gguf"))
    assert field(reader, "general.name") == "Tiny-MoE-7B"
    reader, _ = read(export_gguf(model, None, tmp_path / "b.gguf", name="given"))
    assert field(reader, "general.name") == "given"
    model.config._name_or_path = ""
    reader, _ = read(export_gguf(model, None, tmp_path / "c.gguf"))
    assert field(reader, "general.name") == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_per_expert_keys_give_the_same_file(family, tmp_path):
    model, result = quantized(family)
    split = per_expert(model, result)
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in split.weights
    else:
        assert "model.layers.1.mlp.experts.5.up_proj.weight" in split.weights
    a = export_gguf(model, result, tmp_path / "fused.gguf")
    b = export_gguf(model, split, tmp_path / "split.gguf")
    assert a.read_bytes() == b.read_bytes()
    # a missing expert is an error, not a hole
    key = next(k for k in split.weights if ".experts.2." in k)
    del split.weights[key]
    with pytest.raises(ValueError, match="missing from result.weights"):
        export_gguf(model, split, tmp_path / "bad.gguf")


@pytest.mark.parametrize("float_type", ["f32", "f16"])
def test_float_export(float_type, tmp_path):
    model = tiny("qwen3_moe", seed=3)
    reader, t = read(export_gguf(model, None, tmp_path / "f.gguf", float_type=float_type))
    assert field(reader, "general.file_type") == (0 if float_type == "f32" else 1)
    sd = model.state_dict()
    w = sd["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    inter = model.config.moe_intermediate_size
    dtype = np.float32 if float_type == "f32" else np.float16
    assert np.array_equal(np.asarray(t["blk.1.ffn_up_exps.weight"].data), w[:, inter:].astype(dtype))
    assert np.array_equal(np.asarray(t["blk.1.ffn_gate_exps.weight"].data), w[:, :inter].astype(dtype))
    assert np.array_equal(np.asarray(t["blk.0.ffn_gate_inp.weight"].data), sd["model.layers.0.mlp.gate.weight"].numpy())
    assert t["blk.0.attn_q_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_tied_embeddings(tmp_path):
    llama = build("llama", tie_word_embeddings=True)
    _, t = read(export_gguf(llama, None, tmp_path / "l.gguf"))
    assert "output.weight" not in t and "token_embd.weight" in t  # llama.cpp reuses token_embd
    # a quantized head of a tied model is written as output.weight (the model's head is those values)
    head = llama.state_dict()["lm_head.weight"].numpy()
    payload = gguf.quants.quantize(head, gguf.GGMLQuantizationType.Q8_0).reshape(head.shape[0], -1, 34)
    rec = GGMLWeight(payload, "q8_0")
    _, t = read(export_gguf(llama, types.SimpleNamespace(weights={"lm_head.weight": rec}, param_keys={}),
                            tmp_path / "h.gguf"))
    assert t["output.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert np.array_equal(np.asarray(t["output.weight"].data).reshape(-1), payload.reshape(-1))
    olmoe = build("olmoe", num_key_value_heads=4, tie_word_embeddings=True)
    _, t = read(export_gguf(olmoe, None, tmp_path / "o.gguf", float_type="f32"))
    assert np.array_equal(np.asarray(t["output.weight"].data), np.asarray(t["token_embd.weight"].data))


def _unexported():
    """A tiny model of a type no GGUF family writes (GPT-2)."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))


def test_errors(tmp_path):
    model, result = quantized("llama")
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(UnsupportedGGUFModel, match=r"supported model types: \['afmoe', 'deepseek_v3', 'dots1', "
                                                   r"'ernie4_5_moe', 'glm4_moe', 'gpt_oss', 'granitemoe', "
                                                   r"'granitemoeshared', 'hunyuan_v1_moe', 'lfm2_moe', 'llama', "
                                                   r"'llama4_text', "
                                                   r"'minimax_m2', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_5_moe_text', "
                                                   r"'qwen3_moe', 'qwen3_next'\]"):
        export_gguf(_unexported(), None, tmp_path / "x.gguf")
    with pytest.raises(UnsupportedGGUFModel, match="norm_topk_prob=False"):
        export_gguf(build("qwen3_moe", norm_topk_prob=False), None, tmp_path / "x.gguf")
    with pytest.raises(NotImplementedError, match="tokenizer"):
        export_gguf(model, None, tmp_path / "x.gguf", tokenizer=object())
    rec = result.weights[q]
    bad = types.SimpleNamespace(weights={**result.weights, q: rec.rows(0, 32)}, param_keys={})
    with pytest.raises(ValueError, match=r"q_proj.weight: record shape \(32, 256\) does not match"):
        export_gguf(model, bad, tmp_path / "x.gguf")
    # q8_0 blocks cannot hold the rows of 80 values of a tiny model of width 80
    narrow = build("llama", hidden_size=80, head_dim=None)
    bad = types.SimpleNamespace(weights={"model.layers.0.mlp.up_proj.weight":
                                         GGMLWeight(np.zeros((128, 3, 34), np.uint8), "q8_0")}, param_keys={})
    with pytest.raises(ValueError, match="not a multiple of the q8_0 block"):
        export_gguf(narrow, bad, tmp_path / "x.gguf")
    grid = QuantizedWeight(np.zeros((64, 32), np.uint8), np.ones((64, 1)), np.full((64, 1), 8, np.uint8),
                           np.zeros(32, np.int32), bits=4, group_size=-1, sym=True)
    with pytest.raises(ValueError, match="integer grid"):
        export_gguf(model, types.SimpleNamespace(weights={q: grid}, param_keys={}), tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="not model parameters"):
        export_gguf(model, types.SimpleNamespace(weights={"nope": rec}, param_keys={}), tmp_path / "x.gguf")
    norm = GGMLWeight(np.zeros((1, 8, 34), np.uint8), "q8_0")
    with pytest.raises(ValueError, match="does not match|floating point"):
        export_gguf(model, types.SimpleNamespace(weights={"model.norm.weight": norm}, param_keys={}),
                    tmp_path / "x.gguf")
    export_gguf(model, None, tmp_path / "x.gguf")
    with pytest.raises(FileExistsError):
        export_gguf(model, None, tmp_path / "x.gguf")
    assert not list(tmp_path.glob(".*tmp"))


def test_export_model_dispatch(tmp_path):
    from jgptq_torch.export.checkpoint import export_model

    model, result = quantized("mixtral")
    out = export_model(model, result, "gguf", tmp_path / "folder")
    assert out == tmp_path / "folder" / "model.gguf"
    direct = export_gguf(model, result, tmp_path / "direct.gguf")
    assert out.read_bytes() == direct.read_bytes()


def test_check_exportable():
    from jgptq_torch.cli.demo import byte_tokenizer
    from jgptq_torch.export.gguf.export import check_exportable

    check_exportable(build("qwen3_moe", vocab_size=256), byte_tokenizer())
    with pytest.raises(UnsupportedGGUFModel, match="supported model types"):
        check_exportable(_unexported())
    with pytest.raises(NotImplementedError, match="not a fast"):
        check_exportable(tiny("llama"), object())


def test_bfloat16_model_keeps_its_bits(tmp_path):
    model = build("qwen3_moe").to(torch.bfloat16)
    _, t = read(export_gguf(model, None, tmp_path / "b.gguf", float_type="bf16"))
    w = model.state_dict()["model.layers.0.mlp.experts.down_proj"]
    bits = w.view(torch.int16).numpy().view(np.uint16)
    tensor = t["blk.0.ffn_down_exps.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.BF16
    assert np.array_equal(np.asarray(tensor.data).view(np.uint16).reshape(bits.shape), bits)
    norm = model.state_dict()["model.norm.weight"].float().numpy()
    assert np.array_equal(np.asarray(t["output_norm.weight"].data), norm)  # norms stay f32 (exact)
