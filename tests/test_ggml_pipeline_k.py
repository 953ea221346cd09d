"""A 256-column-block GGML format (q4_k) through jgptq.quantize_moe on a model whose rows are 256 wide."""

import jgptq
from tests.test_ggml_pipeline import CALIB, OPTS, assert_payloads_are_the_model
from tests.tiny_models import build


def test_k_format_on_256_wide_model():
    """q4_k (256-column blocks) through the pipeline: q/k/v/o share one shape, so one linear solve per layer."""
    model = build("qwen3_moe", hidden_size=256, moe_intermediate_size=256, head_dim=64, num_attention_heads=4,
                  num_key_value_heads=4, num_hidden_layers=1)
    result = jgptq.quantize_moe(model, CALIB, format="q4_k", **OPTS)
    assert_payloads_are_the_model(model, result)
    rec = result.weights["model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert rec.format == "q4_k" and rec.payload.shape == (256, 1, 144)
    assert {r.method for r in result.report.records} == {"gptq"}
