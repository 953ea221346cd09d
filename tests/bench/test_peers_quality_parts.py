"""The pieces of the peers_quality benchmark: row specs, the paired difference, the jgptq row it is taken against,
the grid check of a reloaded model, and its chart."""

import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from benchmarks.peers_quality import best_row, grid_check, paired, short_label
from benchmarks.quality.peers_chart import kl_seconds_chart
from benchmarks.quality.peers_worker import method_spec


def test_method_spec_splits_the_method_from_typed_overrides_and_refuses_malformed_ones():
    assert method_spec("gptq") == ("gptq", {})
    assert method_spec("gptq+calibration=all_experts+act_order=static+damp=0.1+batch_size=4") == (
        "gptq", {"calibration": "all_experts", "act_order": "static", "damp": 0.1, "batch_size": 4})
    assert method_spec("gptq+static_groups=true+sym=False") == ("gptq", {"static_groups": True, "sym": False})
    for bad in ("gptq+damp", "+damp=1", "gptq+=1"):
        with pytest.raises(ValueError):
            method_spec(bad)


def test_chart_labels_shorten_the_overrides():
    assert short_label("gptq") == "gptq"
    assert short_label("gptq+router_weighting=squared+act_order=none") == "gptq+rw:squared+none"
    assert short_label("gptq+calibration=all_experts+act_order=group_aware") == "gptq+all+gar"


def test_paired_difference_of_constant_shift_has_zero_spread_and_counts_where_b_is_lower():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    d = paired(a + 0.5, a)
    assert d == {"mean": 0.5, "stderr": 0.0, "share_b_lower": 1.0}
    d = paired([1.0, 0.0], [0.0, 1.0])          # differences +1, -1: sd sqrt(2), stderr 1
    assert d["mean"] == 0.0 and abs(d["stderr"] - 1.0) < 1e-12 and d["share_b_lower"] == 0.5


def test_best_row_is_the_lowest_kl_of_jgptq_rows_only():
    rows = {"jgptq:rtn": {"side": "jgptq", "kl_mean": 3.0}, "jgptq:gptq": {"side": "jgptq", "kl_mean": 1.0},
            "jgptq:broken": {"side": "jgptq", "error": "x"},
            "llmcompressor:gptq": {"side": "llmcompressor", "kl_mean": 0.5}}
    assert best_row(rows) == "jgptq:gptq"
    assert best_row({"llmcompressor:gptq": rows["llmcompressor:gptq"]}) is None


class _Weights(torch.nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


def test_grid_check_counts_levels_per_group_and_the_share_of_changed_weights():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 256, generator=g)
    codes = torch.randint(-8, 8, (4, 256), generator=g).float()
    scales = torch.rand(4, 2, 1, generator=g) + 0.1
    quant = (codes.reshape(4, 2, 128) * scales).reshape(4, 256)      # at most 16 values in each group of 128
    reference = _Weights(q_proj=ref, norm=torch.ones(8))
    check = grid_check(_Weights(q_proj=quant, norm=torch.zeros(8)), reference, bits=4, group=128)
    assert check["tensors"] == 1 and check["ok"] and check["max_distinct_per_group"] == 16
    assert check["share_changed"] == 1.0
    seventeen = quant.clone()
    seventeen[0, 0] = 1e3                                           # a seventeenth value in group (0, 0)
    assert not grid_check(_Weights(q_proj=seventeen), reference, bits=4, group=128)["ok"]
    same = ref.clone()
    same[:, :128] = quant[:, :128]
    assert grid_check(_Weights(q_proj=same), reference, bits=8, group=128)["share_changed"] == 0.5
    assert not grid_check(_Weights(norm=torch.ones(8)), reference, bits=4, group=128)["ok"]   # nothing quantized


def test_chart_draws_every_positive_point_higher_for_more_kl_and_righter_for_more_seconds():
    series = {"jgptq int4": [(10.0, 1e-5, 1e-6, "rtn"), (40.0, 2e-6, 2e-7, "gptq")],
              "llm-compressor int4": [(900.0, 3e-6, 3e-7, "autoround"), (0.0, 1e-6, 0.0, "no time")]}
    root = ET.fromstring(kl_seconds_chart(series, title="t"))
    circles = {c.find("{http://www.w3.org/2000/svg}title").text.split(":")[0]: (float(c.get("cx")), float(c.get("cy")))
               for c in root.iter("{http://www.w3.org/2000/svg}circle")}
    assert set(circles) == {"jgptq int4 rtn", "jgptq int4 gptq", "llm-compressor int4 autoround"}
    assert circles["jgptq int4 rtn"][1] < circles["llm-compressor int4 autoround"][1] < circles["jgptq int4 gptq"][1]
    assert circles["jgptq int4 rtn"][0] < circles["jgptq int4 gptq"][0] < circles["llm-compressor int4 autoround"][0]
    with pytest.raises(ValueError):
        kl_seconds_chart({"empty": [(0.0, 0.0, 0.0, "x")]}, title="t")


def test_llmcompressor_recipes_use_its_symmetric_presets_of_the_width_and_ignore_lm_head_and_routers():
    pytest.importorskip("llmcompressor")
    from benchmarks.quality.peers_worker import IGNORE, lc_recipe

    gptq = lc_recipe("gptq", 3, 128)
    assert gptq.scheme == "W3A16" and gptq.ignore == IGNORE
    _, quant = lc_recipe("awq", 4, 128)
    assert quant.scheme == "W4A16" and quant.ignore == IGNORE
    with pytest.raises(ValueError):
        lc_recipe("gptq", 4, 64)


def _rows(best_s=30.0, autoround_s=600.0):
    return {"jgptq:gptq": {"side": "jgptq", "kl_mean": 2.0, "quantize_s": 20.0},
            "jgptq:gptq_ef_half": {"side": "jgptq", "kl_mean": 1.0, "quantize_s": best_s},
            "llmcompressor:gptq": {"side": "llmcompressor", "kl_mean": 3.0, "quantize_s": 60.0},
            "llmcompressor:autoround": {"side": "llmcompressor", "kl_mean": 2.5, "quantize_s": autoround_s}}


def test_verdict_holds_only_when_every_peer_is_higher_beyond_its_stderr_and_time_is_a_tenth_of_autoround():
    from benchmarks.quality.peers_verdict import verdict

    base = np.array([1.0, 0.0, 1.0, 0.0] * 8)           # the best row's per-token KL, mean 0.5
    noise = np.array([1.0, -1.0] * 16)                  # paired differences of +-1: stderr 1/sqrt(31)
    per_token = {"jgptq:gptq": base + 0.1, "jgptq:gptq_ef_half": base,
                 "llmcompressor:gptq": base + 2.0 + noise, "llmcompressor:autoround": base + 0.01 + noise}
    v = verdict(_rows(), per_token)
    assert v["best"] == "jgptq:gptq_ef_half" and v["time_ratio_vs_autoround"] == 30.0 / 600.0 and v["within_time"]
    gptq, autoround = v["peers"]["llmcompressor:gptq"], v["peers"]["llmcompressor:autoround"]
    assert abs(gptq["minus_best"] - 2.0) < 1e-12 and abs(gptq["minus_best_stderr"] - 1 / np.sqrt(31)) < 1e-12
    assert gptq["best_lower_beyond_stderr"] and not autoround["best_lower_beyond_stderr"]   # 0.01 < 0.18
    assert not v["lower_than_every_peer"] and not v["claim_holds"]
    per_token["llmcompressor:autoround"] = base + 1.0 + noise
    assert verdict(_rows(), per_token)["claim_holds"]
    slow = verdict(_rows(best_s=61.0), per_token)                       # over a tenth of AutoRound's 600 s
    assert slow["lower_than_every_peer"] and not slow["within_time"] and not slow["claim_holds"]


def test_verdict_counts_a_failed_or_skipped_peer_against_the_claim():
    from benchmarks.quality.peers_verdict import verdict

    rows = _rows()
    del rows["llmcompressor:autoround"]["kl_mean"]
    rows["llmcompressor:autoround"]["skipped"] = "deadline"
    base = np.linspace(0.0, 1.0, 16)
    v = verdict(rows, {"jgptq:gptq_ef_half": base, "jgptq:gptq": base + 1, "llmcompressor:gptq": base + 1})
    assert v["peers"]["llmcompressor:autoround"] == {"measured": False, "why": "deadline",
                                                     "best_lower_beyond_stderr": False}
    assert v["time_ratio_vs_autoround"] is None and not v["claim_holds"]
    assert verdict({"llmcompressor:gptq": rows["llmcompressor:gptq"]}, {})["best"] is None
