"""imatrix_source="float": the importance statistic of every weight equals float64 sums over the inputs the
unquantized model gives each layer (one forward of a float copy, seen by torch hooks), routed tokens only for
experts; "replay" collects it on the run's own inputs, which differ after the first layer. A resumed float-source
run gives the same statistic and bytes."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq_torch.pipeline import resume
from jgptq_torch.pipeline.capture import experts_implementation
from tests.tiny_models import build, token_ids

OPTS = dict(method="rtn", bits=2, group_size=16, batch_size=4, progress=False)


def _calib():
    ids = token_ids(6, 24, seed=5)
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0          # padding rows must not count
    return {"input_ids": ids, "attention_mask": mask}, mask


def _float64_reference(float_model, calib, batch_size):
    """Per layer, float64 sums of squared inputs (and counts) of the experts' gate/up and down inputs per expert over
    its routed tokens, and of q_proj's and o_proj's inputs, in forwards of the unquantized model over the same
    batches."""
    sums: dict = {}
    handles = []
    keep_all = calib["attention_mask"].bool()
    current = {}

    def add(key, value, count):
        old = sums.get(key, (0.0, 0))
        sums[key] = (old[0] + value, old[1] + count)

    for i, layer in enumerate(float_model.model.layers):
        def experts_hook(module, args, i=i):
            x, idx = args[0].detach().double(), args[1]
            keep = current["keep"]
            for e in range(module.gate_up_proj.shape[0]):
                rows = (idx == e).any(-1) & keep
                xe = x[rows]
                g, u = (xe @ module.gate_up_proj[e].detach().double().T).chunk(2, dim=-1)
                add((i, "up", e), (xe ** 2).sum(0).numpy(), int(rows.sum()))
                add((i, "down", e), ((torch.nn.functional.silu(g) * u) ** 2).sum(0).numpy(), int(rows.sum()))

        def linear_hook(name, i=i):
            def hook(module, args):
                x = args[0].detach().double().reshape(-1, args[0].shape[-1])[current["keep"]]
                add((i, name), (x ** 2).sum(0).numpy(), x.shape[0])
            return hook

        handles.append(layer.mlp.experts.register_forward_pre_hook(experts_hook))
        handles.append(layer.self_attn.q_proj.register_forward_pre_hook(linear_hook("q")))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(linear_hook("o")))
    try:
        with torch.no_grad(), experts_implementation(float_model):   # the pipeline's experts forward, bit for bit
            for b in range(0, calib["input_ids"].shape[0], batch_size):
                mask = calib["attention_mask"][b:b + batch_size]
                current["keep"] = keep_all[b:b + batch_size].reshape(-1)
                float_model(input_ids=calib["input_ids"][b:b + batch_size], attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sums


def _assert_equal_to(result, ref, layers):
    for i in range(layers):
        base = f"model.layers.{i}"
        up, down = result.imatrix[f"{base}.mlp.experts.gate_up_proj"], result.imatrix[f"{base}.mlp.experts.down_proj"]
        for e in range(up.counts.shape[0]):
            want_up, n = ref[(i, "up", e)] if (i, "up", e) in ref else (0.0, 0)
            assert up.counts[e] == n and down.counts[e] == n
            np.testing.assert_allclose(up.sums[e], want_up, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(down.sums[e], ref[(i, "down", e)][0], rtol=2e-4, atol=1e-6)
        for name, key in (("q_proj", "q"), ("k_proj", "q"), ("v_proj", "q"), ("o_proj", "o")):
            entry = result.imatrix[f"{base}.self_attn.{name}.weight"]
            want, n = ref[(i, key)]
            assert entry.counts.tolist() == [n]
            np.testing.assert_allclose(entry.sums[0], want, rtol=2e-5, atol=1e-6)


def test_float_source_equals_float64_sums_of_the_unquantized_model_and_replay_differs():
    float_model = build("qwen3_moe", num_hidden_layers=3)
    calib, _ = _calib()
    ref = _float64_reference(copy.deepcopy(float_model), calib, OPTS["batch_size"])
    floated = jgptq.quantize_moe(copy.deepcopy(float_model), calib, imatrix_source="float", **OPTS)
    _assert_equal_to(floated, ref, 3)
    assert floated.report.config["imatrix_source"] == "float"
    assert "float" in floated.report.timings[1] and "float" not in floated.report.timings[0]  # layer 0 shared
    replayed = jgptq.quantize_moe(copy.deepcopy(float_model), calib, **OPTS)
    for name, entry in replayed.imatrix.items():
        same = np.array_equal(entry.sums, floated.imatrix[name].sums)
        assert same == name.startswith("model.layers.0."), name   # the first layer's inputs are the same
    with pytest.raises(AssertionError):
        _assert_equal_to(replayed, ref, 3)


def test_float_source_only_changes_the_importance_of_a_ggml_run():
    """The weights of a GGML run differ between the sources only through the encoders' importance: with the float
    statistic given as an imatrix, a replay-source run makes the same bytes as the float-source run."""
    model = build("qwen3_moe")
    calib, _ = _calib()
    opts = dict(format="q4_0", method="rtn", batch_size=4, progress=False)
    floated = jgptq.quantize_moe(copy.deepcopy(model), calib, imatrix_source="float", **opts)
    given = jgptq.quantize_moe(copy.deepcopy(model), calib, imatrix=floated.imatrix, **opts)
    for key, rec in floated.weights.items():
        np.testing.assert_array_equal(rec.payload, given.weights[key].payload)


class Stop(Exception):
    pass


def test_resumed_float_source_run_gives_the_same_statistic_and_bytes(tmp_path, monkeypatch):
    float_model = build("qwen3_moe", num_hidden_layers=3)
    calib, _ = _calib()
    opts = dict(OPTS, imatrix_source="float")
    full = jgptq.quantize_moe(copy.deepcopy(float_model), calib, **opts)
    original = resume.Checkpoint.save_layer

    def save_layer(self, i, *args):
        original(self, i, *args)
        if i == 1:
            raise Stop

    monkeypatch.setattr(resume.Checkpoint, "save_layer", save_layer)
    with pytest.raises(Stop):
        jgptq.quantize_moe(copy.deepcopy(float_model), calib, checkpoint_dir=tmp_path / "w", **opts)
    monkeypatch.setattr(resume.Checkpoint, "save_layer", original)
    again = jgptq.quantize_moe(copy.deepcopy(float_model), calib, checkpoint_dir=tmp_path / "w", **opts)
    assert set(again.imatrix) == set(full.imatrix)
    for name, entry in full.imatrix.items():
        np.testing.assert_array_equal(again.imatrix[name].sums, entry.sums)
        np.testing.assert_array_equal(again.imatrix[name].counts, entry.counts)
    for key, rec in full.weights.items():
        np.testing.assert_array_equal(again.weights[key].codes, rec.codes)


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match=r"^PipelineConfig.imatrix_source='quantized': must be one of "
                                         r"\('replay', 'float'\)$"):
        jgptq.PipelineConfig(imatrix_source="quantized")
