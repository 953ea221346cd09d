"""The calibrate_profile benchmark at tiny sizes: it times every section it wraps, restores the wrapped functions
afterwards, and profiles each offload mode asked for."""

import json

import pytest

from benchmarks import calibrate_profile
from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline import experts_capture
from jgptq_torch.pipeline import layerwise
from jgptq import hessian


@pytest.mark.slow     # about 35 s on 2 cores
def test_small_profile_times_its_sections_and_restores_the_pipeline(tmp_path):
    before = (experts_capture.experts_forward, capture.Collector._add_grouped, capture.Collector._add, capture.to_jax,
              layerwise._layer_step, layerwise.run_layer, hessian.accumulate_slots)
    out = tmp_path / "profile.json"
    assert calibrate_profile.main(["--small", "--layers", "2", "--offload", "none,cpu", "--out", str(out)]) == 0
    after = (experts_capture.experts_forward, capture.Collector._add_grouped, capture.Collector._add, capture.to_jax,
             layerwise._layer_step, layerwise.run_layer, hessian.accumulate_slots)
    assert after == before
    data = json.loads(out.read_text())
    warm = data["sections"]["warm_mean_s"]
    assert {"layer forward", "experts loop", "routed packing", "group accumulate", "linear hooks"} <= set(warm)
    assert all(v > 0 for v in warm.values())
    assert set(data["host_profile"]) == {"none", "cpu"}
    for run in data["host_profile"].values():
        assert run["stage_s"]["calibrate"] > 0 and run["top_own_s"]
