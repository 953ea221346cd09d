"""jgptq.plan: one ordered list of rules, resolved once; the single decision of a matrix's method and format."""

import pytest

from jgptq import plan
from jgptq.config import PipelineConfig


def targets(cols=256, layers=2):
    names = ["self_attn.q_proj", "self_attn.v_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return [plan.Target(n, i, cols, f"model.layers.{i}.{n}") for i in range(layers) for n in names]


def test_rules_in_order_exclusions_first_then_formats_then_the_mix():
    cfg = PipelineConfig.build(None, format="q4_k", formats=(("v_proj", "q8_0"), ("proj", "q5_k")),
                               exclude=("q_proj",), mix="q4_k_m")
    assert [(r.pattern, r.skip, r.format) for r in plan.rules(cfg)] == [
        ("q_proj", True, None), ("v_proj", False, "q8_0"), ("proj", False, "q5_k")]
    got = plan.resolve(cfg, targets(), 2, 4)
    assert sorted(got.skipped) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert got.matrices["model.layers.1.self_attn.v_proj"].format == "q8_0"
    assert got.matrices["model.layers.0.mlp.experts.down_proj"].format == "q5_k"   # a rule beats the mix
    assert got.unmatched == [] and got.notes == []
    assert {m.method for m in got.matrices.values()} == {"gptq"}


def test_the_mix_and_the_default_format_apply_where_no_rule_matches():
    cfg = PipelineConfig.build(None, mix="q4_k_m")
    got = plan.resolve(cfg, targets(layers=8), 8, 4)
    assert got.matrices["model.layers.0.mlp.experts.down_proj"].format == "q6_k"     # use_more_bits(0, 8)
    assert got.matrices["model.layers.1.mlp.experts.down_proj"].format == "q4_k"
    assert got.matrices["model.layers.1.self_attn.q_proj"].format == "q4_k"


def test_rules_that_match_nothing_are_reported():
    cfg = PipelineConfig.build(None, format="q4_0", formats=(("w2$", "q8_0"),), exclude=("lm_head",))
    got = plan.resolve(cfg, targets(), 2, 4)
    assert got.unmatched == ["exclude rule 'lm_head' matched no weight", "formats rule 'w2$' matched no weight"]


def test_widths_are_checked_with_the_matrix_named():
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: 96 input columns are not a multiple "
                                         r"of group_size 64"):
        plan.resolve(PipelineConfig.build(None, group_size=64), targets(cols=96), 2, 4)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj: 96 input columns"):
        plan.resolve(PipelineConfig.build(None, group_size=64), targets(cols=96)[2:], 2, 4)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: 96 input columns are not a multiple "
                                         r"of the q4_k block size 256"):
        plan.resolve(PipelineConfig.build(None, format="q4_k"), targets(cols=96), 2, 4)
    got = plan.resolve(PipelineConfig.build(None, format="q4_k", block_fallback="llama.cpp"), targets(cols=96), 2, 4)
    assert {m.format for m in got.matrices.values()} == {"q5_0"} and len(got.notes) == 8
    assert got.notes[0] == ("model.layers.0.self_attn.q_proj: 96 input columns are not a multiple of the q4_k "
                            "block size 256; q5_0 used instead (block_fallback)")


def test_rtn_method_and_integer_grids_are_planned_too():
    cfg = PipelineConfig.build(None, method="rtn", bits=3, group_size=128)
    got = plan.resolve(cfg, targets(), 2, 4)
    assert {(m.method, m.format, m.quant.bits) for m in got.matrices.values()} == {("rtn", "int", 3)}
