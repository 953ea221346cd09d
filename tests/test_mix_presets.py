"""llama.cpp's mixes in jgptq.mixes: Q2_K_S and IQ2_M (and the K-quant mixes beside them) against a table written
out from llama.cpp's ``llama_tensor_get_type_impl`` (src/llama-quant.cpp), and, where llama-cpp-python is
installed, against the tensor types ``llama_model_quantize`` itself writes for the same Qwen3-MoE model."""

import pytest

from jgptq import mixes
from tests.export.gguf_models import flat_imatrix

NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _row(q, k, v, o, gate_up, down):
    return dict(zip(NAMES, (q, k, v, o, gate_up, down)))


# (preset, n_expert, n_gqa) -> {layer index of an 8-layer model: formats}, "rest" for every other layer.
# Read off the C++ by hand: the 8-expert rule sends attn_v/attn_k to q8_0 and attn_output to q5_k for the
# non-IQ2 mixes listed there (Q2_K_S is not listed for attn_output); the IQ2 branch comes first for IQ2_M.
TABLE = {
    ("q2_k_s", 8, 2): {0: _row("q2_k", "q8_0", "q8_0", "q2_k", "q2_k", "q4_k"),
                       "rest": _row("q2_k", "q8_0", "q8_0", "q2_k", "q2_k", "q2_k")},
    ("q2_k_s", 16, 4): {0: _row("q2_k", "q2_k", "q4_k", "q2_k", "q2_k", "q4_k"),
                        "rest": _row("q2_k", "q2_k", "q4_k", "q2_k", "q2_k", "q2_k")},
    ("q2_k_s", 16, 2): {"rest": _row("q2_k", "q2_k", "q2_k", "q2_k", "q2_k", "q2_k"),
                        0: _row("q2_k", "q2_k", "q2_k", "q2_k", "q2_k", "q4_k")},
    ("iq2_m", 8, 2): {0: _row("iq2_s", "q4_k", "q4_k", "q5_k", "iq2_s", "iq3_s"),
                      "rest": _row("iq2_s", "q4_k", "q4_k", "q5_k", "iq2_s", "iq2_s")},
    ("iq2_m", 16, 4): {0: _row("iq2_s", "iq2_s", "q4_k", "iq3_s", "iq2_s", "iq3_s"),
                       "rest": _row("iq2_s", "iq2_s", "q4_k", "iq3_s", "iq2_s", "iq2_s")},
    ("iq2_m", 2, 1): {0: _row("iq2_s", "iq2_s", "iq3_s", "iq3_s", "iq2_s", "iq3_s"),
                      "rest": _row("iq2_s", "iq2_s", "iq3_s", "iq3_s", "iq2_s", "iq2_s")},
    ("q3_k_m", 8, 2): {"rest": _row("q3_k", "q8_0", "q8_0", "q5_k", "q3_k", "q4_k")},
    ("q3_k_m", 16, 4): {0: _row("q3_k", "q3_k", "q5_k", "q4_k", "q3_k", "q4_k"),
                        1: _row("q3_k", "q3_k", "q5_k", "q4_k", "q3_k", "q4_k"),
                        "rest": _row("q3_k", "q3_k", "q4_k", "q4_k", "q3_k", "q4_k")},
    ("q4_k_m", 8, 2): {i: _row("q4_k", "q8_0", "q8_0", "q5_k", "q4_k", "q6_k") for i in (0, 3, 6, 7)}
    | {"rest": _row("q4_k", "q8_0", "q8_0", "q5_k", "q4_k", "q4_k")},
}


@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: f"{k[0]}-E{k[1]}-gqa{k[2]}")
def test_preset_formats_match_the_table(key):
    preset, n_expert, n_gqa = key
    for layer in range(8):
        want = TABLE[key].get(layer, TABLE[key]["rest"])
        got = {n: mixes.preset_format(preset, n, layer, 8, n_expert, n_gqa) for n in NAMES}
        assert got == want, f"layer {layer}"


def test_new_presets_and_their_formats_are_known():
    assert mixes.PRESETS["q2_k_s"] == "q2_k" and mixes.PRESETS["iq2_m"] == "iq2_s"
    from jgptq import PipelineConfig

    cfg = PipelineConfig.build(None, mix="iq2_m")
    assert cfg.quant.format == "iq2_s"
    assert {"iq2_s", "iq3_s", "q4_k", "q5_k"} <= mixes.possible_formats(cfg)
    assert {"q2_k", "q4_k", "q8_0"} <= mixes.possible_formats(PipelineConfig.build(None, mix="q2_k_s"))


def _tiny_qwen3_moe(n_expert, heads, kv_heads):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=256, num_hidden_layers=8, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=256 // heads, num_experts=n_expert,
                         num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
                         max_position_embeddings=64, tie_word_embeddings=False, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(cfg).float().eval()


@pytest.mark.llama_cpp
@pytest.mark.parametrize("preset", ["q2_k_s", "iq2_m", "q3_k_m", "q4_k_m"])
@pytest.mark.parametrize("shape", [(8, 4, 2), (16, 8, 2)], ids=["E8-gqa2", "E16-gqa4"])
def test_preset_formats_match_llama_model_quantize(preset, shape, tmp_path):
    pytest.importorskip("llama_cpp")
    from benchmarks.quality import llama_side
    from jgptq import PipelineConfig
    from jgptq_torch.export.gguf.arch import gguf_names
    from jgptq_torch.export.gguf.export import export_gguf
    from jgptq_torch import models
    from jgptq_torch.pipeline import run_setup

    model = _tiny_qwen3_moe(*shape)
    src = str(tmp_path / "f32.gguf")
    export_gguf(model, None, src, overwrite=True, float_type="f32")
    imatrix = flat_imatrix(src)
    dst = str(tmp_path / f"{preset}.gguf")
    llama_side.quantize(src, dst, preset, imatrix, keep_type="F32", threads=1)
    written = llama_side.tensor_types(dst)
    prefix, layers = models.find_decoder_layers(model)
    _, plan = run_setup.plan_layers(prefix, layers, PipelineConfig.build(None, mix=preset))
    names = gguf_names(model)
    compared = 0
    for param, matrix in plan.matrices.items():
        for gguf_name, _rows in names[param]:
            assert written[gguf_name] == matrix.format.upper(), gguf_name
            compared += 1
    assert compared == 8 * 7  # q, k, v, o, gate, up, down of 8 layers
