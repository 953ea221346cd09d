"""Offload modes and the device budget of the layerwise pipeline, on the CPU (which plays the device; the budget is
checked against the pipeline's own booking of what it placed there): layer files keep buffers and ties; a model
larger than the budget goes through disk and cpu offload with the bytes of an un-offloaded run, with one layer in
host memory at a time (disk); over-budget runs stop before any work; a stopped disk-offloaded run resumes to the
same bytes."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import jgptq
from jgptq_torch.pipeline import layerwise
from jgptq_torch.pipeline import offload
from jgptq_torch.pipeline.offload import DeviceBudgetError
from tests.cli import test_resume as resume_tests
from tests.tiny_models import build

CALIB, OPTS = resume_tests.CALIB[:4], resume_tests.OPTS   # one batch of 4 x 32 tokens
LAYERS = 6
_RUN: dict = {}


def own_bytes(module, where=None) -> int:
    """Bytes of the distinct tensors of ``module`` (those on device type ``where`` when given), counted here."""
    seen = {}
    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and (where is None or t.device.type == where):
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def six_layers():
    """(float model of 6 layers, its un-offloaded quantized copy, result), built once."""
    if not _RUN:
        float_model = build("qwen3_moe", num_hidden_layers=LAYERS)
        model = copy.deepcopy(float_model)
        _RUN["run"] = (float_model, model, jgptq.quantize_moe(model, CALIB, **OPTS))
    return _RUN["run"]


def budget_below_the_model(float_model) -> int:
    """A device budget smaller than the model's parameters (85 %) but above one layer's need."""
    return int(0.85 * own_bytes(float_model))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight                                  # tied
        self.register_buffer("scale", torch.randn(8))
        self.register_buffer("table", torch.arange(5), persistent=False)
        self.low = nn.Parameter(torch.randn(3, 4).to(torch.bfloat16), requires_grad=False)


def test_layer_file_round_trip_keeps_buffers_ties_and_dtypes(tmp_path):
    torch.manual_seed(0)
    layer = Block()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    table = layer.table.clone()
    path = tmp_path / "layer.safetensors"
    offload.write_layer(layer, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer.safetensors"]   # no temporary file left
    offload.release_layer(layer)
    assert offload.is_released(layer) and own_bytes(layer, "cpu") == 0
    assert layer.a.weight is layer.b.weight and isinstance(layer.a.weight, nn.Parameter)
    assert layer.low.dtype == torch.bfloat16 and not layer.low.requires_grad
    with pytest.raises(ValueError, match="released"):
        offload.write_layer(layer, tmp_path / "again.safetensors")
    offload.read_layer(layer, path, "cpu")
    after = layer.state_dict()
    assert list(after) == list(before)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(layer.table, table) and not offload.is_released(layer)
    assert layer.a.weight is layer.b.weight and layer.a.weight.requires_grad and not layer.low.requires_grad
    with torch.no_grad():
        layer.a.weight[0, 0] = 5.0                                     # still one tensor behind both names
    assert layer.b.weight[0, 0] == 5.0

    with pytest.raises(ValueError, match="other tensors than the layer"):
        offload.read_layer(nn.Linear(8, 8), path)
    other = Block()
    other.low = nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"low is \(3, 4\) torch.bfloat16 in the file but \(3, 4\) torch.float32"):
        offload.read_layer(other, path)


def test_disk_offload_matches_an_unoffloaded_run_within_a_budget_smaller_than_the_model(tmp_path, monkeypatch):
    float_model, done, full = six_layers()
    budget = budget_below_the_model(float_model)
    layer_bytes = max(own_bytes(layer) for layer in float_model.model.layers)
    other = own_bytes(float_model) - LAYERS * layer_bytes
    seen = []
    process = layerwise._layer_step

    def watch(run, i, layer, *args, **kwargs):
        layers = model.model.layers
        released = [offload.is_released(x) for x in layers]
        seen.append((i, own_bytes(model, "cpu"), released))
        return process(run, i, layer, *args, **kwargs)

    monkeypatch.setattr(layerwise, "_layer_step", watch)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, CALIB, offload="disk", device_budget=budget, **OPTS)
    resume_tests.assert_same(done, full, model, result)                 # the same bytes as without offload
    assert [i for i, _, _ in seen] == list(range(LAYERS))
    for i, host, released in seen:                                       # one layer in host memory at a time
        assert released == [j != i for j in range(LAYERS)]
        assert host <= other + layer_bytes
    mem = result.report.memory
    assert mem["peak_parameters_on_device"] <= budget < own_bytes(float_model)
    assert mem["peak_parameters_on_device"] == other + layer_bytes      # the booking agrees with the count here
    assert mem["peak_host_parameters"] == max(h for _, h, _ in seen)
    assert mem["need"]["total"] <= budget and mem["hessians_measured"] <= mem["need"]["hessians"]
    folder = mem["offload_dir"]
    assert not Path(folder).exists()                            # a temporary folder, removed
    assert "offload" in result.report.stage_totals() and "peak parameters on the device" in str(result)


def test_placement_moves_one_layer_and_keeps_or_removes_its_files(tmp_path, monkeypatch):
    from jgptq.config import PipelineConfig

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(4, 8)
            self.layers = nn.ModuleList([Block() for _ in range(3)])

    torch.manual_seed(0)
    model = Toy()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for keep in (True, False):
        folder = tmp_path / f"keep-{keep}"
        cfg = PipelineConfig(offload="disk", offload_dir=folder, keep_offload_files=keep)
        place = offload.Placement(model, model.layers, cfg, torch.device("cpu"))
        place.prepare()
        assert all(offload.is_released(x) for x in model.layers) and own_bytes(model, "cpu") == own_bytes(model.embed)
        layer = place.fetch(1)
        assert [offload.is_released(x) for x in model.layers] == [True, False, True]
        with torch.no_grad():
            layer.a.weight.add_(1)                                      # what the pipeline writes
        place.put_back(1)
        place.finish(failed=False)
        for name in ("layers.1.a.weight", "layers.1.b.weight"):                # tied: one tensor, two names
            state[name] += 1
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert model.layers[1].a.weight is model.layers[1].b.weight
        files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        assert files == ([f"offload-layer-{i:05d}.safetensors" for i in range(3)] if keep else [])
        assert place.memory["peak_parameters_on_device"] == own_bytes(model.embed) + own_bytes(layer)
    # reload=False: a failed run leaves the layers released and says where their files are
    place = offload.Placement(model, model.layers, PipelineConfig(offload="disk", offload_dir=tmp_path / "n",
                                                                  reload=False), torch.device("cpu"))
    place.prepare()
    place.finish(failed=True)
    assert all(offload.is_released(x) for x in model.layers) and "reload_all(model, " in place.failure_note()
    offload.reload_all(model, tmp_path / "n")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # a failure half-way through writing the files: the written layers are loaded back, the model is whole
    stale = tmp_path / "stale"
    stale.mkdir()
    offload.write_layer(Block(), offload.layer_file(stale, 2))          # a file of another run: never read
    write = offload.write_layer

    def fail_on_second(layer, path):
        if path.name.endswith("00001.safetensors"):
            raise OSError("disk full")
        write(layer, path)

    monkeypatch.setattr(offload, "write_layer", fail_on_second)
    place = offload.Placement(model, model.layers, PipelineConfig(offload="disk", offload_dir=stale),
                              torch.device("cpu"))
    with pytest.raises(OSError, match="disk full"):
        place.prepare()
    place.finish(failed=True)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    monkeypatch.undo()
    shared = Toy()
    shared.embed.weight = shared.layers[2].a.weight                     # a tensor inside and outside a layer
    with pytest.raises(ValueError, match=r"embed.weight is the same tensor as a.weight of decoder layer 2"):
        offload.Placement(shared, shared.layers, PipelineConfig(offload="disk"), torch.device("cpu"))
    with pytest.raises(ValueError, match="layer 0 is released"):
        offload.release_layer(model.layers[0])
        offload.Placement(model, model.layers, PipelineConfig(), torch.device("cpu"))


def test_cpu_offload_matches_and_books_one_layer_on_the_device():
    float_model, done, full = six_layers()
    budget = budget_below_the_model(float_model)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, CALIB, offload="cpu", device_budget=budget, **OPTS)
    resume_tests.assert_same(done, full, model, result)
    layer_bytes = own_bytes(float_model.model.layers[0])
    assert result.report.memory["peak_parameters_on_device"] == own_bytes(float_model) - (LAYERS - 1) * layer_bytes
    assert all(p.device.type == "cpu" for p in model.parameters())
    # without offload the whole model counts as resident on the device
    assert full.report.memory["peak_parameters_on_device"] == own_bytes(float_model)


def test_over_budget_runs_stop_before_any_work(tmp_path):
    float_model, _, _ = six_layers()
    model = copy.deepcopy(float_model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DeviceBudgetError, match=r"offload='none' keeps 6 decoder layers .* over device_budget .* "
                                                r"offload='cpu' .* offload='disk'"):
        jgptq.quantize_moe(model, CALIB, device_budget=budget_below_the_model(float_model), **OPTS)
    folder = tmp_path / "layers"
    with pytest.raises(DeviceBudgetError, match=r"decoder layer \d alone needs about .*parameters .*activations "
                                                r".*Hessians .*over device_budget 500.00 kB"):
        jgptq.quantize_moe(model, CALIB, offload="disk", offload_dir=folder, device_budget="500kB", **OPTS)
    assert not folder.exists()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for bad, match in [(dict(offload="ram"), "PipelineConfig.offload='ram'"),
                       (dict(offload_dir=folder), "only used with offload='disk'"),
                       (dict(offload="disk", reload=False), "needs offload_dir"),
                       (dict(device_budget="lots"), "not a number of bytes")]:
        with pytest.raises(ValueError, match=match):
            jgptq.quantize_moe(model, CALIB, **{**OPTS, **bad})


def test_stopped_disk_offloaded_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    float_model, done, full = six_layers()
    work, layers = tmp_path / "work", tmp_path / "layers"
    opts = dict(OPTS, offload="disk", offload_dir=layers, checkpoint_dir=work)
    original = resume_tests.stop_after(monkeypatch, 2)
    stopped = copy.deepcopy(float_model)
    with pytest.raises(resume_tests.Stop):
        jgptq.quantize_moe(stopped, CALIB, **opts)
    # after the error the layers were loaded back (finished ones quantized, the rest float) and the files removed
    assert not any(offload.is_released(x) for x in stopped.model.layers) and not layers.exists()
    for i, layer in enumerate(stopped.model.layers):
        ref = (done if i <= 2 else float_model).model.layers[i].state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in layer.state_dict().items())
    monkeypatch.setattr(resume_tests.resume.Checkpoint, "save_layer", original)
    solved = []
    process = layerwise._layer_step
    monkeypatch.setattr(layerwise, "_layer_step", lambda run, i, *a, **k: solved.append(i) or process(run, i, *a, **k))
    model = copy.deepcopy(float_model)
    budget = budget_below_the_model(float_model)                  # offload settings may change between runs
    result = jgptq.quantize_moe(model, CALIB, reload=False, device_budget=budget, **opts)
    assert solved == [3, 4, 5]
    # reload=False: the layers stay on meta, their quantized tensors in offload_dir; load_layer/reload_all load them
    assert all(offload.is_released(x) for x in model.model.layers)
    assert sorted(p.name for p in layers.iterdir()) == [f"offload-layer-{i:05d}.safetensors" for i in range(LAYERS)]
    offload.load_layer(model, 0, layers)
    assert [offload.is_released(x) for x in model.model.layers] == [False] + [True] * (LAYERS - 1)
    offload.reload_all(model, layers)
    resume_tests.assert_same(done, full, model, result)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_layers_leave_the_device_and_results_match(monkeypatch):
    float_model = build("qwen3_moe", num_hidden_layers=4).to("cuda")
    ref = copy.deepcopy(float_model)
    full = jgptq.quantize_moe(ref, CALIB, **OPTS)
    where = []
    process = layerwise._layer_step

    def watch(run, i, layer, *args, **kwargs):
        where.append([x.self_attn.q_proj.weight.device.type for x in model.model.layers])
        return process(run, i, layer, *args, **kwargs)

    monkeypatch.setattr(layerwise, "_layer_step", watch)
    for mode in ("cpu", "disk"):
        where.clear()
        model = copy.deepcopy(float_model)
        result = jgptq.quantize_moe(model, CALIB, offload=mode, **OPTS)
        away = "cpu" if mode == "cpu" else "meta"
        assert len(where) == 4 and result.report.memory["moves_ahead"] is True
        for i, row in enumerate(where):  # moves run ahead: the neighbours may be on the device too
            assert row[i] == "cuda" and all(row[j] == away for j in range(i - 1))
            if mode == "disk":  # written to files before the run
                assert all(row[j] == away for j in range(i + 2, 4))
        assert all(p.device.type == "cpu" for p in model.model.layers.parameters())
        model.model.layers.to("cuda")
        resume_tests.assert_same(ref, full, model, result)
        assert 0 < result.report.memory["cuda_max_allocated"]
        if mode == "disk":  # cpu: the layers started on the device and left it beside the work
            assert result.report.memory["peak_parameters_on_device"] < own_bytes(float_model)
        else:
            assert result.report.memory["peak_parameters_on_device"] == own_bytes(float_model)
    # a model that starts in host memory: at most the current layer and its neighbours on the device; the bytes
    # of a run whose layers visit the device one at a time, in line
    ref = copy.deepcopy(float_model).cpu()
    full = jgptq.quantize_moe(ref, CALIB, device="cuda", **OPTS)
    model = copy.deepcopy(float_model).cpu()
    result = jgptq.quantize_moe(model, CALIB, offload="cpu", device="cuda", **OPTS)
    resume_tests.assert_same(ref, full, model, result)
    assert result.report.memory["peak_parameters_on_device"] <= 3 * own_bytes(float_model.model.layers[0])
