"""Resumable runs: a run stopped after a layer and started again continues there and gives the same bytes; a
state of another run is refused; resume=False starts over."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

import jgptq
from jgptq_torch.pipeline import layerwise
from jgptq_torch.pipeline import resume
from tests.tiny_models import build, token_ids

CALIB = token_ids(8, 32, seed=1)
OPTS = dict(bits=3, group_size=16, batch_size=4, progress=False)
_REF: dict = {}


class Stop(Exception):
    pass


def reference():
    """(float model of 3 layers, its uninterrupted quantized copy, result), built once."""
    if not _REF:
        float_model = build("qwen3_moe", num_hidden_layers=3)
        model = copy.deepcopy(float_model)
        _REF["run"] = (float_model, model, jgptq.quantize_moe(model, CALIB, **OPTS))
    return _REF["run"]


def assert_same(a_model, a, b_model, b):
    sa, sb = a_model.state_dict(), b_model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert set(a.weights) == set(b.weights)
    for k, rec in a.weights.items():
        other = b.weights[k]
        for f in ("codes", "scales", "zeros", "g_idx"):
            assert np.array_equal(getattr(rec, f), getattr(other, f)), (k, f)
        assert (rec.method, rec.transposed, rec.act_order) == (other.method, other.transposed, other.act_order)
    as_text = [json.dumps([dataclasses.asdict(r) for r in x.report.records]) for x in (a, b)]  # NaN == NaN
    assert as_text[0] == as_text[1]
    assert a.report.coverage == b.report.coverage and a.report.thresholds == b.report.thresholds
    assert a.report.warnings == b.report.warnings


def stop_after(monkeypatch, layer):
    original = resume.Checkpoint.save_layer

    def save_layer(self, i, *args):
        original(self, i, *args)
        if i == layer:
            raise Stop

    monkeypatch.setattr(resume.Checkpoint, "save_layer", save_layer)
    return original


def test_stopped_run_continues_after_its_last_finished_layer(tmp_path, monkeypatch):
    float_model, done, full = reference()
    work = tmp_path / "work"
    original = stop_after(monkeypatch, 1)
    with pytest.raises(Stop):
        jgptq.quantize_moe(copy.deepcopy(float_model), CALIB, checkpoint_dir=work, **OPTS)
    state = json.loads((work / "state.json").read_text())
    assert state["layers_done"] == 2
    assert sorted(p.name for p in work.iterdir()) == ["inputs-00002.safetensors", "layer-00000.json",
                                                     "layer-00000.safetensors", "layer-00001.json",
                                                     "layer-00001.safetensors", "state.json"]
    monkeypatch.setattr(resume.Checkpoint, "save_layer", original)
    solved = []
    process = layerwise._layer_step
    monkeypatch.setattr(layerwise, "_layer_step", lambda run, i, *a, **k: solved.append(i) or process(run, i, *a, **k))
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, CALIB, checkpoint_dir=work, **OPTS)
    assert solved == [2]                                 # layers 0 and 1 were taken over, not solved again
    assert_same(done, full, model, result)
    # a finished state: a third run solves nothing and still returns the whole result
    solved.clear()
    again = copy.deepcopy(float_model)
    assert_same(done, full, again, jgptq.quantize_moe(again, CALIB, checkpoint_dir=work, **OPTS))
    assert solved == []


def test_state_of_another_run_is_refused_and_resume_false_starts_over(tmp_path, monkeypatch):
    float_model, done, full = reference()
    work = tmp_path / "work"
    stop_after(monkeypatch, 0)
    with pytest.raises(Stop):
        jgptq.quantize_moe(copy.deepcopy(float_model), CALIB, checkpoint_dir=work, **OPTS)
    monkeypatch.undo()
    (work / "notes.txt").write_text("mine")
    other_weights = copy.deepcopy(float_model)
    with torch.no_grad():
        other_weights.model.norm.weight[0] += 1
    for model, calib, opts, what in [(other_weights, CALIB, OPTS, "the model"),
                                     (float_model, CALIB[:4], OPTS, "the calibration tokens"),
                                     (float_model, CALIB, {**OPTS, "damp": 0.02}, "the quantization settings")]:
        with pytest.raises(resume.ResumeMismatchError, match=f"{what} .*differ.*resume=False"):
            jgptq.quantize_moe(copy.deepcopy(model), calib, checkpoint_dir=work, **opts)
    # progress bars do not count as a setting; resume=False discards the state (and only jgptq's files)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, CALIB, checkpoint_dir=work, resume=False, **{**OPTS, "progress": True})
    assert_same(done, full, model, result)
    assert (work / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="keep_hessians"):
        jgptq.quantize_moe(copy.deepcopy(float_model), CALIB, checkpoint_dir=work, keep_hessians=True, **OPTS)
