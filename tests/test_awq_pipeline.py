"""AWQ through the torch pipeline on tiny qwen3_moe and llama models: the folded float model (scales applied,
weights left in float) gives the original's logits; a norm the fold does not commute with is undone and reported;
the quantized model is closer to the float one than round-to-nearest's; what the fold refuses."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq import methods
from jgptq.methods import awq
from jgptq.methods.registry import BucketOutput
from jgptq.methods.rtn import RoundToNearest
from tests.tiny_models import build, next_token_kl, token_ids

OPTS = {"bits": 3, "group_size": 16, "batch_size": 4, "progress": False}


def _model(family):
    """A tiny model whose norms weigh the hidden channels unevenly (the case pre-scaling is for)."""
    model = build(family)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("layernorm.weight"):
                p.copy_(torch.exp(torch.randn(p.shape, generator=g)))
    return model


class _Float(RoundToNearest):
    """The solve of a fold-only run: the (scaled) float weights written back as they are."""

    def solve(self, bucket):
        fields = super().solve(bucket).fields
        return BucketOutput({**fields, "weight": bucket.weights.astype("float32")})


@pytest.fixture
def awq_float():
    methods.register(awq.AWQ("awq_float", _Float()), replace=True)
    yield "awq_float"
    methods.unregister("awq_float")


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_folded_float_model_keeps_the_logits(family, awq_float):
    model = _model(family)
    ref = copy.deepcopy(model)
    calib = {"input_ids": token_ids(8, 32, seed=3)}
    res = jgptq.quantize_moe(model, calib, method=awq_float, **OPTS)
    groups = res.report.prescale
    for i in range(2):
        layer = groups[f"model.layers.{i}"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert layer[norm]["alpha"], layer[norm]          # scaled, not left at 1
        assert layer["self_attn.o_proj"]["alpha"] is None
    if family == "qwen3_moe":   # every expert's gate/up and the router read the second norm
        assert groups["model.layers.0"]["post_attention_layernorm"]["readers"] == ["mlp.gate", "mlp.experts"]
        assert groups["model.layers.0"]["mlp.experts.down_proj"]["alpha"] is None
        assert not torch.equal(model.model.layers[0].mlp.gate.weight, ref.model.layers[0].mlp.gate.weight)
    assert not res.report.warnings
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, ref.get_parameter(n))]
    assert any(n.endswith("input_layernorm.weight") for n in changed)
    ids = token_ids(4, 32, seed=9)
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    # the stored scale's inverse is in the norm: norm * s is the original
    s_norm = ref.model.layers[0].input_layernorm.weight / model.model.layers[0].input_layernorm.weight
    q = model.model.layers[0].self_attn.q_proj.weight / ref.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(q, s_norm[None, :].expand_as(q), rtol=1e-4, atol=1e-4)


def test_a_fold_that_moves_the_output_is_undone(awq_float):
    model = _model("llama")
    norm = model.model.layers[0].post_attention_layernorm
    plain = norm.forward
    norm.forward = lambda x: plain(x) + 0.5        # not weight * normalized(x): dividing the weight moves it
    ref = copy.deepcopy(model)
    res = jgptq.quantize_moe(model, {"input_ids": token_ids(8, 32, seed=3)}, method=awq_float, **OPTS)
    assert any("model.layers.0: the folded scales changed" in w for w in res.report.warnings)
    assert res.report.prescale["model.layers.0"]["post_attention_layernorm"]["alpha"] is None
    assert res.report.prescale["model.layers.1"]["post_attention_layernorm"]["alpha"]
    torch.testing.assert_close(model.model.layers[0].input_layernorm.weight, ref.model.layers[0].input_layernorm.weight)
    ids = token_ids(4, 32, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_quantized_no_worse_than_round_to_nearest(family):
    model = _model(family)
    calib = {"input_ids": token_ids(8, 32, seed=3)}
    ids = token_ids(4, 32, seed=9)
    kl = {}
    for method in ("rtn", "awq_rtn", "awq"):
        q = copy.deepcopy(model)
        res = jgptq.quantize_moe(q, calib, method=method, **OPTS)
        kl[method] = next_token_kl(model, q, ids)
        if method != "rtn":   # both norms of every layer were searched and folded
            assert all(res.report.prescale[f"model.layers.{i}"][n]["alpha"] is not None for i in range(2)
                       for n in ("input_layernorm", "post_attention_layernorm"))
    assert kl["awq_rtn"] <= kl["rtn"], kl
    assert kl["awq"] <= kl["rtn"], kl
    assert np.isfinite(list(kl.values())).all()


def test_refusals():
    model = build("llama")
    calib = {"input_ids": token_ids(2, 8, seed=3)}
    with pytest.raises(ValueError, match="checkpoint_dir"):
        jgptq.quantize_moe(model, calib, method="awq", checkpoint_dir="/nonexistent", **OPTS)
    with pytest.raises(ValueError, match="integer grids"):
        jgptq.quantize_moe(model, calib, method="awq", format="q4_k", progress=False)
