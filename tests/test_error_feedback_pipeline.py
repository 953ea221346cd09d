"""Error feedback through the torch pipeline: the cross statistic of every weight (attention, experts under the run's
routing) against float64 sums over the inputs of a quantized model and of the float one, hooked independently; the
layer outputs closer to the float model's than plain GPTQ's; chunks of experts give the whole layer's bytes; the
float stream's importance statistic is the same whether its forward runs beside the calibration or after it."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq_torch.pipeline import experts_capture, solve
from jgptq_torch.pipeline.capture import experts_implementation
from tests.tiny_models import build, chunk_budget, token_ids

OPTS = {"bits": 3, "group_size": 16, "batch_size": 4, "progress": False}


def _calib(n=8, length=32, pad=True):
    ids = token_ids(n, length, seed=3)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, 20:] = 0          # padding rows are neither paired nor counted
    return {"input_ids": ids, "attention_mask": mask}


def _recording_stacks(monkeypatch):
    """Layer index -> {stack name: Stack} of what the solves get."""
    seen: dict = {}
    original = solve.layer_stacks

    def record(collector, target, base, *args, **kwargs):
        out = original(collector, target, base, *args, **kwargs)
        seen.setdefault(int(base.rsplit(".", 1)[1]), {}).update({s.name: s for _, _, s in out})
        return out

    monkeypatch.setattr(solve, "layer_stacks", record)
    return seen


def _layer_inputs(model, calib, layer, batch_size):
    """float64 inputs of ``layer``'s q_proj and o_proj, its experts' (T, H) input and routed ids, over the kept
    tokens of every batch, from hooks on a forward of ``model`` (the pipeline's experts forward, bit for bit)."""
    dec = model.model.layers[layer]
    got = {"q": [], "o": [], "x": [], "idx": [], "keep": []}
    def rows(key):
        return lambda m, a: got[key].append(a[0].reshape(-1, a[0].shape[-1]))

    def routed(module, args):
        got["x"].append(args[0])
        got["idx"].append(args[1])

    hooks = [dec.self_attn.q_proj.register_forward_pre_hook(rows("q")),
             dec.self_attn.o_proj.register_forward_pre_hook(rows("o")),
             dec.mlp.experts.register_forward_pre_hook(routed)]
    try:
        with torch.no_grad(), experts_implementation(model):
            for b in range(0, calib["input_ids"].shape[0], batch_size):
                mask = calib["attention_mask"][b:b + batch_size]
                got["keep"].append(mask.reshape(-1).bool())
                model(input_ids=calib["input_ids"][b:b + batch_size], attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v).numpy() if k in ("idx", "keep") else torch.cat(v).detach().double().numpy()
            for k, v in got.items()}


def _cross(x, xf):
    return 2 / len(x) * (xf - x).T @ x


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_cross_statistics_equal_a_float64_reference(grouped, monkeypatch):
    monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype: grouped)
    float_model, calib = build("qwen3_moe"), _calib()
    stacks = _recording_stacks(monkeypatch)
    model = copy.deepcopy(float_model)
    jgptq.quantize_moe(model, calib, method="gptq_ef", **OPTS)
    # the first layer's inputs are the float model's: nothing to pair
    assert all(s.statistics == {"error_cross": None} for s in stacks[0].values())
    # layer 1 in the run: quantized layer 0, float layer 1
    hybrid = copy.deepcopy(float_model)
    hybrid.model.layers[0].load_state_dict(model.model.layers[0].state_dict())
    run, flt = _layer_inputs(hybrid, calib, 1, 4), _layer_inputs(float_model, calib, 1, 4)
    keep = run["keep"]
    base = "model.layers.1"
    for name, key in ((f"{base}.self_attn.q_proj", "q"), (f"{base}.self_attn.o_proj", "o")):
        want = _cross(run[key][keep], flt[key][keep])
        got = np.asarray(stacks[1][name].statistics["error_cross"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=name)
        assert np.abs(want).max() > 1e-3 * np.abs(run[key]).max() ** 2      # the stream has drifted
    experts = float_model.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().double().numpy()
    inter = experts.down_proj.shape[-1]

    def act(x, e):
        g, u = x @ gate_up[e, :inter].T, x @ gate_up[e, inter:].T
        return g / (1 + np.exp(-g)) * u

    up = np.asarray(stacks[1][f"{base}.mlp.experts.gate_up_proj"].statistics["error_cross"])
    down = np.asarray(stacks[1][f"{base}.mlp.experts.down_proj"].statistics["error_cross"])
    for e in range(gate_up.shape[0]):
        rows = keep & (run["idx"] == e).any(-1)        # the run's routing
        x, xf = run["x"][rows], flt["x"][rows]
        want_up, want_down = _cross(x, xf), _cross(act(x, e), act(xf, e))
        np.testing.assert_allclose(up[e], want_up, rtol=1e-4, atol=1e-4 * np.abs(want_up).max(), err_msg=str(e))
        np.testing.assert_allclose(down[e], want_down, rtol=1e-3, atol=1e-3 * np.abs(want_down).max(),
                                   err_msg=str(e))


def _hidden_error(float_model, model, ids):
    with torch.no_grad():
        hf = float_model(input_ids=ids, output_hidden_states=True).hidden_states
        hq = model(input_ids=ids, output_hidden_states=True).hidden_states
    return [float(((a.double() - b.double()) ** 2).sum()) for a, b in zip(hf[1:], hq[1:])]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_layer_outputs_are_closer_to_the_float_model_than_gptq(family):
    """On the calibration tokens: the first layer is GPTQ's (no pairs), the second's output is closer to the float
    model's (measured: 0.78x GPTQ's squared error on llama, 0.87x on qwen3_moe). The float stream's importance
    statistic (imatrix_source="float") is the same whether its forward runs beside the calibration or after it."""
    float_model, calib = build(family), _calib(pad=False)
    runs = {}
    for method in ("gptq", "gptq_ef"):
        model = copy.deepcopy(float_model)
        res = jgptq.quantize_moe(model, calib, method=method, imatrix_source="float", **OPTS)
        runs[method] = (model, res, _hidden_error(float_model, model, calib["input_ids"]))
    (_, plain, (p0, p1)), (_, ef, (e0, e1)) = runs["gptq"], runs["gptq_ef"]
    assert e0 == p0 and e1 < 0.95 * p1
    for name, entry in plain.imatrix.items():
        np.testing.assert_allclose(ef.imatrix[name].sums, entry.sums, rtol=1e-6, err_msg=name)
        np.testing.assert_array_equal(ef.imatrix[name].counts, entry.counts)
    assert any(r.method == "gptq_ef" for r in ef.report.records)


def test_chunks_of_experts_give_the_bytes_of_the_whole_layers():
    float_model, calib = build("qwen3_moe"), _calib()
    full = jgptq.quantize_moe(copy.deepcopy(float_model), calib, method="gptq_ef", **OPTS)
    result = jgptq.quantize_moe(copy.deepcopy(float_model), calib, method="gptq_ef", offload="cpu",
                                device_budget=chunk_budget(float_model, full, 3), **OPTS)
    assert [p["experts_per_chunk"] for p in result.report.memory["expert_chunks"]] == [[3, 3, 2]]
    assert set(full.weights) == set(result.weights)
    for key, rec in full.weights.items():
        assert np.array_equal(rec.codes, result.weights[key].codes), key
