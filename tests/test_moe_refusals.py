# ruff: noqa: C408 -- configs read best as keyword arguments
"""MoE structures jgptq cannot quantize faithfully are refused before any work with the reason; a fused checkpoint
key whose rows transformers reorders on load gets a record in the checkpoint's order; routers stay in float."""

import re

import pytest
import torch

import jgptq
from jgptq_torch import models
from jgptq_torch.models import UnsupportedModelError
from tests.tiny_models import COMMON, build, token_ids

transformers = pytest.importorskip("transformers")
CALIB = token_ids(2, 16, seed=1)
RUN = {"method": "rtn", "bits": 4, "group_size": 16, "batch_size": 2, "progress": False}
# family: (config class, model class, settings over COMMON, what the refusal must say)
REFUSED = {
    # the checkpoint holds q, k and v as one query_key_value key that transformers splits on load
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM",
                   dict(head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, first_k_dense_replace=1),
                   "query_key_value.weight' holds the rows of several quantized parameters"),
    # shared experts stacked in a 3-D tensor outside transformers' experts interface
    "inkling_text": ("InklingTextConfig", "InklingForCausalLM",
                     dict(head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, n_routed_experts=8,
                          num_experts_per_tok=2, n_shared_experts=2, eos_token_id=None),
                     "3-D weight (2, 32, 64) outside an experts module"),
}


def _build(family):
    cfg_name, model_name, extra, _ = REFUSED[family]
    torch.manual_seed(0)
    cls = getattr(transformers, cfg_name)
    base = cls().to_dict()
    common = {k: v for k, v in COMMON.items() if k in base}      # a family may name its sizes otherwise
    return getattr(transformers, model_name)(cls(**{**common, **extra})).eval()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_with_the_reason(family):
    model = _build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=re.escape(REFUSED[family][3])):
        jgptq.quantize_moe(model, CALIB, **RUN)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # refused before any write


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_interleaved_fused_key_record_is_the_checkpoint_tensor(tmp_path):
    """Inkling 2's checkpoint interleaves each expert's gate and up rows in one ``w13_weight`` key (transformers
    concatenates them on load): the run's record under that key dequantizes to the tensor ``save_pretrained`` writes
    from the quantized model."""
    from safetensors.numpy import load_file

    model = build("inkling2_text")
    result = jgptq.quantize_moe(model, CALIB, **RUN)
    keys = [k for k in result.weights if k.endswith("experts.w13_weight")]
    assert keys
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(f))
    for key in keys:
        want = saved[key]
        got = result.weights[key].dequantize()
        assert got.shape == want.shape, key
        assert (got == want).all(), key
        gate_up = model.get_parameter(key.replace("w13_weight", "gate_up_proj").replace(".llm.", ".")).detach()
        assert not torch.equal(torch.from_numpy(want), gate_up)                   # the order differs indeed


def test_router_gate_is_a_router():
    """Doge's retrieval experts are rows of embeddings chosen by a Linear ``router_gate``: the router stays in float,
    the shared MLP is quantized."""
    cfg = transformers.DogeConfig(**{**COMMON, "intermediate_size": 128, "is_moe": True, "num_experts": 16,
                                     "num_experts_per_tok": 2})
    layer = transformers.DogeForCausalLM(cfg).model.layers[0]
    t = models.layer_targets(layer)
    assert ("mlp.router_gate", "router") in t.skipped
    assert {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} <= set(t.linears)
    assert "mlp.router_gate" not in t.linears
