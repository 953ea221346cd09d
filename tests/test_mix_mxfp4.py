"""llama.cpp's MXFP4_MOE mix in jgptq.mixes: routed experts MXFP4, every other weight (and both edges) Q8_0, read
off ``llama_tensor_get_type_impl`` (src/llama-quant.cpp) and, where llama-cpp-python is installed, checked against
the tensor types ``llama_model_quantize`` itself writes for a Qwen3-MoE model."""

import pytest

from jgptq import PipelineConfig, mixes, plan
from tests.export.gguf_models import flat_imatrix
from tests.test_mix_presets import NAMES, _tiny_qwen3_moe


@pytest.mark.parametrize("n_expert,n_gqa", [(8, 2), (16, 4), (128, 8)])
def test_experts_mxfp4_everything_else_q8_0(n_expert, n_gqa):
    want = {n: ("mxfp4" if "experts" in n else "q8_0") for n in NAMES}
    for layer in range(8):  # no layer pattern and no 8-expert rule
        got = {n: mixes.preset_format("mxfp4_moe", n, layer, 8, n_expert, n_gqa) for n in NAMES}
        assert got == want, f"layer {layer}"
    more = {"mlp.experts.3.down_proj": "mxfp4", "block_sparse_moe.experts.0.w2": "mxfp4", "experts.gate_up_proj":
            "mxfp4", "mlp.shared_experts.down_proj": "q8_0", "mlp.shared_expert.gate_proj": "q8_0",
            "mlp.down_proj": "q8_0", "self_attn.kv_b_proj": "q8_0", "self_attn.qkv_proj": "q8_0"}
    for name, fmt in more.items():
        assert mixes.preset_format("mxfp4_moe", name, 0, 8, n_expert, n_gqa) == fmt, name


def test_edges_are_q8_0_or_float_where_rows_do_not_fit():
    """The MXFP4_MOE branch precedes the embedding's and the head's own rules; Q8_0's 32-blocks fall back to F16."""
    cfg = PipelineConfig.build(None, mix="mxfp4_moe")
    assert cfg.quant.format == "mxfp4"
    assert plan.edge_formats(cfg, 2880, tied=False) == {"token_embd": "q8_0", "output": "q8_0"}
    assert plan.edge_formats(cfg, 2880, tied=True) == {"token_embd": "q8_0"}
    assert plan.edge_formats(cfg, 2888, tied=False) == {"token_embd": None, "output": None}
    plain = PipelineConfig.build(None, format="mxfp4")  # llama.cpp's one file type whose default type is MXFP4
    assert mixes.file_type(None, "mxfp4") == "mxfp4_moe"
    assert plan.edge_formats(plain, 2880, tied=False) == {"token_embd": "q8_0", "output": "q8_0"}


def test_config_and_possible_formats():
    assert mixes.PRESETS["mxfp4_moe"] == "mxfp4"
    assert mixes.possible_formats(PipelineConfig.build(None, mix="mxfp4_moe")) == {"mxfp4", "q8_0"}
    with pytest.raises(ValueError, match="its base format is mxfp4"):
        PipelineConfig.build(None, mix="mxfp4_moe", format="q4_k")


@pytest.mark.llama_cpp
@pytest.mark.parametrize("shape", [(8, 4, 2), (16, 8, 2)], ids=["E8-gqa2", "E16-gqa4"])
def test_mix_matches_llama_model_quantize(shape, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")

    from benchmarks.quality import llama_side
    from jgptq_torch.export.gguf.arch import gguf_names
    from jgptq_torch.export.gguf.export import export_gguf
    from jgptq_torch import models
    from jgptq_torch.pipeline import run_setup

    monkeypatch.setitem(llama_side.MIX_FTYPES, "mxfp4_moe", "LLAMA_FTYPE_MOSTLY_MXFP4_MOE")
    model = _tiny_qwen3_moe(*shape)
    src = str(tmp_path / "f32.gguf")
    export_gguf(model, None, src, overwrite=True, float_type="f32")
    imatrix = flat_imatrix(src)
    dst = str(tmp_path / "mxfp4_moe.gguf")
    llama_side.quantize(src, dst, "mxfp4_moe", imatrix, keep_type="F32", threads=1)
    written = llama_side.tensor_types(dst)
    prefix, layers = models.find_decoder_layers(model)
    _, planned = run_setup.plan_layers(prefix, layers, PipelineConfig.build(None, mix="mxfp4_moe"))
    names = gguf_names(model)
    seen = {}
    for param, matrix in planned.matrices.items():
        for gguf_name, _rows in names[param]:
            assert written[gguf_name] == matrix.format.upper(), gguf_name
            seen[gguf_name] = written[gguf_name]
    assert len(seen) == 8 * 7 and set(seen.values()) == {"MXFP4", "Q8_0"}
