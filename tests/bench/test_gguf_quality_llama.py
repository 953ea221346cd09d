"""The llama.cpp side of the gguf_quality benchmark on a tiny float GGUF: imatrix entries reach
llama_model_quantize (its tensors equal ggml_quantize_chunk with the same importance), the kept tensor types, and
window evaluation from an empty context (the library's llama.cpp runner)."""

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from benchmarks.anchors import llama_cpp as oracle  # noqa: E402
from benchmarks.quality import llama_side  # noqa: E402
from jgptq_torch.cli import llama_logits  # noqa: E402

E, FF, HEADS, KV, V = 256, 512, 4, 2, 256
WEIGHTS = {"blk.0.attn_q.weight": (E, E), "blk.0.attn_k.weight": (E // HEADS * KV, E),
           "blk.0.attn_v.weight": (E // HEADS * KV, E), "blk.0.attn_output.weight": (E, E),
           "blk.0.ffn_gate.weight": (FF, E), "blk.0.ffn_up.weight": (FF, E), "blk.0.ffn_down.weight": (E, FF)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-layer llama-architecture F32 GGUF over 256 token ids (no vocabulary), and its weights."""
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(E)
    w.add_block_count(1)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(E // HEADS)
    w.add_vocab_size(V)
    w.add_tokenizer_model("none")
    tensors = {"token_embd.weight": (V, E), "output.weight": (V, E), **WEIGHTS}
    values = {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in tensors.items()}
    for n, v in values.items():
        w.add_tensor(n, v)
    for n in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(n, np.ones(E, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, values


def test_quantize_with_imatrix_matches_ggml_quantize_chunk(tiny, tmp_path):
    src, values = tiny
    rng = np.random.default_rng(1)
    imatrix = {n: rng.uniform(0.1, 3.0, s[1]).astype(np.float32) for n, s in WEIGHTS.items()}
    dst = str(tmp_path / "iq2_xxs.gguf")
    llama_side.quantize(src, dst, "iq2_xxs", imatrix, keep_type="F32", threads=1)
    types = llama_side.tensor_types(dst)
    assert {n: types[n] for n in WEIGHTS} == {n: "IQ2_XXS" for n in WEIGHTS}
    assert types["token_embd.weight"] == types["output.weight"] == "F32"
    got = llama_side.tensor_bytes(dst, WEIGHTS)
    qtype = int(gguf.GGMLQuantizationType.IQ2_XXS)
    for n in WEIGHTS:
        want = oracle.quantize(values[n], qtype, importance=imatrix[n])
        np.testing.assert_array_equal(got[n], want.reshape(-1), err_msg=n)
    bits = llama_side.weight_bits(dst, list(WEIGHTS))
    assert bits["bits_per_weight"] == pytest.approx(66 * 8 / 256)
    with pytest.raises(ValueError, match="no llama.cpp ftype"):
        llama_side.quantize(src, dst, "int4", imatrix)


def test_windows_are_evaluated_from_an_empty_context(tiny):
    src, _ = tiny
    rng = np.random.default_rng(2)
    windows = rng.integers(0, V, (3, 16))
    both = llama_logits.logits(src, windows, threads=1)
    assert both.shape == (3, 16, V) and np.isfinite(both).all()
    alone = llama_logits.logits(src, windows[2:], threads=1)
    np.testing.assert_allclose(alone[0], both[2], rtol=0, atol=1e-4)
    assert np.abs(both[0] - both[1]).max() > 1e-3      # different windows, different logits


def test_mix_rules_and_tensor_type_overrides(tiny, tmp_path):
    """A llama.cpp mix follows its own per-tensor rules (the same as jgptq.mixes gives these weights), a tensor-type
    override replaces the rule for the tensors it names, and MXFP4_MOE gives every 2-D weight Q8_0."""
    from jgptq import mixes

    src, _ = tiny
    dst = str(tmp_path / "q4_k_m.gguf")
    llama_side.quantize(src, dst, "q4_k_m", None, keep_type="F32", threads=1,
                        overrides={r"\.attn_k\.weight$": "F32", r"ffn_up": "Q8_0"})
    types = llama_side.tensor_types(dst)
    plan = {"attn_q": "q_proj", "attn_v": "v_proj", "attn_output": "o_proj", "ffn_gate": "gate_proj",
            "ffn_down": "down_proj"}
    for tensor, proj in plan.items():
        assert types[f"blk.0.{tensor}.weight"] == mixes.preset_format("q4_k_m", proj, 0, 1, 0, HEADS // KV).upper()
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_k.weight"] == "F32" and types["blk.0.ffn_up.weight"] == "Q8_0"
    assert types["token_embd.weight"] == types["output.weight"] == "F32"
    dst = str(tmp_path / "mxfp4_moe.gguf")
    llama_side.quantize(src, dst, "mxfp4_moe", None, keep_type="F32", threads=1)
    types = llama_side.tensor_types(dst)
    assert {types[n] for n in WEIGHTS} == {"Q8_0"}
    assert types["token_embd.weight"] == types["output.weight"] == "F32"
