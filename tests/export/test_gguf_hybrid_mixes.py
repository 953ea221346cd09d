"""Every mix of jgptq on the linear-attention hybrids (Qwen3-Next ``qwen3next``, Qwen3.5-MoE ``qwen35moe``) gives the
tensor types llama.cpp's own ``llama_model_quantize`` gives the F32 file with the same mix, tensor by tensor.

llama.cpp's rules treat ``attn_qkv`` as an attn_v (the same rule, the same counter: with one attn_v or attn_qkv per
layer, the layer index), ``attn_gate``, ``ssm_ba``/``ssm_alpha``/``ssm_beta`` and ``ssm_out`` as plain weights, and
count a layer's ``ffn_down_shexp`` after its ``ffn_down_exps`` in the IQ2 mixes. One listed difference: Qwen3-Next's
``in_proj_qkvz`` is one matrix of the plan, solved in one format (its ``attn_qkv`` rows' rule) and written as both
``attn_qkv`` and ``attn_gate``; where llama.cpp raises ``attn_qkv`` above the base type, jgptq's ``attn_gate`` has
the raised type too.

The model: 8 layers (full attention at 3 and 7), widths of 256 so that every block fits, 4 query heads per key-value
head, 4 experts (and 8, for llama.cpp's 8-expert rule, with 2 query heads per key-value head)."""

import functools

import pytest

from jgptq import mixes
from tests.export.family_models import build
from tests.export.gguf_models import flat_imatrix

pytestmark = pytest.mark.llama_cpp

FAMILIES = ["qwen3_next", "qwen3_5_moe_text"]
WIDE = {"hidden_size": 256, "num_hidden_layers": 8, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 256, "linear_value_head_dim": 256}
EXTRA = {"qwen3_next": {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2},
         "qwen3_5_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.25, "mrope_section": [4, 4, 0]}}}
SHAPES = {"E4-gqa4": {"num_experts": 4}, "E8-gqa2": {"num_experts": 8, "num_key_value_heads": 2}}
LINEAR = {"qwen3_next": {"attn_qkv", "attn_gate", "ssm_ba", "ssm_out"},
          "qwen3_5_moe_text": {"attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"}}


@functools.cache
def _model(family, shape):
    return build(family, **{**WIDE, **EXTRA[family], **SHAPES[shape]})


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    """(model, F32 GGUF path, a flat importance per weight) of a family and shape, written once per module."""
    from jgptq_torch.export.gguf.export import export_gguf

    made = {}

    def get(family, shape):
        if (family, shape) not in made:
            model = _model(family, shape)
            src = str(tmp_path_factory.mktemp(f"{family}-{shape}") / "f32.gguf")
            export_gguf(model, None, src, float_type="f32")
            imatrix = flat_imatrix(src)
            made[family, shape] = (model, src, imatrix)
        return made[family, shape]

    return get


def _plan(model, preset):
    from jgptq import PipelineConfig
    from jgptq_torch import models
    from jgptq_torch.pipeline import run_setup

    prefix, layers = models.find_decoder_layers(model)
    return run_setup.plan_layers(prefix, layers, PipelineConfig.build(None, mix=preset))[1]


def planned_types(model, preset) -> dict:
    """{GGUF tensor name: the type jgptq writes it in} for a run with ``preset``: a quantized parameter's format, for
    every GGUF tensor its records go to."""
    from jgptq_torch.export.gguf.arch import gguf_names

    names = gguf_names(model)
    return {name: matrix.format.upper() for param, matrix in _plan(model, preset).matrices.items()
            for name, _ in names[param]}


def expected_differences(family, theirs: dict) -> dict:
    """{tensor: the type jgptq writes} where it differs from llama.cpp's: Qwen3-Next's ``attn_gate`` has its
    layer's ``attn_qkv`` type (one matrix, one format) where llama.cpp gives the two different types."""
    if family != "qwen3_next":
        return {}
    out = {}
    for name, kind in theirs.items():
        if name.endswith(".attn_gate.weight"):
            qkv = theirs[name.replace(".attn_gate.", ".attn_qkv.")]
            if qkv != kind:
                out[name] = qkv
    return out


def _compare(family, shape, preset, float_file, tmp_path):
    pytest.importorskip("llama_cpp")
    from benchmarks.quality import llama_side

    model, src, imatrix = float_file(family, shape)
    dst = str(tmp_path / f"{preset}.gguf")
    llama_side.quantize(src, dst, preset, imatrix, keep_type="F32", threads=1, mix=True)
    theirs = llama_side.tensor_types(dst)
    ours = planned_types(model, preset)
    quantized = {n for n, t in theirs.items() if n.startswith("blk.") and t != "F32"}
    assert set(ours) == quantized          # the same tensors quantized
    differ = {n: t for n, t in ours.items() if theirs[n] != t}
    assert differ == expected_differences(family, {n: theirs[n] for n in ours})
    kinds = {n.split(".", 2)[2].removesuffix(".weight") for n in ours}
    assert LINEAR[family] | {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_down_exps", "ffn_down_shexp"} <= kinds
    return theirs, differ


@pytest.mark.parametrize("preset", sorted(mixes.PRESETS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_mix_gives_llama_model_quantize_types(family, preset, float_file, tmp_path):
    theirs, differ = _compare(family, "E4-gqa4", preset, float_file, tmp_path)
    # the rules at work: attn_qkv raised with attn_v's layer pattern (layer 0 is linear, layer 7 full attention)
    if preset == "q4_k_m":
        assert theirs["blk.0.attn_qkv.weight"] == theirs["blk.7.attn_v.weight"] == "Q6_K"
        assert theirs["blk.1.attn_qkv.weight"] == "Q4_K"
    if family == "qwen3_next" and preset in ("q4_k_m", "q3_k_m", "q2_k_s", "iq2_m"):
        assert differ                       # the listed difference is real under these mixes


@pytest.mark.parametrize("family", FAMILIES)
def test_eight_experts_rule(family, float_file, tmp_path):
    theirs, _ = _compare(family, "E8-gqa2", "q4_k_m", float_file, tmp_path)
    assert theirs["blk.1.attn_qkv.weight"] == theirs["blk.3.attn_v.weight"] == "Q8_0"


def test_jgptq_file_holds_the_planned_types(tmp_path):
    """jgptq's own GGUF of Qwen3-Next's linear attention under q4_k_m (records in the plan's formats, plainly
    encoded; the other weights left float) holds the types of :func:`planned_types`: ``attn_gate`` takes
    ``in_proj_qkvz``'s records."""
    from benchmarks.quality import llama_side
    from jgptq_torch.export.gguf.export import export_gguf
    from tests.export.gguf_models import quantize_in_place

    # a model of its own: the records' decoded values are written back into it
    model = build("qwen3_next", **{**WIDE, **EXTRA["qwen3_next"], **SHAPES["E4-gqa4"]})
    plan = _plan(model, "q4_k_m")
    weights, keys = {}, {}
    for fmt in {m.format for m in plan.matrices.values()}:
        only = {p for p, m in plan.matrices.items() if m.format == fmt and ".linear_attn." in p}
        part = quantize_in_place(model, fmt, only=only)
        weights.update(part.weights)
        keys.update(part.param_keys)
    result = type("Result", (), {"weights": weights, "param_keys": keys})()
    path = export_gguf(model, result, tmp_path / "q4_k_m.gguf", float_type="f32")
    written = llama_side.tensor_types(str(path))
    want = {n: t for n, t in planned_types(model, "q4_k_m").items()
            if n.split(".")[2] in LINEAR["qwen3_next"]}
    assert len(want) == 4 * 6 and {n: written[n] for n in want} == want
    assert written["blk.0.attn_gate.weight"] == written["blk.0.attn_qkv.weight"] == "Q6_K"
    assert written["blk.1.attn_gate.weight"] == written["blk.1.attn_qkv.weight"] == "Q4_K"
