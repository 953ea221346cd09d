import json

import pytest

from jgptq_torch.report import Report
from jgptq import MoEConfig, PipelineConfig, QuantConfig


def test_build_routes_keywords_to_the_right_config():
    cfg = PipelineConfig.build(QuantConfig(bits=3), group_size=32, calibration="all_experts", min_tokens=8,
                               batch_size=2, exclude=r"o_proj$")
    assert (cfg.quant.bits, cfg.quant.group_size, cfg.moe.calibration, cfg.moe.min_tokens) == (3, 32, "all_experts", 8)
    assert cfg.batch_size == 2 and cfg.exclude == ("o_proj$",)
    json.dumps(cfg.to_dict())
    with pytest.raises(TypeError, match="unknown option 'bitz'"):
        PipelineConfig.build(None, bitz=3)
    with pytest.raises(TypeError, match="config must be"):
        PipelineConfig.build("q4")


@pytest.mark.parametrize("kwargs, match", [
    (dict(calibration="some"), "MoEConfig.calibration"), (dict(min_tokens=0), "MoEConfig.min_tokens"),
    (dict(min_token_fraction=1.5), "MoEConfig.min_token_fraction"), (dict(method="smoothquant"), "PipelineConfig.method"),
    (dict(hessian_dtype="float16"), "PipelineConfig.hessian_dtype"), (dict(batch_size=0), "PipelineConfig.batch_size"),
    (dict(exclude=["("]), "not a regular expression"), (dict(bits=1), "QuantConfig.bits"),
    ({"router_weighting": "cubic"}, "MoEConfig.router_weighting"),
    ({"router_weighting": "squared", "calibration": "all_experts"}, "MoEConfig.router_weighting='squared'.*routed"),
])
def test_invalid_options_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig.build(None, **kwargs)


def test_threshold_takes_the_larger_of_count_and_fraction():
    assert MoEConfig().threshold(10_000) == 1
    assert MoEConfig(min_tokens=4, min_token_fraction=0.005).threshold(10_000) == 50
    assert MoEConfig(min_tokens=64, min_token_fraction=0.005).threshold(10_000) == 64


def test_full_coverage_table_marks_experts_below_the_threshold():
    rep = Report(config={}, coverage={"m.experts": [5, 0, 12, 3]}, thresholds={"m.experts": 4})
    text = rep.coverage_table(full=True)
    assert "1:      0*" in text and "3:      3*" in text and "2:     12 " in text
    assert "below 4: [1, 3]" in rep.coverage_table()


def test_default_act_order_is_static_on_integer_grids_and_none_for_ggml_formats():
    q = QuantConfig()
    static = QuantConfig(act_order="static")
    assert q.act_order == "static" and q == static and hash(q) == hash(static)
    assert QuantConfig(format="q4_k").act_order == "none"
    assert q.replace(format="q4_k").act_order == "none" and q.replace(bits=3).act_order == "static"
    assert q.replace(format="q4_k").replace(format="int").act_order == "static"
    assert PipelineConfig.build(format="q4_k").quant.act_order == "none"
    assert PipelineConfig(mix="q4_k_m").quant.act_order == "none"
    assert PipelineConfig.build(act_order="none").quant.act_order == "none"
    assert QuantConfig(act_order="none").replace(bits=3).act_order == "none"   # a chosen order stays
    with pytest.raises(ValueError, match="QuantConfig.act_order='static'"):
        QuantConfig(act_order="static").replace(format="q4_k")
    assert PipelineConfig().to_dict()["quant"]["act_order"] == "static"       # what the resume fingerprint sees


def test_what_leaves_out_the_where_fields_only():
    """The resume fingerprint's view of a config: changing where and how visibly a run works leaves it equal,
    changing what it computes does not; the fields left out are those marked ``where``."""
    base = PipelineConfig()
    moved = PipelineConfig.build(base, progress=False, offload="disk", offload_dir="layers", device_budget="1GB",
                                 reload=False, keep_offload_files=True)
    assert moved.what() == base.what()
    assert set(base.to_dict()) - set(base.what()) == {"progress", "offload", "offload_dir", "device_budget",
                                                      "reload", "keep_offload_files"}
    assert PipelineConfig.build(base, bits=3).what() != base.what()
    assert PipelineConfig.build(base, batch_size=2).what() != base.what()
