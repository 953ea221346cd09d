"""The families added after llama/mixtral/qwen/olmoe, run by llama.cpp (llama-cpp-python) from jgptq's GGUF:
logits against the torch model holding the same weights.

- float32 export: the same function in float32; asserted max |diff| < 1e-4 of the logit std.
- q8_0 records (every weight but routers, norms, embedding and head encoded and written back dequantized):
  llama.cpp also rounds the activations of each quantized matmul to q8_0 blocks, so the logits move by a few % of
  their norm; asserted relative error ||got - want|| / ||want|| < 5% and the same top-1 token at >= 90% of the
  positions.
- gpt-oss: a GPTQ run of jgptq onto llama.cpp's MXFP4_MOE mix (experts MXFP4, the rest q8_0), exported: the
  experts' tensors decode (the gguf package's dequantizer) to the torch model's weights, and the logits agree as
  above; a config with YaRN's truncate=False runs in llama.cpp as the same weights with truncate=True in torch.
"""

import functools

import numpy as np
import pytest

from jgptq_torch.export.gguf.export import export_gguf
from tests.export.family_models import build
from tests.export.family_table import gguf_families
from tests.export.gguf_models import quantize_in_place

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llama_cpp

# the README table's GGUF families beyond those of test_gguf_llama_cpp.py
FAMILIES = [f for f in gguf_families() if f not in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")]
IDS = [int(x) for x in np.random.default_rng(0).integers(0, 256, 32)]


def llama_cpp_logits(path, ids=IDS) -> np.ndarray:
    """float64 (len(ids), vocab): llama.cpp's logits of every position (f32 KV cache)."""
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=2,
                          verbose=False, type_k=0, type_v=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], np.float64)
    finally:
        llm.close()


def torch_logits(model, ids=IDS) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


@functools.lru_cache(maxsize=None)
def _quantized(family):
    """The model with every weight llama.cpp quantizes (by the exporter's plan: not routers, norms, embedding or
    head) encoded in q8_0 and written back dequantized, and the records."""
    return _quantized_with(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_export_matches_torch(family, tmp_path):
    model = build(family)
    got = llama_cpp_logits(export_gguf(model, None, tmp_path / "f32.gguf", float_type="f32"))
    want = torch_logits(model)
    rel = np.abs(got - want).max() / want.std()
    print(f"{family} f32: max |diff| {rel:.3g} of the logit std")
    assert rel < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_export_matches_torch(family, tmp_path):
    model, result = _quantized(family)
    _assert_runs_like_torch(f"{family} q8_0", export_gguf(model, result, tmp_path / "q8_0.gguf", float_type="f32"),
                            model)


def _assert_runs_like_torch(label: str, path, model) -> None:
    """The quantized GGUF at ``path`` run by llama.cpp gives the logits of the torch ``model`` that holds the same
    dequantized weights: relative error under 5%, top-1 agreement at least 90%."""
    got = llama_cpp_logits(path)
    want = torch_logits(model)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    top1 = np.mean(got.argmax(-1) == want.argmax(-1))
    print(f"{label}: relative error {rel:.3g}, top-1 agreement {top1:.3g}")
    assert rel < 0.05 and top1 >= 0.9


def test_gpt_oss_mxfp4_moe_run_matches_torch(tmp_path):
    import gguf
    import torch

    import jgptq

    model = build("gpt_oss")
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    result = jgptq.quantize_moe(model, calib, mix="mxfp4_moe", progress=False)
    kinds = {(r.kind, r.format, r.method) for r in result.report.records}
    assert {("expert_gate_up", "mxfp4", "gptq"), ("expert_down", "mxfp4", "gptq"), ("linear", "q8_0", "gptq")} >= kinds
    path = export_gguf(model, result, tmp_path / "mxfp4_moe.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for layer in model.model.layers:
        experts = layer.mlp.experts
        i = layer.self_attn.layer_idx
        gate_up = experts.gate_up_proj.detach().numpy().transpose(0, 2, 1)   # (E, 2I, H), gate and up interleaved
        want = {"gate": gate_up[:, 0::2], "up": gate_up[:, 1::2],
                "down": experts.down_proj.detach().numpy().transpose(0, 2, 1)}
        for part, w in want.items():
            t = tensors[f"blk.{i}.ffn_{part}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
            np.testing.assert_array_equal(got, w)
    _assert_runs_like_torch("gpt_oss mxfp4_moe (GPTQ)", path, model)


def test_gpt_oss_untruncated_yarn_runs_as_truncated(tmp_path):
    """llama.cpp rounds YaRN's correction range to whole dimensions: the file of a truncate=False model computes
    what torch computes from the same weights with truncate=True (and measurably not the untruncated function)."""
    rope = build("gpt_oss").config.rope_parameters
    assert rope["truncate"] is True
    model = build("gpt_oss", rope_parameters={**rope, "truncate": False})   # the same seed: the same weights
    with pytest.warns(UserWarning, match="truncate=False"):
        got = llama_cpp_logits(export_gguf(model, None, tmp_path / "f32.gguf", float_type="f32"))
    untruncated, truncated = torch_logits(model), torch_logits(build("gpt_oss"))
    off = np.abs(got - untruncated).max() / untruncated.std()
    on = np.abs(got - truncated).max() / truncated.std()
    print(f"gpt_oss truncate=False: max |diff| {off:.3g} of the logit std against torch's own, {on:.3g} against "
          f"truncate=True")
    assert on < 1e-5 and off > 10 * on


def test_lfm2_moe_untied_head_matches_torch(tmp_path):
    """An LFM2-MoE head of its own (the released models tie it) is written as ``output.weight``, which llama.cpp
    loads in place of the embedding."""
    model = build("lfm2_moe", tie_word_embeddings=False)
    got = llama_cpp_logits(export_gguf(model, None, tmp_path / "f32.gguf", float_type="f32"))
    want = torch_logits(model)
    assert np.abs(got - want).max() / want.std() < 1e-4


def test_qwen3_next_drawn_norms_match_torch(tmp_path):
    """Qwen3-Next's norms scale by 1 + weight (weight 0 at initialisation), its linear attention's gated norm by the
    weight: all drawn, the file's 1 + weight and the gated norm's own weight run as torch."""
    import torch

    model = build("qwen3_next")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0 if ".linear_attn." in name else 0.0, 0.2)
    got = llama_cpp_logits(export_gguf(model, None, tmp_path / "f32.gguf", float_type="f32"))
    want = torch_logits(model)
    assert np.abs(got - want).max() / want.std() < 1e-4


@pytest.mark.parametrize("width", [32, 16])
def test_qwen3_5_moe_value_heads_reordered(width, tmp_path):
    """Qwen3.5-MoE's value heads (4, two per key head) tiled for llama.cpp: q8_0 records of value heads as wide as
    the block (32) keep their blocks, ``out_proj``'s by whole column blocks (its dequantized file tensor is the
    torch weight with columns in llama.cpp's order); of narrower heads (16), ``out_proj`` is written from the
    dequantized values in float32, with a warning. Both run as the torch model holding the same weights."""
    import gguf

    from jgptq_torch.export.gguf.families.qwen35 import value_order

    model, result = _quantized_with("qwen3_5_moe_text", linear_key_head_dim=width, linear_value_head_dim=width)
    if width == 32:
        path = export_gguf(model, result, tmp_path / "q8_0.gguf", float_type="f32")
    else:
        with pytest.warns(UserWarning, match="do not hold whole q8_0 blocks"):
            path = export_gguf(model, result, tmp_path / "q8_0.gguf", float_type="f32")
    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.ssm_out.weight"]
    want = model.model.layers[0].linear_attn.out_proj.weight.detach().numpy()[:, value_order(model.config, width)]
    if width == 32:
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
    else:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        got = np.asarray(t.data)
    np.testing.assert_array_equal(got, want)
    _assert_runs_like_torch(f"qwen3_5_moe_text q8_0, value heads of {width}", path, model)


def _quantized_with(family, **overrides):
    from jgptq_torch.export.gguf.arch import arch_of, targets

    model = build(family, **overrides)
    plan = targets(model, arch_of(model))
    keep = {p for p, ts in plan.items() if ts and all(t.role == "weight" for t in ts)}
    return model, quantize_in_place(model, "q8_0", only=keep)
