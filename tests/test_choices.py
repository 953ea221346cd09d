"""The one question a target_bpw run asks before any work (jgptq.choices.layout): every matrix a rule holds with
its format and exact size, every other with its candidates, their sizes worked by hand from the GGML block sizes
(q8_0: 34 bytes per 32 weights, q4_k: 144 per 256, q4_0: 18 per 32) and the plans made with them."""

import pytest

from jgptq import choices, plan
from jgptq.config import PipelineConfig


def sized(name, cols, rows=8, count=1, layer=0):
    return choices.Sized(plan.Target(name, layer, cols, f"model.layers.{layer}.{name}.weight"), rows, count)


def test_held_matrices_keep_their_rule_and_free_ones_get_sized_planned_candidates():
    cfg = PipelineConfig.build(None, format="q4_k", target_bpw=5.0, target_formats=("q4_0", "q8_0"),
                               formats=[(r"v_proj$", "q8_0")], exclude=[r"o_proj$"])
    got = choices.layout(cfg, [sized("self_attn.v_proj", 256), sized("self_attn.o_proj", 256),
                               sized("mlp.experts.down_proj", 64, rows=4, count=3)], n_layers=2, n_expert=3)
    assert got.fixed == {"model.layers.0.self_attn.v_proj.weight": ("q8_0", 8 * 256 // 32 * 34 * 8),
                         "model.layers.0.self_attn.o_proj.weight": ("float", 8 * 256 * 16)}
    free = got.free["model.layers.0.mlp.experts.down_proj.weight"]
    assert list(free) == ["q4_0", "q8_0"]
    assert {f: bits for f, (bits, _) in free.items()} == {"q4_0": 3 * 4 * 2 * 18 * 8, "q8_0": 3 * 4 * 2 * 34 * 8}
    assert {f: p.format for f, (_, p) in free.items()} == {"q4_0": "q4_0", "q8_0": "q8_0"}
    assert got.weights == 2 * 8 * 256 + 3 * 4 * 64


def test_a_matrix_no_candidate_fits_is_named():
    cfg = PipelineConfig.build(None, format="q4_k", target_bpw=5.0, target_formats=("q4_k",))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: no candidate format of target_bpw "
                                         r"\(q4_k\) fits its 96 input columns"):
        choices.layout(cfg, [sized("mlp.down_proj", 96)], n_layers=1, n_expert=0)
