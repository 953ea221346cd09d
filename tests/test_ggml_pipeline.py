"""GGML formats through jgptq.quantize_moe: kept payloads that decode bit for bit to the model's weights, one
solve per bucket, per-weight formats and llama.cpp mixes, the plain-encode path, block-size checks, resume."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq_torch import models
from jgptq_torch.pipeline import resume
from jgptq_torch.pipeline import run_setup
from jgptq_torch.pipeline import solve
from jgptq import bucket, mixes, plan
from jgptq.methods import gptq as gptq_method
from jgptq.config import PipelineConfig
from jgptq.export import GGMLWeight
from jgptq.ggml import encode, get_format
from tests.tiny_models import build, token_ids

CALIB = token_ids(8, 32, seed=1)
OPTS = dict(batch_size=8, progress=False)
RULES = ((r"v_proj$", "q8_0"), (r"experts\.down_proj$", "q8_0"))
GPTQ = dict(format="q4_0", formats=RULES, min_tokens=60)   # some experts see fewer tokens: plain encodes
_RUNS: dict = {}


def checkpoint_tensors(model):
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {k: v.detach() for k, v in model.state_dict().items()})


def run(family, **kw):
    key = (family, tuple(sorted((k, str(v)) for k, v in kw.items())))
    if key not in _RUNS:
        ref = build(family)
        model = copy.deepcopy(ref)
        _RUNS[key] = (ref, model, jgptq.quantize_moe(model, CALIB, **OPTS, **kw))
    return _RUNS[key]


def assert_payloads_are_the_model(model, result):
    ckpt = checkpoint_tensors(model)
    assert result.weights
    for key, rec in result.weights.items():
        assert isinstance(rec, GGMLWeight)
        stored = ckpt[key].float().numpy()
        if rec.transposed:
            stored = np.swapaxes(stored, -1, -2)
        np.testing.assert_array_equal(rec.dequantize(), stored, err_msg=key)   # bit for bit


def test_gptq_payloads_decode_to_the_model_one_solve_per_bucket_and_rules(monkeypatch):
    _RUNS.pop(("qwen3_moe", tuple(sorted((k, str(v)) for k, v in GPTQ.items()))), None)  # counts this run's calls
    calls = []
    original = gptq_method.gptq_or_plain      # a GGML bucket's one solve (GPTQ and the plain encode, the lower kept)

    def counting(weights, hessians, importance, config, name, devices):
        calls.append((tuple(weights.shape), config.format, None if importance is None else tuple(importance.shape)))
        return original(weights, hessians, importance, config, name, devices)

    monkeypatch.setattr(gptq_method, "gptq_or_plain", counting)
    ref, model, result = run("qwen3_moe", **GPTQ)
    assert_payloads_are_the_model(model, result)
    cfg = model.config
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for key, rec in result.weights.items():
        want = "q8_0" if key.endswith(("v_proj.weight", "down_proj.weight")) else "q4_0"
        assert rec.format == want, key
    # experts under the token threshold: exactly the plain encode of the float weight, reported with the reason
    low = [r for r in result.report.records if r.method == "rtn" and not r.reason.startswith(bucket.PLAIN_KEPT)]
    assert low and all(r.reason.endswith("< 60") and r.tokens < 60 for r in low)
    assert {r.method for r in result.report.records if r.tokens >= 60 and not r.reason} == {"gptq"}
    assert all(r.reason.startswith(bucket.PLAIN_KEPT) for r in result.report.records if r.tokens >= 60 and r.reason)
    assert any("fewer than 60 calibration tokens" in w and "plain q4_0 encode" in w for w in result.report.warnings)
    params = dict(ref.named_parameters())
    for r in low:
        pname, e_idx = r.name[:-1].split("[")
        e_idx = int(e_idx)
        fmt = r.format
        w = params[pname].detach().numpy()[e_idx]
        want = np.asarray(encode(w, fmt, result.imatrix[pname].values()[e_idx]))
        got = np.concatenate([result.weights[k].row_bytes() for k in result.param_keys[pname]
                              if f"experts.{e_idx}." in k])
        np.testing.assert_array_equal(got, want, err_msg=r.name)
    # per layer: the 8 experts' gate/up in one call, their down in one call; linear buckets by shape and format
    per_layer = sorted(calls[: len(calls) // 2])
    assert sorted(calls[len(calls) // 2:]) == per_layer
    assert ((e, 2 * i, h), "q4_0", (e, h)) in per_layer and ((e, h, i), "q8_0", (e, i)) in per_layer
    assert len(per_layer) == len({(s, f) for s, f, _ in per_layer})
    formats = {r.name.split(".", 3)[-1].split("[")[0]: r.format for r in result.report.records}
    assert formats["self_attn.v_proj"] == "q8_0" and formats["self_attn.q_proj"] == "q4_0"
    assert formats["mlp.experts.down_proj"] == "q8_0" and formats["mlp.experts.gate_up_proj"] == "q4_0"
    assert "formats (matrices): q4_0 22, q8_0 18" in result.report.summary()   # per layer: 3 + 8, 1 + 8


def test_mixtral_payloads_decode_to_the_model():
    _, model, result = run("mixtral", format="q4_0")
    assert_payloads_are_the_model(model, result)
    assert {r.format for r in result.report.records} == {"q4_0"}


def test_rtn_is_the_plain_encode_with_the_imatrix_importance():
    ref, model, result = run("qwen3_moe", format="q4_0", method="rtn")
    assert_payloads_are_the_model(model, result)
    fmt = get_format("q4_0")
    params = dict(ref.named_parameters())
    names = {}
    for param, keys in result.param_keys.items():
        names.update({k: param for k in keys})
    checked = 0
    for param, entry in result.imatrix.items():
        w = params[param].detach().float().numpy()
        values = entry.values()
        if w.ndim == 2:
            want = np.asarray(encode(w, fmt, values[0]))
            got = result.weights[result.param_keys[param][0]].row_bytes()
            np.testing.assert_array_equal(got, want, err_msg=param)
            checked += 1
            continue
        stack = np.concatenate([result.weights[k].payload[None] for k in result.param_keys[param]
                                if ".0." in k.split("experts")[1][:3]])
        assert stack.shape[0] >= 1
        for e in range(w.shape[0]):
            want = np.asarray(encode(w[e], fmt, values[e]))       # (R, C // 32 * 18)
            keys = [k for k in result.param_keys[param] if f"experts.{e}." in k]
            got = np.concatenate([result.weights[k].row_bytes() for k in keys])
            np.testing.assert_array_equal(got, want, err_msg=f"{param}[{e}]")
            checked += 1
    assert checked > 30
    assert {r.method for r in result.report.records} == {"rtn"}


def test_resume_keeps_the_payload_bytes(tmp_path, monkeypatch):
    _, model, ref_result = run("qwen3_moe", **GPTQ)
    again = build("qwen3_moe")
    original = resume.Checkpoint.save_layer

    class Stop(Exception):
        pass

    def save_layer(self, i, *args):
        original(self, i, *args)
        if i == 0:
            raise Stop

    monkeypatch.setattr(resume.Checkpoint, "save_layer", save_layer)
    with pytest.raises(Stop):
        jgptq.quantize_moe(again, CALIB, checkpoint_dir=tmp_path, **GPTQ, **OPTS)
    monkeypatch.setattr(resume.Checkpoint, "save_layer", original)
    again = build("qwen3_moe")
    out = jgptq.quantize_moe(again, CALIB, checkpoint_dir=tmp_path, **GPTQ, **OPTS)
    assert set(out.weights) == set(ref_result.weights)
    for k, rec in ref_result.weights.items():
        assert np.array_equal(out.weights[k].payload, rec.payload) and out.weights[k].format == rec.format, k
    sa, sb = model.state_dict(), again.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert set(out.imatrix) == set(ref_result.imatrix)
    for k, entry in ref_result.imatrix.items():
        assert np.array_equal(out.imatrix[k].sums, entry.sums) and np.array_equal(out.imatrix[k].counts,
                                                                                  entry.counts)
    assert [r.format for r in out.report.records] == [r.format for r in ref_result.report.records]


def test_given_imatrix_replaces_the_collected_one():
    ref, _, first = run("qwen3_moe", format="q4_0", method="rtn")
    flat = {k: e._replace(sums=np.ones_like(e.sums) * (1 + np.arange(e.sums.shape[-1], dtype=np.float32)),
                          counts=np.ones_like(e.counts)) for k, e in first.imatrix.items()}
    model = copy.deepcopy(ref)
    res = jgptq.quantize_moe(model, CALIB, format="q4_0", method="rtn", imatrix=flat, **OPTS)
    w = dict(ref.named_parameters())["model.layers.0.self_attn.q_proj.weight"].detach().numpy()
    want = np.asarray(encode(w, "q4_0", 1 + np.arange(w.shape[1], dtype=np.float32)))
    np.testing.assert_array_equal(res.weights["model.layers.0.self_attn.q_proj.weight"].row_bytes(), want)
    with pytest.raises(ValueError, match="imatrix: no entry for model.layers.0.self_attn.q_proj.weight"):
        jgptq.quantize_moe(copy.deepcopy(ref), CALIB, format="q4_0", imatrix={}, **OPTS)


def test_block_size_is_checked_before_any_work_and_fallback_is_reported():
    model = build("qwen3_moe")          # hidden 64, expert width 32: not multiples of 256
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight: 64 input columns are not a "
                                         r"multiple of the q4_k block size 256"):
        jgptq.quantize_moe(model, CALIB, format="q4_k", **OPTS)
    layers = models.find_decoder_layers(model)[1]
    cfg = PipelineConfig.build(None, format="q4_k", block_fallback="llama.cpp")
    formats, notes = _formats("model.layers", layers, cfg)
    assert set(formats.values()) == {"q5_0"} and len(notes) == len(formats)
    assert "q5_0 used instead" in notes[0]
    with pytest.raises(ValueError, match="nor of the fallback"):
        _formats("model.layers", layers, PipelineConfig.build(None, format="q4_k", block_fallback="iq4_xs"))


def test_config_errors():
    with pytest.raises(ValueError, match="format iq2_xxs needs importance"):
        PipelineConfig.build(None, format="iq2_xxs", importance="none")
    with pytest.raises(ValueError, match="format iq1_m needs importance"):
        PipelineConfig.build(None, format="q4_k", formats=(("down", "iq1_m"),), importance="none")
    with pytest.raises(ValueError, match="importance"):
        PipelineConfig.build(None, format="q4_k", importance="mean")
    with pytest.raises(ValueError, match="mix"):
        PipelineConfig.build(None, mix="q4_k_xl")
    with pytest.raises(ValueError, match="base format is q4_k"):
        PipelineConfig.build(None, format="q6_k", mix="q4_k_m")
    with pytest.raises(ValueError, match="integer grids and GGML blocks do not mix"):
        PipelineConfig.build(None, formats=(("v_proj", "q8_0"),))
    with pytest.raises(ValueError, match="unknown GGML format"):
        PipelineConfig.build(None, format="q4_k", formats=(("v_proj", "q9_9"),))
    assert PipelineConfig.build(None, mix="q4_k_m").quant.format == "q4_k"


def _preset_formats(family, preset, layers):
    model = build(family, num_hidden_layers=layers)
    prefix, decoder = models.find_decoder_layers(model)
    cfg = PipelineConfig.build(None, mix=preset, block_fallback="llama.cpp")
    return prefix, _formats(prefix, decoder, cfg)[0]


def _formats(prefix, layers, cfg):
    """The planned format of every weight by parameter name, and the plan's fallback notes."""
    _, plan = run_setup.plan_layers(prefix, layers, cfg)
    return {p: m.format for p, m in plan.matrices.items()}, plan.notes


def test_q4_k_m_preset_follows_llama_cpp():
    # llama.cpp: use_more_bits(i, 8) holds for layers 0, 3, 6, 7 (i < n/8, i >= 7n/8, (i - n/8) % 3 == 2)
    assert [i for i in range(8) if mixes.use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(32) if mixes.use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                                     28, 29, 30, 31]
    more = {0, 3, 6, 7}
    # 4 experts: attn_v and ffn_down (experts included) raised to q6_k on those layers
    prefix, f = _preset_formats("mixtral", "q4_k_m", 8)
    for i in range(8):
        fmt = "q6_k" if i in more else "q4_k"
        assert mixes.preset_format("q4_k_m", "self_attn.v_proj", i, 8, 4) == fmt
        assert mixes.preset_format("q4_k_m", "mlp.experts.down_proj", i, 8, 4) == fmt
        assert mixes.preset_format("q4_k_m", "mlp.experts.gate_up_proj", i, 8, 4) == "q4_k"
        assert mixes.preset_format("q4_k_m", "self_attn.q_proj", i, 8, 4) == "q4_k"
    # (the tiny width 64 is below the 256 block: each choice then takes llama.cpp's fallback)
    assert f[f"{prefix}.0.self_attn.v_proj.weight"] == "q8_0" and f[f"{prefix}.1.self_attn.v_proj.weight"] == "q5_0"
    # 8 experts (llama.cpp's Mixtral rule): attn_v and attn_k q8_0, attn_output q5_k
    assert mixes.preset_format("q4_k_m", "self_attn.v_proj", 1, 8, 8) == "q8_0"
    assert mixes.preset_format("q4_k_m", "self_attn.k_proj", 1, 8, 8) == "q8_0"
    assert mixes.preset_format("q4_k_m", "self_attn.o_proj", 1, 8, 8) == "q5_k"
    assert mixes.preset_format("q4_k_m", "mlp.shared_expert.down_proj", 3, 8, 8) == "q6_k"
    assert mixes.preset_format("q4_k_s", "mlp.down_proj", 0, 8, 1) == "q5_k"
    assert mixes.preset_format("q4_k_s", "self_attn.v_proj", 5, 8, 1) == "q4_k"
    assert mixes.preset_format("q5_k_m", "mlp.down_proj", 7, 8, 1) == "q6_k"
    # explicit rules come first
    cfg = PipelineConfig.build(None, mix="q4_k_m", formats=((r"v_proj$", "iq4_xs"),))
    assert plan.format_of(cfg, "self_attn.v_proj", 0, 8, 4) == "iq4_xs"



def test_rtn_equals_llama_cpp_quantize_chunk_with_the_imatrix():
    """The plain-encode path against llama.cpp's own C encoder, fed the imatrix values per expert slice as
    llama-quantize does (skipped without llama.cpp's library)."""
    from benchmarks.anchors import llama_cpp

    if not llama_cpp.available():
        pytest.skip("llama.cpp's libggml-base is not available")
    ref, _, result = run("qwen3_moe", format="q4_0", method="rtn")
    params = dict(ref.named_parameters())
    type_id = get_format("q4_0").type_id
    for param, entry in result.imatrix.items():
        w = params[param].detach().float().numpy()
        stack = w[None] if w.ndim == 2 else w
        values = entry.values()
        for e in range(stack.shape[0]):
            want = llama_cpp.quantize(stack[e], type_id, values[e])
            keys = result.param_keys[param] if w.ndim == 2 else [k for k in result.param_keys[param]
                                                                 if f"experts.{e}." in k]
            got = np.concatenate([result.weights[k].row_bytes() for k in keys])
            np.testing.assert_array_equal(got, want, err_msg=f"{param}[{e}]")


def test_importance_choices():
    from jgptq.imatrix import ImatrixEntry

    rng = np.random.default_rng(0)
    entry = ImatrixEntry(rng.random((3, 8), dtype=np.float32), np.array([4, 0, 2], np.float32))
    h = rng.random((3, 8, 8)).astype(np.float32)
    imatrix = solve.importance_of(PipelineConfig.build(None, format="q4_0"), entry, h, [4, 0, 2], 3)
    np.testing.assert_array_equal(imatrix, entry.values())
    assert imatrix[1].tolist() == [1.0] * 8                       # no token: llama-quantize's 1.0
    hess = solve.importance_of(PipelineConfig.build(None, format="q4_0", importance="hessian"), entry, h,
                               [4, 0, 2], 3)
    np.testing.assert_array_equal(hess[[0, 2]], np.diagonal(h, axis1=1, axis2=2)[[0, 2]])
    assert hess[1].tolist() == [1.0] * 8
    shared = solve.importance_of(PipelineConfig.build(None, format="q4_0", importance="hessian"),
                                 ImatrixEntry(entry.sums[:1], entry.counts[:1]), h[0], [4, 4], 2)
    np.testing.assert_array_equal(shared, np.stack([np.diagonal(h[0])] * 2))
    assert solve.importance_of(PipelineConfig.build(None, format="q4_0", importance="none"), entry, h,
                               [4, 0, 2], 3) is None
