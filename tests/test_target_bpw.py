"""target_bpw through jgptq.quantize_moe: the budget met in the bytes written, formats that follow measured
sensitivity, fixed costs, resume, the GGUF file's per-tensor types and metadata."""

import copy
import json

import numpy as np
import pytest
import torch

import jgptq
from jgptq_torch.pipeline import gains, measure, sensitivity
from jgptq.export import GGMLWeight
from tests.tiny_models import build, token_ids

CALIB = token_ids(8, 32, seed=1)
OPTS = dict(batch_size=8, progress=False)
GGML = dict(format="q8_0", target_bpw=5.0, target_formats=("q4_0", "q5_0", "q8_0"))


@pytest.fixture(scope="module")
def gptq_run(tmp_path_factory):
    """(float model, quantized model, result, checkpoint folder) of a GPTQ target run with a resumable state."""
    work = tmp_path_factory.mktemp("target") / "state"
    ref = build("qwen3_moe")
    model = copy.deepcopy(ref)
    return ref, model, jgptq.quantize_moe(model, CALIB, **OPTS, **GGML, checkpoint_dir=work), work


def group_formats(result) -> dict:
    return {p: g["format"] for g in result.report.allocation["groups"] for p in g["params"]}


def test_the_budget_is_met_in_the_bytes_written(gptq_run):
    _, _, result, _ = gptq_run
    a = result.report.allocation
    written = sum(rec.payload.nbytes for rec in result.weights.values())
    assert written == a["total_bytes"] <= a["budget_bytes"] == int(5.0 * a["weights"]) // 8
    assert a["achieved_bpw"] == pytest.approx(written * 8 / a["weights"])
    assert a["weights"] == sum(int(np.prod(rec.shape)) for rec in result.weights.values())
    formats = group_formats(result)
    for key, rec in result.weights.items():   # checkpoint keys: ...experts.3.down_proj.weight
        param = next(p for p in result.param_keys if key in result.param_keys[p])
        assert isinstance(rec, GGMLWeight) and rec.format == formats[param], key
    assert len(set(formats.values())) > 1
    for g in a["groups"]:
        assert set(g["costs"]) == {"q4_0", "q5_0", "q8_0"}
        assert g["costs"]["q4_0"] > g["costs"]["q5_0"] > g["costs"]["q8_0"] > 0     # more bits, less error
        assert g["bpw"] == {"q4_0": 4.5, "q5_0": 5.5, "q8_0": 8.5}[g["format"]]
    assert a["predicted_objective"] == pytest.approx(sum(g["costs"][g["format"]] for g in a["groups"]))


def test_the_allocation_is_monotone_in_the_budget(gptq_run):
    _, _, result, _ = gptq_run
    a = result.report.allocation
    sizes, objectives = [], []
    for bpw in np.linspace(4.5, 8.5, 17):
        b = sensitivity.reallocate(a, float(bpw))
        assert b["total_bytes"] <= b["budget_bytes"]
        sizes.append(b["total_bytes"])
        objectives.append(b["predicted_objective"])
    assert all(x <= y for x, y in zip(sizes, sizes[1:]))
    assert all(y <= x * (1 + 1e-12) for x, y in zip(objectives, objectives[1:]))
    assert {g["format"] for g in sensitivity.reallocate(a, 8.5)["groups"]} == {"q8_0"}   # room for the best
    assert {g["format"] for g in sensitivity.reallocate(a, 4.5)["groups"]} == {"q4_0"}
    with pytest.raises(ValueError) as err:
        sensitivity.reallocate(a, 4.4)
    assert str(err.value) == ("target_bpw=4.4 is below the 4.5 bits per weight of every tensor at its cheapest "
                              "candidate (q4_0); raise it or add cheaper target_formats")


def test_a_resumed_run_takes_the_allocation_over_and_writes_the_same_bytes(gptq_run, monkeypatch):
    ref, _, result, work = gptq_run
    assert json.loads((work / "allocation.json").read_text())["allocation"] == result.report.allocation

    def never(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(measure, "Measure", never)
    monkeypatch.setattr(gains, "fisher_gains", never)
    again = jgptq.quantize_moe(copy.deepcopy(ref), CALIB, **OPTS, **GGML, checkpoint_dir=work)
    assert again.report.allocation == result.report.allocation
    assert sorted(again.weights) == sorted(result.weights)
    for key, rec in result.weights.items():
        np.testing.assert_array_equal(again.weights[key].payload, rec.payload, err_msg=key)


def test_the_gguf_file_holds_the_chosen_types_and_the_allocation(gptq_run, tmp_path):
    import gguf

    from jgptq_torch.export.gguf.export import gguf_names

    _, model, result, _ = gptq_run
    path = jgptq.export_gguf(model, result, tmp_path / "target.gguf", float_type="f32")
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    names = gguf_names(model)
    checked = 0
    for param, fmt in group_formats(result).items():
        for name, _ in names[param]:
            assert types[name] == gguf.GGMLQuantizationType[fmt.upper()], (param, name)
            checked += 1
    assert checked >= 12
    field = reader.get_field("jgptq.target_bpw")
    assert float(field.parts[field.data[0]][0]) == 5.0
    field = reader.get_field("jgptq.allocation")
    assert json.loads(bytes(field.parts[field.data[0]]).decode()) == result.report.allocation


def test_formats_follow_measured_sensitivity_and_rules_are_fixed_costs():
    model = build("qwen3_moe", seed=3)
    with torch.no_grad():   # layer 1's q_proj errs 30x more in its output: its costs rise 900x
        model.model.layers[1].self_attn.q_proj.weight.mul_(30.0)
    result = jgptq.quantize_moe(model, CALIB, **OPTS, format="q8_0", method="rtn", target_bpw=6.0,
                                target_formats=("q4_0", "q8_0"), target_gain="one",
                                formats=((r"k_proj$", "q5_0"),), exclude=(r"o_proj$",))
    a = result.report.allocation
    chosen = {(g["layer"], g["name"]): g["format"] for g in a["groups"]}
    costs = {(g["layer"], g["name"]): g["costs"] for g in a["groups"]}
    assert costs[(1, "self_attn.q_proj")]["q4_0"] > 100 * costs[(0, "self_attn.q_proj")]["q4_0"]
    assert chosen[(1, "self_attn.q_proj")] == "q8_0" and "q4_0" in chosen.values()
    fixed = {f["param"]: (f["format"], f["bytes"]) for f in a["fixed"]}
    assert fixed == {f"model.layers.{i}.self_attn.{n}.weight": f for i in range(2) for n, f in
                     (("k_proj", ("q5_0", 32 * 2 * 22)), ("o_proj", ("float", 64 * 64 * 2)))}
    assert not any("o_proj" in g["name"] or "k_proj" in g["name"] for g in a["groups"])
    formats = {k: rec.format for k, rec in result.weights.items()}
    assert formats["model.layers.0.self_attn.k_proj.weight"] == "q5_0"
    assert not any("o_proj" in k for k in formats)
    written = sum(rec.payload.nbytes for rec in result.weights.values()) + 2 * 64 * 64 * 2   # + o_proj in f16
    assert written == a["total_bytes"] <= a["budget_bytes"]


def test_integer_grids_get_bits_per_group_under_the_budget():
    result = jgptq.quantize_moe(build("qwen3_moe"), CALIB, **OPTS, method="rtn", bits=4, group_size=32,
                                target_bpw=4.2, target_formats=("int3", "int4", "int8"))
    a = result.report.allocation
    formats = group_formats(result)
    bits = 0
    for key, rec in result.weights.items():
        param = next(p for p in result.param_keys if key in result.param_keys[p])
        assert f"int{rec.bits}" == formats[param], key
        bits += rec.bits * rec.codes.size + 16 * rec.scales.size     # symmetric: codes and float16 scales
    assert bits == 8 * a["total_bytes"] and a["total_bytes"] <= a["budget_bytes"]
    assert len(set(formats.values())) > 1


def test_a_target_below_every_candidate_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(measure, "Measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(ValueError) as err:
        jgptq.quantize_moe(build("qwen3_moe"), CALIB, **OPTS, format="q8_0", target_bpw=3.0,
                           target_formats=("q4_0", "q8_0"), exclude=("o_proj",))
    # o_proj (2 x 64 x 64) stays in floating point at 16 bits, the other 114688 weights at q4_0's 4.5 bits
    assert (2 * 64 * 64 * 16 + 114688 * 4.5) / 122880 == pytest.approx(5.267, abs=5e-4)
    assert str(err.value) == ("target_bpw=3 is below the 5.267 bits per weight of every tensor at its cheapest "
                              "candidate (q4_0, and the tensors formats/exclude fix); raise it or add cheaper "
                              "target_formats")


def test_the_report_shows_the_allocation_as_a_table_and_bits_per_layer():
    from jgptq_torch.report import Report

    groups = [{"layer": 0, "name": "self_attn.q_proj", "format": "q8_0", "bpw": 8.5, "bytes": 4352,
               "costs": {"q4_0": 2.0, "q8_0": 0.25}},
              {"layer": 1, "name": "self_attn.q_proj", "format": "q4_0", "bpw": 4.5, "bytes": 2304,
               "costs": {"q4_0": 0.5, "q8_0": 0.125}},
              {"layer": 1, "name": "mlp.experts.down_proj", "format": "q4_0", "bpw": 4.5, "bytes": 9216,
               "costs": {"q4_0": 1e-5, "q8_0": 1e-6}}]
    fixed = [{"param": "model.layers.0.self_attn.o_proj.weight", "format": "float", "bytes": 8192}]
    report = Report(config={}, allocation={"target_bpw": 5.0, "achieved_bpw": 5.1, "total_bytes": 15872,
                                           "budget_bytes": 16000, "predicted_objective": 0.75, "gain": "one",
                                           "groups": groups, "fixed": fixed})
    assert report.allocation_table().splitlines() == [
        "layer tensor group                 format      bpw        bytes        cost",
        "    0 self_attn.q_proj             q8_0      8.500         4352        0.25",
        "    1 self_attn.q_proj             q4_0      4.500         2304         0.5",
        "    1 mlp.experts.down_proj        q4_0      4.500         9216       1e-05",
        "      model.layers.0.self_attn.o_proj.weight fixed at float, 8192 bytes"]
    series, layers = report.bits_by_layer()
    assert layers == [0, 1] and series["self_attn.q_proj"] == [8.5, 4.5]
    assert np.isnan(series["mlp.experts.down_proj"][0]) and series["mlp.experts.down_proj"][1] == 4.5
    assert "target 5 bpw: 5.1000 bpw, 15872 of 16000 bytes; predicted objective 0.75 (gain one)" in report.summary()
    assert Report(config={}).allocation_table() == "" and "target" not in Report(config={}).summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_a_model_in_host_memory_gets_its_gains_on_the_device_and_its_budget(monkeypatch):
    from jgptq_torch.pipeline.calib import Batch

    wide = dict(hidden_size=256, head_dim=64, moe_intermediate_size=256, intermediate_size=256)
    model = build("qwen3_moe", **wide)
    on_host = gains.fisher_gains(copy.deepcopy(model), [Batch(CALIB, torch.ones_like(CALIB))])
    seen = []
    original = gains.fisher_gains

    def watch(m, batch_list, **kw):
        seen.append({p.device.type for p in m.parameters()})
        return original(m, batch_list, **kw)

    monkeypatch.setattr(gains, "fisher_gains", watch)   # FirstPass.gains imports it from the module when it runs
    result = jgptq.quantize_moe(model, CALIB, **OPTS, format="q4_k", device="cuda", target_bpw=3.0,
                                target_formats=("iq2_xxs", "q2_k", "iq3_xxs", "q4_k", "q6_k"))
    assert seen == [{"cuda"}] and {p.device.type for p in model.parameters()} == {"cpu"}
    a = result.report.allocation
    written = sum(rec.payload.nbytes for rec in result.weights.values())
    assert written == a["total_bytes"] <= a["budget_bytes"] and len({g["format"] for g in a["groups"]}) > 1
    for g in a["groups"]:   # the device's gains agree with those of host memory
        assert g["gain"] == pytest.approx(float(np.mean([np.mean(on_host[p]) for p in g["params"]])), rel=1e-2)
