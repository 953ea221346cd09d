"""Llama 4 text models: routed experts fed every token pre-scaled by its routing score, a shared expert, and
interleaved dense / MoE layers (``jgptq_torch.pipeline.prescaled_capture``)."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq import statistics
from jgptq_torch import models
from jgptq_torch.pipeline import capture
from tests.tiny_models import build, next_token_kl, token_ids

CALIB = token_ids(16, 32, seed=1)
HELD_OUT = token_ids(8, 32, seed=2)
OPTS = dict(bits=3, group_size=16, batch_size=8, progress=False)
_RUNS: dict = {}


def interleaved(seed=0):
    """Layer 0 dense (an MLP of intermediate_size_mlp), layer 1 MoE (4 experts, top-2, a shared expert)."""
    return build("llama4", seed=seed, interleave_moe_layer_step=2, num_experts_per_tok=2)


def run(method):
    if method not in _RUNS:
        ref = interleaved()
        model = copy.deepcopy(ref)
        _RUNS[method] = (ref, model, jgptq.quantize_moe(model, CALIB, method=method, **OPTS))
    return _RUNS[method]


def test_targets_of_dense_and_moe_layers():
    model = interleaved()
    assert model.config.moe_layers == [1]
    dense, moe = (models.layer_targets(layer) for layer in model.model.layers)
    assert not dense.experts and {"feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"} <= \
        set(dense.linears)
    assert {"feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj",
            "feed_forward.shared_expert.down_proj"} <= set(moe.linears)
    assert "feed_forward.router" not in moe.linears and ("feed_forward.router", "router") in moe.skipped
    (module, lay), = moe.experts.values()
    assert list(moe.experts) == ["feed_forward.experts"]
    # stored (E, H, 2I) and (E, I, H): gate = gate_up_proj[e][:, :I]^T, up = [:, I:]^T, down = down_proj[e]^T
    assert (lay.transposed, lay.concatenated, lay.gated, lay.biased) == (True, True, True, False)
    assert (lay.num_experts, lay.hidden, lay.inter) == (4, 64, 32)
    w = lay.linear(module.gate_up_proj.detach())
    assert torch.equal(w[2, :32], module.gate_up_proj[2, :, :32].T)


def reference(model, ids, mask):
    """Float64 Hessians of layer 0's experts from an eager run: the block's input x, the router's logits, and for
    each expert e its top-k tokens' rows sigmoid(logit)·x and act(gate)·up of those rows."""
    moe = model.model.layers[0].feed_forward
    seen = {}
    h1 = moe.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    h2 = moe.router.register_forward_hook(lambda m, a, o: seen.__setitem__("logits", o[1].detach().clone()))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    h1.remove()
    h2.remove()
    x = seen["x"].reshape(-1, seen["x"].shape[-1]).double().numpy()
    logits = seen["logits"].double().numpy()
    k = model.config.num_experts_per_tok
    top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    keep = mask.reshape(-1).bool().numpy()
    gate_up = moe.experts.gate_up_proj.detach().double().numpy()      # (E, H, 2I)
    inter = moe.experts.down_proj.shape[1]
    out = []
    for e in range(gate_up.shape[0]):
        rows = keep & (top == e).any(-1)
        xe = x[rows] / (1 + np.exp(-logits[rows, e:e + 1]))
        g, u = xe @ gate_up[e, :, :inter], xe @ gate_up[e, :, inter:]
        act = g / (1 + np.exp(-g)) * u
        n = max(len(xe), 1)
        out.append((int(rows.sum()), 2 * xe.T @ xe / n, 2 * act.T @ act / n))
    return out


def test_capture_keeps_the_eager_output():
    model = build("llama4", num_experts_per_tok=2)
    ids = token_ids(2, 12, seed=3)
    with torch.no_grad():
        eager = model(ids).logits
        experts = {f"model.layers.{i}.feed_forward.experts": (layer.feed_forward.experts,
                                                               models.ExpertsLayout.of(layer.feed_forward.experts))
                   for i, layer in enumerate(model.model.layers)}
        collector = capture.Collector({}, experts)
        with capture.experts_implementation(model), collector.attach(), collector.batch(torch.ones_like(ids)):
            captured = model(ids).logits
        assert torch.equal(captured, eager)
        assert all(sum(n) == 2 * ids.numel() for n in collector.routed.values())
        assert "forward" not in model.model.layers[0].feed_forward.experts.__dict__   # the forward is restored
        assert torch.equal(model(ids).logits, eager)


@pytest.mark.parametrize("weighting", ["none", "squared"])
def test_expert_hessians_are_over_the_prescaled_routed_rows_and_exclude_padding(weighting):
    # the routing score multiplies these experts' inputs, not their outputs: router weighting leaves them as they are
    model = build("llama4", num_experts_per_tok=2)
    ids = token_ids(4, 24, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 4:] = 0
    ref = reference(model, ids, mask)
    res = jgptq.quantize_moe(model, {"input_ids": ids, "attention_mask": mask}, method="rtn", bits=4,
                             group_size=16, keep_hessians=True, progress=False, batch_size=4,
                             router_weighting=weighting)
    key = "feed_forward.experts"
    (h_up, n_up), (h_down, n_down) = (res.hessians[(0, (key, part))] for part in ("gate_up", "down"))
    assert n_up == n_down == [r[0] for r in ref]
    assert sum(n_up) == 2 * int(mask.sum())
    assert res.report.coverage[f"model.layers.0.{key}"] == n_up
    for e, (n, hu, hd) in enumerate(ref):
        np.testing.assert_allclose(np.asarray(h_up[e]), hu, rtol=1e-5, atol=1e-6 * np.abs(hu).max())
        np.testing.assert_allclose(np.asarray(h_down[e]), hd, rtol=1e-4, atol=1e-5 * np.abs(hd).max())


def test_every_target_is_solved_with_gptq_and_written_back():
    _, model, result = run("gptq")
    records = {r.name: r for r in result.report.records}
    experts = [r for r in records.values() if r.kind != "linear"]
    assert len(experts) == 8 and all(r.tokens > 0 for r in experts)
    assert all(r.method == "gptq" and not r.fallback and np.isfinite(r.loss) for r in records.values())
    assert sum(result.report.coverage["model.layers.1.feed_forward.experts"]) == 2 * CALIB.numel()
    assert {"model.layers.0.feed_forward.gate_proj.weight", "model.layers.1.feed_forward.shared_expert.up_proj.weight",
            "model.layers.1.self_attn.q_proj.weight"} <= set(result.weights)
    state = model.state_dict()
    for key in ("model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.1.feed_forward.experts.down_proj",
                "model.layers.0.feed_forward.down_proj.weight"):
        qw = result.weights[key]
        stored = state[key].float().numpy()
        if qw.transposed:            # Llama 4 stores its experts (E, in, out)
            stored = np.swapaxes(stored, -1, -2)
        np.testing.assert_array_equal(qw.dequantize(), stored, err_msg=key)
    assert result.weights["model.layers.1.feed_forward.experts.gate_up_proj"].codes.shape == (4, 64, 64)


def test_gptq_beats_round_to_nearest_on_held_out_next_token_kl():
    ref, gptq_model, _ = run("gptq")
    _, rtn_model, rtn = run("rtn")
    assert all(r.method == "rtn" for r in rtn.report.records)
    kl_gptq, kl_rtn = next_token_kl(ref, gptq_model, HELD_OUT), next_token_kl(ref, rtn_model, HELD_OUT)
    assert 0 < kl_gptq < 0.9 * kl_rtn, (kl_gptq, kl_rtn)


def test_all_experts_calibration_is_refused_with_the_reason():
    model = build("llama4")
    experts = {"feed_forward.experts": (model.model.layers[0].feed_forward.experts,
                                        models.ExpertsLayout.of(model.model.layers[0].feed_forward.experts))}
    collector = capture.Collector({}, experts, statistics.calibration(all_experts=True))
    ids = token_ids(1, 8, seed=0)
    with torch.no_grad(), capture.experts_implementation(model), collector.attach(), \
            collector.batch(torch.ones_like(ids)):
        with pytest.raises(models.UnsupportedModelError, match="pre-scaled by the routing score"):
            model(ids)


def test_compressed_tensors_export_of_fused_llama4_experts_is_refused_by_name():
    from jgptq_torch.export.checkpoint import ExportError, export_model

    _, model, result = run("gptq")
    # transformers keeps Llama 4's experts in fused (E, in, out) parameters that compressed-tensors cannot hold
    with pytest.raises(ExportError, match=r"feed_forward\.experts\.\w+_proj: Llama4ForCausalLM checkpoints keep "
                                          r"every expert in one fused tensor"):
        export_model(model, result, "compressed-tensors", "/nonexistent/never-written")
