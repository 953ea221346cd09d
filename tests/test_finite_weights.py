"""NaN and Inf in the weights a run will quantize are refused before any layer's work, named by parameter, expert
index and projection rows; excluded weights are not scanned; huge finite values are not mistaken for Inf."""

import pytest
import torch

import jgptq
from jgptq_torch.pipeline import layerwise
from jgptq_torch.pipeline.weight_checks import CorruptWeightsError, nonfinite_weights
from tests.tiny_models import build, token_ids

CALIB = token_ids(4, 32, seed=1)
OPTS = dict(bits=4, group_size=16, batch_size=4, progress=False)
ADVICE = (". GPTQ cannot quantize them: repair the checkpoint, or leave these weights in floating point with "
          "exclude=[...] (command line: --exclude)")


@pytest.fixture
def no_layer_work(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a layer was processed before the weights were checked")

    monkeypatch.setattr(layerwise, "_layer_step", never)
    monkeypatch.setattr(layerwise, "capture_inputs", never)


def refusal(model, **kw) -> str:
    with pytest.raises(CorruptWeightsError) as caught:
        jgptq.quantize_moe(model, CALIB, **{**OPTS, **kw})
    return str(caught.value)


@pytest.mark.parametrize("offload", ["none", "cpu", "disk"])
def test_nan_and_inf_are_named_by_weight_expert_and_rows(no_layer_work, offload, tmp_path):
    model = build("qwen3_moe")   # gate_up_proj (E=8, 2I=64, H=64): rows 0..31 gate, 32..63 up
    inter = model.config.moe_intermediate_size
    with torch.no_grad():
        layer0, layer1 = model.model.layers
        layer0.self_attn.k_proj.weight[3, 5] = float("-inf")
        layer1.mlp.experts.gate_up_proj[3, 1, 5] = float("nan")
        layer1.mlp.experts.gate_up_proj[3, inter - 1, 0] = float("nan")
        layer1.mlp.experts.gate_up_proj[5, inter, 2] = float("inf")       # the first up row
        layer1.mlp.experts.gate_up_proj[5, 2 * inter - 1, 2] = float("nan")
        layer1.mlp.experts.down_proj[0, 7, 7] = float("inf")
    where = {"offload_dir": str(tmp_path / "layers")} if offload == "disk" else {}
    assert refusal(model, offload=offload, **where) == (
        "weights to quantize hold NaN or Inf values: model.layers.0.self_attn.k_proj.weight holds 1 Inf value; "
        "model.layers.1.mlp.experts.gate_up_proj: expert 3 (gate rows) holds 2 NaN values; "
        "model.layers.1.mlp.experts.gate_up_proj: expert 5 (up rows) holds 1 NaN and 1 Inf values; "
        "model.layers.1.mlp.experts.down_proj: expert 0 holds 1 Inf value" + ADVICE)
    assert not (tmp_path / "layers").exists() or not any((tmp_path / "layers").iterdir())


def test_interleaved_transposed_experts_name_gate_and_up_rows(no_layer_work):
    model = build("gpt_oss")   # gate_up_proj stored (E, H, 2I), gate and up interleaved: up = [:, :, 1::2]
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[2, 4, 1] = float("nan")    # column 1: up row 0
        model.model.layers[0].mlp.experts.gate_up_proj[1, 0, 6] = float("inf")    # column 6: gate row 3
        model.model.layers[1].mlp.experts.down_proj[3, 0, 0] = float("nan")
    assert refusal(model) == (
        "weights to quantize hold NaN or Inf values: model.layers.0.mlp.experts.gate_up_proj: expert 1 (gate rows) "
        "holds 1 Inf value; model.layers.0.mlp.experts.gate_up_proj: expert 2 (up rows) holds 1 NaN value; "
        "model.layers.1.mlp.experts.down_proj: expert 3 holds 1 NaN value" + ADVICE)


def test_excluded_weights_are_not_scanned_and_long_lists_are_cut():
    model = build("qwen3_moe")
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    result = jgptq.quantize_moe(model, CALIB, method="rtn", exclude=[r"q_proj"], **OPTS)
    assert torch.isnan(result.model.model.layers[0].self_attn.q_proj.weight[0, 0])   # left as it was
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.fill_(float("nan"))
    message = refusal(model, exclude=[r"q_proj"])   # 2 layers x 8 experts: 8 named, 8 more counted
    assert message.count("holds 2048 NaN values") == 8 and message.endswith(f"; and 8 more{ADVICE}")


def test_finite_weights_whose_sum_overflows_are_not_reported():
    from jgptq_torch import models

    model = build("qwen3_moe").to(torch.bfloat16)
    big = torch.finfo(torch.bfloat16).max
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[4, 0, :4] = big    # sums past float32's range: Inf
    targets = [models.layer_targets(layer) for layer in model.model.layers]
    assert torch.isinf(model.model.layers[0].mlp.experts.down_proj[4].sum(dtype=torch.float32))
    assert nonfinite_weights(targets, "model.layers") == []
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[4, 1, 0] = float("nan")
    assert nonfinite_weights(targets, "model.layers") == [
        "model.layers.0.mlp.experts.down_proj: expert 4 holds 1 NaN value"]
