"""token_embd and output in a GGUF export: the types llama.cpp's quantizer gives them for the run's file type
(the branches of ``llama_tensor_get_type_impl`` that name them, read from llama.cpp's ``src/llama-quant.cpp``),
encoded as llama.cpp encodes them (bytes checked against ``ggml_quantize_chunk`` where the library is present)."""

import types

import gguf
import numpy as np
import pytest

from benchmarks.anchors import llama_cpp
from jgptq_torch.export.gguf.export import export_gguf
from jgptq import mixes
from jgptq.config import PipelineConfig
from jgptq.ggml import get_format
from jgptq.plan import edge_formats
from tests.export.gguf_models import SIZES, quantize_in_place, read, tiny

# file type, its default type -> (token_embd, output) for rows of 256 values; from llama.cpp's rules
RULES = [
    ("q4_k_m", "q4_k", "q4_k", "q6_k"), ("q4_k_s", "q4_k", "q4_k", "q6_k"), ("q5_k_m", "q5_k", "q5_k", "q6_k"),
    ("q5_k_s", "q5_k", "q5_k", "q6_k"), ("q3_k_m", "q3_k", "q3_k", "q6_k"), ("q6_k", "q6_k", "q6_k", "q6_k"),
    ("q8_0", "q8_0", "q8_0", "q8_0"), ("q4_0", "q4_0", "q4_0", "q6_k"), ("q5_1", "q5_1", "q5_1", "q6_k"),
    ("q2_k", "q2_k", "q2_k", "q6_k"), ("iq4_xs", "iq4_xs", "iq4_xs", "q6_k"), ("iq4_nl", "iq4_nl", "iq4_nl", "q6_k"),
    ("iq3_s", "iq3_s", "iq3_s", "q6_k"), ("iq3_xxs", "iq3_xxs", "iq3_s", "q5_k"),
    ("iq2_xxs", "iq2_xxs", "q2_k", "q5_k"), ("iq2_xs", "iq2_xs", "q2_k", "q5_k"), ("iq2_m", "iq2_s", "iq3_s", "q5_k"),
    ("iq1_s", "iq1_s", "q2_k", "q5_k"), ("iq1_m", "iq1_m", "q2_k", "q5_k"),
]


@pytest.mark.parametrize("ftype, base, embd, head", RULES)
def test_types_are_llama_cpp_rules(ftype, base, embd, head):
    assert mixes.edge_format(ftype, base, "token_embd", 256) == embd
    assert mixes.edge_format(ftype, base, "output", 256) == head
    assert mixes.edge_format(ftype, base, "token_embd", 256, tied=True) == head   # a tied embedding is the head


def test_rows_that_are_not_whole_blocks_fall_back_as_in_llama_cpp():
    # 64 columns: output -> q8_0 (the default type's block does not divide them); token_embd -> the fallback
    assert mixes.edge_format("q4_k_m", "q4_k", "output", 64) == "q8_0"
    assert mixes.edge_format("q4_k_m", "q4_k", "token_embd", 64) == "q5_0"
    assert mixes.edge_format("q4_0", "q4_0", "output", 64) == "q8_0"        # q6_k, then its fallback
    assert mixes.edge_format("iq2_xxs", "iq2_xxs", "token_embd", 64) == "q4_0"   # q2_k, then its fallback
    assert mixes.edge_format("q8_0", "q8_0", "output", 48) is None           # F16 in llama.cpp


def test_plan_decides_from_the_mix_or_the_plain_format():
    assert edge_formats(PipelineConfig.build(None, format="q4_k", mix="q4_k_m"), 256, tied=False) == {
        "token_embd": "q4_k", "output": "q6_k"}
    assert edge_formats(PipelineConfig.build(None, format="q4_k"), 256, tied=False) == {
        "token_embd": "q4_k", "output": "q6_k"}                           # llama.cpp's Q4_K_S
    assert edge_formats(PipelineConfig.build(None, format="iq2_s"), 256, tied=True) == {"token_embd": "q5_k"}
    assert edge_formats(PipelineConfig.build(None, format="int", group_size=32), 256, tied=False) == {}
    # a run of per-tensor formats (target_bpw, assignment) is named by its dominant format, not its first candidate
    target = PipelineConfig.build(None, format="iq2_xxs", target_bpw=5.0, target_formats=("iq2_xxs", "q5_k"))
    assert edge_formats(target, 256, tied=False, dominant="q5_k") == edge_formats(
        PipelineConfig.build(None, format="q5_k"), 256, tied=False) == {"token_embd": "q5_k", "output": "q6_k"}
    assert edge_formats(target, 256, tied=False)["token_embd"] == "q2_k"        # without it: the first candidate
    assert edge_formats(PipelineConfig.build(None, format="q4_k", mix="q4_k_m"), 256, tied=False,
                        dominant="q8_0") == {"token_embd": "q4_k", "output": "q6_k"}   # a mix keeps its rules


def _run(family="qwen3_moe", **config):
    model = tiny(family)
    result = quantize_in_place(model, "q4_k")
    result.config = PipelineConfig.build(None, **{"format": "q4_k", "mix": "q4_k_m", **config})
    result.report = types.SimpleNamespace(records=[])
    return model, result


def test_export_writes_them_in_the_runs_types_and_reports_them(tmp_path):
    model, result = _run()
    _, t = read(export_gguf(model, result, tmp_path / "m.gguf"))
    state = model.state_dict()
    for name, param, fmt in (("token_embd", "model.embed_tokens.weight", "q4_k"),
                             ("output", "lm_head.weight", "q6_k")):
        tensor = t[f"{name}.weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType[fmt.upper()]
        w = state[param].numpy()
        decoded = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(w.shape)
        step = np.abs(w).max(-1, keepdims=True) / (7 if fmt == "q4_k" else 31)
        assert np.all(np.abs(decoded - w) <= step), name      # within a quantization step of the weights
        if llama_cpp.available():                              # llama.cpp's own encoder, no imatrix
            want = llama_cpp.quantize(w.astype(np.float32), get_format(fmt).type_id, None)
            assert np.array_equal(np.asarray(tensor.data).reshape(-1), np.asarray(want).reshape(-1)), name
    assert [(r.name, r.format, r.method, r.layer) for r in result.report.records] == [
        ("model.embed_tokens.weight", "q4_k", "rtn", -1), ("lm_head.weight", "q6_k", "rtn", -1)]
    assert result.report.records[1].reason == "llama.cpp's type of output for this run"
    export_gguf(model, result, tmp_path / "again.gguf")              # a second export reports them once
    assert len(result.report.records) == 2


def test_float_embeddings_keeps_them_float(tmp_path):
    model, result = _run()
    _, t = read(export_gguf(model, result, tmp_path / "m.gguf", float_embeddings=True))
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert t["output.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert result.report.records == []


@pytest.mark.llama_cpp
@pytest.mark.skipif(not llama_cpp.available(), reason="llama.cpp's libggml-base is not available")
def test_head_bytes_with_importance_equal_llama_cpp(tmp_path):
    model, result = _run(mix=None, format="iq4_xs")
    rng = np.random.default_rng(3)
    sums = rng.exponential(1.0, (1, 256)).astype(np.float32) * 40
    result.imatrix = {"lm_head.weight": (sums, np.array([40.0], np.float32))}
    _, t = read(export_gguf(model, result, tmp_path / "m.gguf"))
    w = model.state_dict()["lm_head.weight"].numpy().astype(np.float32)
    want = llama_cpp.quantize(w, get_format("q6_k").type_id, sums[0] / 40)
    assert np.array_equal(np.asarray(t["output.weight"].data).reshape(-1), np.asarray(want).reshape(-1))
    assert result.report.records[-1].reason == "llama.cpp's type of output for this run (with importance)"


@pytest.mark.llama_cpp
@pytest.mark.parametrize("family, ftype, config", [
    ("qwen3_moe", "Q4_K_M", dict(format="q4_k", mix="q4_k_m")),
    ("llama", "Q8_0", dict(format="q8_0", mix=None)),
    ("llama", "Q4_K_S", dict(format="q4_k", mix=None)),
    ("llama_tied", "Q5_K_M", dict(format="q5_k", mix="q5_k_m")),
    ("qwen3_moe", "IQ4_XS", dict(format="iq4_xs", mix=None))])
def test_llama_quantize_gives_the_same_embedding_and_head(family, ftype, config, tmp_path):
    """llama.cpp's own quantizer (its mix rules, no overrides) on the float export writes token_embd and output
    in the very types and bytes of jgptq's export of the same run."""
    import ctypes

    cpp = pytest.importorskip("llama_cpp")
    from tests.tiny_models import build

    tied = family == "llama_tied"
    make = (lambda: build("llama", **SIZES["llama"], tie_word_embeddings=True)) if tied else (lambda: tiny(family))
    f32 = export_gguf(make(), None, tmp_path / "f32.gguf", float_type="f32")
    params = cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = getattr(cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    theirs = tmp_path / "theirs.gguf"
    assert cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    model = make()
    result = quantize_in_place(model, config["format"])
    result.config = PipelineConfig.build(None, **config)
    result.report = types.SimpleNamespace(records=[])
    _, a = read(export_gguf(model, result, tmp_path / "ours.gguf", float_type="f32"))
    _, b = read(theirs)
    names = ["token_embd.weight"] + ([] if tied else ["output.weight"])
    assert ("output.weight" in b) is not tied
    for name in names:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name


def test_file_type_stays_the_runs(tmp_path):
    from tests.tiny_models import build

    # plain q4_k (llama.cpp's Q4_K_S) on a tied model whose embedding, q6_k as the head, outweighs the layers
    model = build("llama", **{**SIZES["llama"], "vocab_size": 8192}, tie_word_embeddings=True)
    result = quantize_in_place(model, "q4_k")
    result.config = PipelineConfig.build(None, format="q4_k")
    reader, t = read(export_gguf(model, result, tmp_path / "m.gguf"))
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q6_K
    assert int(reader.fields["general.file_type"].parts[-1][0]) == gguf.LlamaFileType.MOSTLY_Q4_K_S
